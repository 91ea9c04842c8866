"""Two real Ray nodes on this machine (two raylets, ray.cluster_utils.Cluster): the policy pinned to one, the vLLM
engine to the other by custom node resources, the weight sync crossing nodes (broadcast: no shared file), then the
engine's node killed mid-run: the run stops naming the node, and the same command resumes from its checkpoint once
a node for the engine is back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from skyrl_stepwise.run.placement import PlacementConfig, Slot, role_options


def test_role_resources_pin_cpu_actors_and_are_refused_with_gpu_bundles():
    slots = [Slot(None, 0), Slot(None, 0)]
    assert role_options(None, slots) is None
    assert role_options(None, slots, {"engine_node": 0.01}) == [{"num_gpus": 0, "resources": {"engine_node": 0.01}}] * 2
    with pytest.raises(ValueError, match="placement.mode=none"):
        role_options(object(), slots, {"engine_node": 0.01})
    with pytest.raises(ValueError, match="placement.engine_resources amounts must be > 0"):
        PlacementConfig(engine_resources={"engine_node": 0}).validate()


def test_a_lost_node_with_no_replacement_is_named(monkeypatch):
    import ray

    from skyrl_stepwise.inference.vllm_engine import NodeLostError, check_a_node_can_host

    nodes = [{"NodeID": "aaaa1111", "Alive": True, "NodeManagerAddress": "10.0.0.1", "Resources": {"CPU": 2}},
             {"NodeID": "bbbb2222", "Alive": False, "NodeManagerAddress": "10.0.0.2",
              "Resources": {"CPU": 2, "engine_node": 1}}]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    check_a_node_can_host("aaaa1111", {"engine_node": 0.01})  # alive: restart as usual
    with pytest.raises(NodeLostError, match=r"node 10.0.0.2 \(node bbbb2222\) is dead"):
        check_a_node_can_host("bbbb2222", {"engine_node": 0.01})
    check_a_node_can_host("bbbb2222", {})  # any live node can host an engine that asks for nothing special


def _records(out):
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.integration
@pytest.mark.timeout(2700)  # 562 s on an idle 2-core AVX2 host: the 600 s default is a coin toss under load
def test_two_nodes_policy_here_engine_there_node_loss_and_resume(tmp_path, tiny_smollm2, monkeypatch):
    """Placement, a cross-node sync, a lost node and a resume: plumbing, on the tiny model (test_train_e2e's
    `_command`). It starts its own two-node Ray cluster and kills a node, so it shares no session engine."""
    import tempfile

    import ray
    from ray.cluster_utils import Cluster

    from skyrl_stepwise.checkpoint.store import complete_checkpoints
    from test_train_e2e import OWN_TASK, REPO, _command, _dataset

    if ray.is_initialized():
        ray.shutdown()  # this test's driver is a subprocess joining the cluster below
    # the cluster's own temp dir: Ray records its address there, where a plain ray.init() on this machine (another
    # test, another job) would otherwise find and join it; short, as Ray's socket paths must stay < 108 chars
    monkeypatch.setenv("RAY_TMPDIR", tempfile.mkdtemp(prefix="ray2n-", dir="/tmp"))
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"policy_node": 1}})
    engine_node = cluster.add_node(num_cpus=1, resources={"engine_node": 1})
    cluster.wait_for_nodes()
    data = _dataset(tmp_path)
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_ADDRESS=cluster.address,
               PYTHONPATH=os.pathsep.join([str(OWN_TASK), str(REPO), os.environ.get("PYTHONPATH", "")]))
    command = _command(data, out, 3) + ["trainer.fsdp.world_size=1", "+placement.policy_resources.policy_node=0.01",
                                        "+placement.engine_resources.engine_node=0.01"]
    console = tmp_path / "run1.log"
    try:
        with open(console, "w") as log:
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + 1200
            while len(complete_checkpoints(out / "ckpts")) < 1:
                assert proc.poll() is None, console.read_text()[-4000:]
                assert time.monotonic() < deadline, "no checkpoint within 20 minutes"
                time.sleep(1)
            text = console.read_text()
            assert "weight sync: broadcast" in text  # the engine is on another node: no shared weights file
            assert "nodes: 2 in use" in text, text[-3000:]
            # the memory plan read on each node there (run/node_memory.py), each role's share on the node pinned to it
            plan_lines = [line for line in text.splitlines() if "resource plan, node " in line]
            assert len(plan_lines) == 2, text[-3000:]
            assert sum(": 1 policy rank(s) x " in line for line in plan_lines) == 1, plan_lines
            assert sum(": 1 engine(s) x " in line for line in plan_lines) == 1, plan_lines
            first = _records(out)
            assert first and first[0]["sync/probe_logprob_max_diff"] < 1e-3  # the cross-node sync took
            cluster.remove_node(engine_node)  # the engine's node dies mid-run
            code = proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        text = console.read_text()
        assert code != 0, text[-3000:]
        assert "is dead and no live node offers what an engine asks for" in text, text[-4000:]
        assert "Traceback" not in text.split("failed after step")[-1], text[-3000:]
        done = [r["step"] for r in _records(out)]
        assert done and done[-1] < 3

        cluster.add_node(num_cpus=1, resources={"engine_node": 1})  # a node for the engine again
        cluster.wait_for_nodes()
        resumed = subprocess.run(command + ["trainer.resume=auto"], capture_output=True, text=True, env=env,
                                 timeout=900)
        assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-4000:]
        assert "resumed from" in resumed.stdout
        steps = [r["step"] for r in _records(out)]
        assert steps[-1] == 3 and sorted(set(steps)) == [1, 2, 3]
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
