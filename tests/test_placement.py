"""Placement of policy ranks and vLLM engines on GPUs (skyrl_stepwise.run.placement).

The pure tests check the plans for the Search-R1 recipe. The integration tests reserve the plans on a
simulated Ray cluster with fake GPUs (ray.cluster_utils.Cluster) and start one tiny actor per role.
That cluster runs in a child process (this file run as a script, one child per cluster shape): a
driver can join only one Ray cluster, and shutting down the session's Ray here would kill actors that
session-scoped fixtures (conftest's `vllm_engine`) still hold. The child observes; the tests assert.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest

from skyrl_stepwise.run.placement import (
    Layout,
    PlacementConfig,
    Slot,
    actor_options,
    check_fits,
    plan_layout,
)



def _recipe_sizes(*overrides: str) -> dict:
    """World size and engines of conf/experiment/search_r1.yaml as composed by the trainer."""
    from skyrl_stepwise.cli.train import load_config

    cfg = load_config(["experiment=search_r1", "logging.output_dir=unused", *overrides])
    return dict(world_size=cfg.trainer.fsdp.world_size, num_engines=cfg.engine.num_engines)


RECIPE = _recipe_sizes()  # one 8-GPU node: world 8, 4 engines (the KL reference lives in the policy ranks)
TWO_NODES = _recipe_sizes("trainer.fsdp.world_size=16", "engine.num_engines=8")  # the README's 2-node variant
RESULT_TAG = "PLACEMENT_RESULT "


def _plan(mode: str = "auto", gpus: bool = True, **sizes) -> Layout:
    return plan_layout(**(sizes or RECIPE), placement=PlacementConfig(mode=mode), gpus_requested=gpus)


# --- plans --------------------------------------------------------------------------------------------


def test_the_recipe_is_what_the_plans_assume():
    assert RECIPE == dict(world_size=8, num_engines=4)
    assert TWO_NODES == dict(world_size=16, num_engines=8)


def test_run_layouts_from_configs():
    from skyrl_stepwise.run.placement import plan_run_layout
    from skyrl_stepwise.cli.train import load_config

    gpu = plan_run_layout(load_config(["experiment=search_r1", "logging.output_dir=unused"]), gpus_requested=True)
    assert (gpu.mode, gpu.gpus_needed, len(gpu.policy), len(gpu.engines)) == ("colocated", 8, 8, 4)
    tiny = plan_run_layout(load_config(["experiment=search_r1_tiny", "logging.output_dir=unused"]), gpus_requested=False)
    assert (tiny.mode, tiny.num_bundles) == ("none", 0)


def test_recipe_colocated_fits_on_eight_gpus():
    layout = _plan("colocated")
    assert (layout.gpus_needed, layout.num_bundles) == (8, 8)
    assert layout.policy == [Slot(i, 0.5) for i in range(8)]  # the rank's share covers its reference shard
    assert layout.engines == [Slot(b, 0.4) for b in (0, 2, 4, 6)]


def test_auto_is_colocated_with_gpus_and_none_without():
    assert _plan("auto").mode == "colocated"
    cpu = _plan("auto", gpus=False)
    assert (cpu.mode, cpu.num_bundles, cpu.gpus_needed) == ("none", 0, 0)
    assert len(cpu.policy) == 8 and len(cpu.engines) == 4
    assert all(s == Slot(None, 0) for s in cpu.policy + cpu.engines)


def test_recipe_split_needs_twelve_gpus():
    layout = _plan("split")
    assert layout.gpus_needed == 12
    assert layout.policy == [Slot(b, 1.0) for b in range(8)]  # each rank (and its reference shard) owns a GPU
    assert layout.engines == [Slot(b, 1.0) for b in range(8, 12)]


def test_two_nodes_colocated_needs_sixteen_gpus():
    layout = _plan("colocated", **TWO_NODES)
    assert layout.gpus_needed == 16
    assert [s.bundle for s in layout.engines] == list(range(0, 16, 2))


def test_more_engines_than_ranks_gets_a_bundle_per_engine():
    layout = plan_layout(2, 4, PlacementConfig(mode="colocated"), gpus_requested=True)
    assert layout.gpus_needed == 4 and [s.bundle for s in layout.engines] == [0, 1, 2, 3]


@pytest.mark.parametrize("mode", ["colocated", "split"])
@pytest.mark.parametrize("sizes", [RECIPE, TWO_NODES, dict(world_size=8, num_engines=3),
                                   dict(world_size=3, num_engines=8)])
def test_no_bundle_is_oversubscribed(mode, sizes):
    layout = _plan(mode, **sizes)
    used = layout.bundle_gpus()
    assert len(used) == layout.num_bundles == layout.gpus_needed
    assert all(u <= 1 + 1e-9 for u in used), used
    assert all(u > 0 for u in used), "a reserved GPU nobody uses"


def test_describe_is_one_line():
    line = _plan("colocated").describe()
    assert "\n" not in line and "8 GPUs" in line and "bundles 0,2,4,6" in line
    assert "none" in _plan(gpus=False).describe()


def test_tensor_parallel_engines_are_refused():
    with pytest.raises(ValueError, match="engine.num_gpus_per_engine"):
        plan_layout(8, 4, PlacementConfig(), gpus_requested=True, gpus_per_engine=2)


@pytest.mark.parametrize("kwargs, key", [
    (dict(mode="packed"), "placement.mode"),
    (dict(policy_gpu_fraction=0.7), "must be <= 1"),
    (dict(engine_gpu_fraction=0), "placement.engine_gpu_fraction"),
    (dict(gpus_per_node=0), "placement.gpus_per_node"),
    (dict(cpus_per_bundle=-1), "placement.cpus_per_bundle"),
    (dict(ready_timeout_s=0), "placement.ready_timeout_s"),
])
def test_validate_names_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        PlacementConfig(**kwargs).validate()


def test_bad_sizes_name_the_key():
    with pytest.raises(ValueError, match="trainer.fsdp.world_size"):
        plan_layout(0, 4, PlacementConfig(), gpus_requested=True)
    with pytest.raises(ValueError, match="engine.num_engines"):
        plan_layout(8, -1, PlacementConfig(), gpus_requested=True)


# --- fit check and actor options ----------------------------------------------------------------------


def test_check_fits_names_needed_available_and_keys():
    with pytest.raises(ValueError) as err:
        check_fits(_plan("colocated"), {"node-a": 4.0})
    msg = str(err.value)
    assert "needs 8 GPUs" in msg and "4 GPUs" in msg and "node-a: 4" in msg
    for key in ("trainer.fsdp.world_size", "engine.num_engines", "placement.mode"):
        assert key in msg


def test_check_fits_counts_whole_gpus_per_node():
    check_fits(_plan("colocated"), {"a": 8.0})
    check_fits(_plan("colocated", **TWO_NODES), {"a": 8.0, "b": 8.0})
    check_fits(_plan(gpus=False), {})  # CPU-only needs nothing
    with pytest.raises(ValueError, match="room for 7 one-GPU bundles"):  # 8 GPUs, but only 7 whole ones
        check_fits(_plan("colocated"), {"a": 4.5, "b": 3.5})
    with pytest.raises(ValueError, match="placement.mode=colocated"):  # split: suggests colocating
        check_fits(_plan("split"), {"a": 8.0})


def test_actor_options_without_a_group():
    assert actor_options(None, None, 0) == {"num_gpus": 0}


def test_actor_options_pin_the_bundle():
    from ray.util.placement_group import PlacementGroup

    pg = PlacementGroup.empty()
    options = actor_options(pg, 3, 0.4)
    strategy = options.pop("scheduling_strategy")
    assert options == {"num_gpus": 0.4}
    assert (strategy.placement_group, strategy.placement_group_bundle_index) == (pg, 3)
    assert strategy.placement_group_capture_child_tasks


# --- a simulated cluster in a child process -----------------------------------------------------------


def _run_child(shape: str, *args: str) -> dict:
    """Run this file as a script for one cluster shape and return what it observed.

    The child gets its own Ray temp dir: `Cluster` records its address in <temp dir>/ray/ray_current_cluster,
    where any plain `ray.init()` on this machine (other tests, other jobs) would otherwise find and join it.
    """
    tmp = tempfile.mkdtemp(prefix="raypl-", dir="/tmp")  # short: Ray's socket paths must stay < 108 chars
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_TMPDIR": tmp}
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), shape, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the child's session: its Ray processes too
        out, _ = proc.communicate()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    lines = [line for line in out.splitlines() if line.startswith(RESULT_TAG)]
    assert proc.returncode == 0 and lines, f"cluster child {shape} failed (rc {proc.returncode}):\n{out[-4000:]}"
    return json.loads(lines[-1][len(RESULT_TAG):])


@pytest.fixture(scope="module")
def one_node() -> dict:
    return _run_child("1x8")


@pytest.fixture(scope="module")
def two_nodes() -> dict:
    return _run_child("2x8")


def _assert_colocated_placement(observed: dict, world: int, engines: int) -> None:
    assert observed["errors"] == []
    places = {role: [tuple(p) for p in observed[role]] for role in ("policy", "engines")}
    assert [len(places[r]) for r in places] == [world, engines]
    assert all(len(p[1].split(",")) == 1 for r in places for p in places[r]), "one GPU id per actor"
    assert len(set(places["policy"])) == world, "one policy rank per GPU"
    assert set(places["engines"]) <= set(places["policy"]), "every engine shares a policy rank's GPU"
    assert len(set(places["engines"])) == engines


@pytest.mark.integration
def test_recipe_starts_every_actor_on_one_eight_gpu_node(one_node):
    observed = one_node["fit"]
    assert observed["gpus_needed"] == 8
    _assert_colocated_placement(observed, world=8, engines=4)
    assert len({node for node, _ in observed["policy"]}) == 1
    # a fraction of a GPU inside a placement group still gets one whole GPU id: the bundle's
    assert all(re.fullmatch(r"\[\d\]", ids) for ids in observed["raw_gpu_ids"].values()), observed["raw_gpu_ids"]


@pytest.mark.integration
def test_cluster_gpus_reads_alive_nodes(one_node):
    assert list(one_node["cluster_gpus"].values()) == [8.0]


@pytest.mark.integration
def test_split_recipe_fails_fast_naming_gpus(one_node):
    observed = one_node["split"]
    assert observed["error"] == "ValueError" and observed["elapsed_s"] < 10
    assert "needs 12 GPUs" in observed["message"] and "has 8 GPUs" in observed["message"]
    assert "placement.mode=colocated" in observed["message"]


@pytest.mark.integration
def test_busy_gpus_time_out_and_release_the_group(one_node):
    observed = one_node["busy"]
    assert observed["error"] == "RuntimeError" and observed["elapsed_s"] < 10
    assert "needs 4 GPUs" in observed["message"] and "0 free now" in observed["message"]
    assert observed["groups_left"] == 1, "the timed-out group must be removed"
    assert one_node["gpus_free_at_end"] == 8.0


@pytest.mark.integration
def test_two_nodes_put_eight_ranks_on_each(two_nodes):
    observed = two_nodes["fit"]
    assert observed["gpus_needed"] == 16
    _assert_colocated_placement(observed, world=16, engines=8)
    assert sorted(Counter(node for node, _ in observed["policy"]).values()) == [8, 8]
    assert sorted(Counter(node for node, _ in observed["engines"]).values()) == [4, 4]
    # engines on the second node share GPUs with policy ranks: a broadcast group would put two NCCL ranks on one
    # GPU, so auto must never pick it there (and an explicit broadcast is refused); split layouts still broadcast
    assert two_nodes["weight_sync"] == {"colocated_auto": "file", "colocated_broadcast": "refused",
                                        "split_auto": "broadcast", "one_node_colocated_auto": "file"}


@pytest.mark.integration
def test_a_weights_file_is_written_on_each_engine_node_by_a_policy_rank_there(tiny_model_dir):
    """Colocated across nodes, the engines of node B read a file that node B's policy rank wrote, with the full
    weights rank 0 (node A) gathered and sent it over the trainer's own group: no broadcast group with the
    engines (NCCL refuses two ranks on one GPU), nothing through the driver, no file left behind."""
    observed = _run_child("weights", str(tiny_model_dir))
    assert observed["method"] == "file"
    assert observed["writers"] == ["node_b"]  # rank 0's node has no engine: it sends, it does not write
    assert observed["params"] == observed["expected_params"] > 0
    assert observed["max_abs_diff"] == 0.0 and observed["tensors"] == observed["expected_tensors"]
    assert observed["files_read"] > 0 and observed["files_left"] == []


# --- the child: one simulated cluster, observations printed as JSON -----------------------------------


def _start_probes(layout: Layout, pg) -> dict:
    """One tiny actor per role and slot; returns where each landed as [node id, "gpu ids"]."""
    import ray

    @ray.remote(num_cpus=0)
    class Probe:
        def where(self) -> tuple[str, str]:
            ids = sorted(str(i) for i in ray.get_gpu_ids())
            return ray.get_runtime_context().get_node_id(), ",".join(ids)

        def raw_gpu_ids(self) -> str:
            return repr(ray.get_gpu_ids())

    roles = {"policy": layout.policy, "engines": layout.engines}
    actors = {r: [Probe.options(**actor_options(pg, s.bundle, s.num_gpus)).remote() for s in slots]
              for r, slots in roles.items()}
    observed: dict = {"errors": [], "gpus_needed": layout.gpus_needed}
    for role, handles in actors.items():
        try:
            observed[role] = ray.get([a.where.remote() for a in handles], timeout=120)
        except Exception as e:  # noqa: BLE001 - reported to the parent test, which fails on it
            observed[role], observed["errors"] = [], observed["errors"] + [f"{role}: {e!r}"]
    observed["raw_gpu_ids"] = {r: ray.get(h[0].raw_gpu_ids.remote()) for r, h in actors.items() if h}
    for handles in actors.values():
        for a in handles:
            ray.kill(a)
    return observed


def _fit(sizes: dict) -> dict:
    from ray.util.placement_group import remove_placement_group

    from skyrl_stepwise.run.placement import create_placement_group

    layout = _plan("colocated", **sizes)
    pg = create_placement_group(layout, timeout_s=60)
    try:
        return _start_probes(layout, pg)
    finally:
        remove_placement_group(pg)


def _failure(layout: Layout, timeout_s: float) -> dict:
    from skyrl_stepwise.run.placement import create_placement_group

    start = time.monotonic()
    try:
        create_placement_group(layout, timeout_s)
    except (ValueError, RuntimeError) as e:
        return {"error": type(e).__name__, "message": str(e), "elapsed_s": time.monotonic() - start}
    return {"error": None, "message": "", "elapsed_s": time.monotonic() - start}


def _busy() -> dict:
    """All 8 GPUs held by one group; a second that would fit an empty cluster must time out, not hang."""
    from ray.util.placement_group import placement_group_table, remove_placement_group

    from skyrl_stepwise.run.placement import create_placement_group

    holder = create_placement_group(_plan("colocated"), timeout_s=60)
    try:
        observed = _failure(_plan("colocated", world_size=4, num_engines=2), timeout_s=2)
        observed["groups_left"] = sum(g["state"] != "REMOVED" for g in placement_group_table().values())
    finally:
        remove_placement_group(holder)
    return observed


def _weight_sync_methods(fit: dict) -> dict:
    """What weight_sync.method resolves to for the placement just observed (engines and rank 0 where they landed)."""
    from types import SimpleNamespace

    from skyrl_stepwise.policy.weight_sync import resolve_method

    class Engine:  # a vLLM engine as resolve_method sees it: both carriers, on the node it landed on
        def __init__(self, node_id: str) -> None:
            self.node_id = node_id

        async def update_weights_from_file(self, path): ...

        async def update_weights_from_broadcast(self, *args): ...

    group = SimpleNamespace(node_id=fit["policy"][0][0], node_ids=[node for node, _ in fit["policy"]])
    rank0_only = SimpleNamespace(node_id=group.node_id, node_ids=[group.node_id])  # split: policy on one node
    engines = SimpleNamespace(engines=[Engine(node) for node, _ in fit["engines"]])
    same_node = SimpleNamespace(engines=[Engine(group.node_id)])
    try:
        resolve_method("broadcast", group, engines, engines_share_policy_gpus=True)
        broadcast = "accepted"
    except ValueError:
        broadcast = "refused"
    return {"colocated_auto": resolve_method("auto", group, engines, engines_share_policy_gpus=True),
            "colocated_broadcast": broadcast,
            "split_auto": resolve_method("auto", rank0_only, engines, engines_share_policy_gpus=False),
            "one_node_colocated_auto": resolve_method("auto", group, same_node, engines_share_policy_gpus=True)}


def _observe_weights_file(model_dir: str) -> dict:
    """Two simulated nodes, a policy rank on each, one engine (a file reader) on node B: one weight sync."""
    import asyncio

    import ray
    from ray.cluster_utils import Cluster

    from skyrl_stepwise.inference.weights import load_weights_file
    from skyrl_stepwise.policy.config import TrainerConfig
    from skyrl_stepwise.policy.weight_sync import WeightSync, WeightSyncConfig
    from skyrl_stepwise.policy.worker_group import PolicyGroup

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"node_a": 1},
                                                            "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=2, resources={"node_b": 1})
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()

        @ray.remote(num_cpus=0, resources={"node_b": 0.1})
        class Reader:
            def node(self) -> str:
                return ray.get_runtime_context().get_node_id()

            def load(self, path: str) -> dict:
                return {k: v.double().sum().item() for k, v in load_weights_file(path).items()}

        reader = Reader.remote()
        nodes = {"node_a": None, "node_b": ray.get(reader.node.remote())}

        class Engine:
            node_id = nodes["node_b"]
            sums: dict = {}
            paths: list = []  # this run's files only: another test's sync may have its own in /dev/shm meanwhile

            async def update_weights_from_file(self, path: str) -> None:
                Engine.paths.append(path)
                Engine.sums = ray.get(reader.load.remote(path))

        cfg = TrainerConfig(model_path=model_dir)
        cfg.fsdp.world_size, cfg.fsdp.backend, cfg.fsdp.mixed_precision = 2, "gloo", False
        group = PolicyGroup(cfg, trainable=False, actor_options=[{"resources": {"node_a": 0.1}},
                                                                 {"resources": {"node_b": 0.1}}])
        nodes["node_a"] = group.node_ids[0]
        sync = WeightSync(WeightSyncConfig(), group, Engine(), engines_share_policy_gpus=True)
        exported: dict = {}
        original_call = group.call

        def recording_call(method, *args):
            result = original_call(method, *args)
            if method == "export_weights":
                exported.update(result)
            return result

        group.call = recording_call
        params = asyncio.run(sync.sync())
        state = original_call("full_state_dict")
        expected = {k: v.double().sum().item() for k, v in state.items()}
        expected_params = sum(v.numel() for v in state.values())
        group.shutdown()
        by_id = {v: k for k, v in nodes.items()}
        return {"method": sync.method, "writers": sorted(by_id[n] for n in exported["paths"]), "params": params,
                "expected_params": expected_params,
                "max_abs_diff": max(abs(Engine.sums[k] - v) for k, v in expected.items()),
                "tensors": sorted(Engine.sums), "expected_tensors": sorted(expected),
                "files_read": len(Engine.paths),
                "files_left": sorted(p for p in Engine.paths if Path(p).exists())}
    finally:
        ray.shutdown()
        cluster.shutdown()


def _free_gpus(expected: float, timeout_s: float = 10) -> float:
    import ray

    deadline = time.monotonic() + timeout_s
    while (free := ray.available_resources().get("GPU", 0)) < expected and time.monotonic() < deadline:
        time.sleep(0.2)
    return free


def _observe(shape: str) -> dict:
    import ray
    from ray.cluster_utils import Cluster

    from skyrl_stepwise.run.placement import cluster_gpus

    nodes = int(shape.split("x")[0])
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 8, "include_dashboard": False})
    try:
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=2, num_gpus=8)
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        observed = {"cluster_gpus": cluster_gpus()}
        if nodes == 1:
            observed["fit"] = _fit(RECIPE)
            observed["split"] = _failure(_plan("split"), timeout_s=8)
            observed["busy"] = _busy()
        else:
            observed["fit"] = _fit(TWO_NODES)
            observed["weight_sync"] = _weight_sync_methods(observed["fit"])
        observed["gpus_free_at_end"] = _free_gpus(8.0 * nodes)
        return observed
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    if sys.argv[1] == "weights":
        print(RESULT_TAG + json.dumps(_observe_weights_file(sys.argv[2])), flush=True)
    else:
        print(RESULT_TAG + json.dumps(_observe(sys.argv[1])), flush=True)
