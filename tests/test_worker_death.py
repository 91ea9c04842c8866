"""A policy rank's process killed mid-run (the OOM killer's SIGKILL): the run stops at once, naming the rank, the
call and the latest complete checkpoint, shutdown neither hangs nor raises, and a relaunch resumed from that
checkpoint trains bitwise what the uninterrupted ranks trained.

Two gloo ranks of a tiny random Llama as Ray actors, in a child process with a Ray of its own (its own temp dir:
other jobs' Ray sessions on this machine are never joined, and none is stopped).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # Ray and two FSDP groups of two ranks: ~30 s on 2 cores
RESULT = "RESULT "


def _child(model_dir: str, ckpt_dir: str) -> dict:
    import threading

    import ray

    sys.path.insert(0, str(Path(__file__).parent))
    from test_fsdp_worker import _fsdp_batch, _fsdp_cfg

    from skyrl_stepwise.checkpoint.verify import resume_checkpoint
    from skyrl_stepwise.policy.worker_group import PolicyGroup, PolicyWorkerDied

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    cfg = _fsdp_cfg(2, model_dir, ckpt_dir)
    cfg.fsdp.backend, cfg.fsdp.num_threads_per_rank, cfg.algorithm.use_kl_loss = "gloo", 1, False
    batch = _fsdp_batch(128)
    out: dict = {}

    group = PolicyGroup(cfg)
    out["rank_threads"] = ray.get(group.ranks[1].__ray_call__.remote(
        lambda self: [os.environ.get("OMP_NUM_THREADS"), os.environ.get("OMP_WAIT_POLICY")]))
    group.call("train_step", batch)
    group.call("save_checkpoint", 1, {"run_id": "a", "lineage": []})
    group.call("train_step", batch)
    out["uninterrupted_step2"] = group.call("weights_checksum")
    pid = ray.get(group.ranks[1].__ray_call__.remote(lambda self: os.getpid()))
    threading.Timer(0.2, os.kill, (pid, signal.SIGKILL)).start()  # during the next steps
    start = time.perf_counter()
    try:
        for _ in range(100):
            group.call("train_step", batch)
    except PolicyWorkerDied as e:
        out["error"], out["stopped_after_s"] = str(e), time.perf_counter() - start
    try:
        group.call("weights_checksum")
    except PolicyWorkerDied as e:
        out["later_call"] = str(e)
    start = time.perf_counter()
    group.shutdown()  # raises nothing, waits on nobody for long
    out["shutdown_s"] = time.perf_counter() - start

    relaunched = PolicyGroup(cfg)
    path, state = resume_checkpoint("auto", ckpt_dir, lambda p: relaunched.call("load_checkpoint", str(p)))
    out["resumed"] = [path.name, state["step"]]
    relaunched.call("train_step", batch)
    out["resumed_step2"] = relaunched.call("weights_checksum")
    relaunched.shutdown()
    return out


def test_a_policy_rank_killed_mid_run_stops_it_loudly_and_a_relaunch_continues_bitwise(tiny_model_dir, tmp_path):
    ray_tmp = tempfile.mkdtemp(prefix="raywd-", dir="/tmp")  # short: Ray's socket paths must stay < 108 chars
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {
        "RAY_TMPDIR": ray_tmp, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]),
                                                              os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, __file__, str(tiny_model_dir), str(tmp_path / "ckpts")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its session: its Ray too
        log, _ = proc.communicate()
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    lines = [line for line in log.splitlines() if line.startswith(RESULT)]
    assert proc.returncode == 0 and lines, log[-4000:]
    out = json.loads(lines[-1][len(RESULT):])

    error = out["error"]
    assert out["stopped_after_s"] < 15, out  # promptly: nobody waits on a collective with the dead rank
    assert "policy rank 1 of 2" in error and "pid:" in error and "died during 'train_step'" in error, error
    assert f"latest complete checkpoint is {tmp_path / 'ckpts' / 'step_1'}" in error, error
    assert "trainer.resume=auto" in error
    assert "no more calls" in out["later_call"]
    assert out["shutdown_s"] < 15
    assert out["resumed"] == ["step_1", 1]
    assert out["resumed_step2"] == out["uninterrupted_step2"]  # the relaunch trains what the lost ranks had
    # a CPU rank's OpenMP threads sleep when they wait (host/threads.py), unless the caller's environment chose
    assert out["rank_threads"] == ["1", os.environ.get("OMP_WAIT_POLICY", "PASSIVE")]


if __name__ == "__main__":
    print(RESULT + json.dumps(_child(sys.argv[1], sys.argv[2])), flush=True)
