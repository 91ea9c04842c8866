"""The main job with gateway.enabled end to end on CPU: the example agent program (examples/agent_program, its own
`openai` tool loop in a thread) trains through the endpoint on SmolLM2's tiny twin in vLLM, FSDP2 on gloo, and the
greedy evals run the same agent through their own endpoint. Exactness (trained ids = sampled ids) is unit-tested
in test_gateway.py; here: the run finishes, its step trained on gateway step samples, and the agent's turns are
readable in rollouts.jsonl."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(1500)  # a hang guard sized for a loaded 2-core CPU without bf16 (5 min alone beside a test run)
def test_the_agent_program_recipe_trains_and_evaluates_through_the_endpoint(tmp_path):
    """Plumbing (the endpoint's calls become the step's samples, evals run the agent, rollouts are readable), so on
    the tiny model: SmolLM2's chat template and token ids with none of its forward cost."""
    from skyrl_stepwise.loop.rollout_samples import load_rollouts

    import importlib.util

    # by its file, under its own name: examples/mini_swe_agent has a make_data.py too, and `import make_data`
    # returned whichever another test module imported first
    spec = importlib.util.spec_from_file_location("agent_program_make_data",
                                                  REPO / "examples" / "agent_program" / "make_data.py")
    make_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_data)
    train, val = make_data.main(tmp_path / "data")
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))  # the agent's module
    command = [sys.executable, "-m", "skyrl_stepwise.cli.train", "experiment=agent_program_tiny", "total_steps=1",
               "model_path=smollm2-tiny",
               f"data.train_path={train}", f"data.val_path={val}", "trainer.ckpt_interval=0",
               "trainer.algorithm.dynamic_sampling=false", "data.max_eval_prompts=1",
               "generator.sampling.max_generate_length=48", f"logging.output_dir={out}", "logging.wandb_mode=offline"]
    start = time.monotonic()
    run = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=1200)
    seconds = time.monotonic() - start
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "agent endpoint (train)" in run.stdout and "agent endpoint (eval)" in run.stdout

    [record] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # the step's samples came from the endpoint: its calls were counted, and every trajectory that ran trained
    assert record["gateway/calls"] > 0 and record.get("gateway/chain_breaks", 0) == 0, record
    assert record["train/grad_norm"] >= 0 and "policy/loss" in record
    [final] = json.loads((out / "evals.json").read_text())
    assert len(final["scores"]) == 1 and final["unscored"] == 0, final  # the eval's agent ran and was scored

    samples = load_rollouts(out)
    train_samples = [s for s in samples if s["stage"] == "train"]
    eval_samples = [s for s in samples if s["stage"].startswith("eval")]
    assert train_samples and eval_samples, sorted({s["stage"] for s in samples})
    questions = {q for q, _ in make_data.QUESTIONS}
    for s in train_samples + eval_samples:  # the agent's own prompt (the row's question) and its sampled turns
        assert any(q in s["segments"][0]["text"] for q in questions), s["segments"][0]["text"][-300:]
        assert "calculator" in s["segments"][0]["text"]  # the agent's tools, not our own loop's (none for keyword)
        assert any(seg["role"] == "model" for seg in s["segments"]), s
    print(f"agent_program_tiny: 1 step + evals in {seconds:.0f} s")
