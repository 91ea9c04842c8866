"""Where the policy ranks and vLLM engines run: one Ray placement group over the GPUs.

Asking Ray for a whole GPU per actor made the Search-R1 recipe (8 policy ranks, 8 reference ranks,
4 engines) want 20 GPUs on an 8-GPU node, and Ray waited for them forever. The reference model of the KL
loss lives inside the policy ranks (PolicyWorker(with_reference=True)): it has no actors of its own.
Here the plan is made first (`plan_layout`, pure), checked against the cluster (`check_fits`, a clear error instead of a hang), then
reserved as one placement group of 1-GPU bundles (`create_placement_group`, with a timeout); actors
join a bundle with a fraction of its GPU (`actor_options`).

Modes:
- colocated: policy rank i (with its reference shard) and (spread out) the engines share bundle i's GPU
  with fractional `num_gpus`, so the recipe needs max(world_size, num_engines) GPUs.
- split: policy rank i owns bundle i's GPU, each engine owns a GPU after them.
- none: CPU-only, no bundles, every actor asks for 0 GPUs.

Ray's fractions are bookkeeping only: they decide who may share a GPU, not how its memory is divided
(vLLM's `engine.gpu_memory_utilization` and the trainer's own footprint do that).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

MODES = ("auto", "colocated", "split", "none")
_EPS = 1e-9  # 0.4 + 0.1 + 0.4 is 0.9000000000000001 in floats
_FIX_KEYS = "trainer.fsdp.world_size, engine.num_engines or placement.mode"


@dataclass
class PlacementConfig:
    """How actors are placed on GPUs (the `placement` section); fractions are Ray's fractional `num_gpus`."""

    mode: str = "auto"  # auto | colocated | split | none; auto: colocated when the run asks for GPUs, else none
    gpus_per_node: int | None = None  # None: read from the cluster
    # colocated: the shares of one GPU (must sum to <= 1; the policy's covers its reference shard); split: whole
    policy_gpu_fraction: float = 0.5
    engine_gpu_fraction: float = 0.4  # colocated: each engine's share of its GPU
    cpus_per_bundle: float = 0  # CPUs reserved with each GPU bundle (0: none, the actors ask for no CPU)
    ready_timeout_s: float = 8.0  # how long to wait for the placement group before failing
    # Custom Ray resources each policy rank / engine asks for, pinning the roles to nodes of a real cluster: start
    # the nodes meant for them with `ray start --resources='{"engine_node": 1}'` and set
    # +placement.engine_resources.engine_node=0.01 (a dict: `+` adds its key). CPU layouts (mode none) only.
    policy_resources: dict[str, float] = field(default_factory=dict)
    engine_resources: dict[str, float] = field(default_factory=dict)  # the same for each engine

    def validate(self, prefix: str = "placement") -> None:
        """Bad values here surface as a hang or a Ray error far from the config; name the key instead."""
        if self.mode not in MODES:
            raise ValueError(f"{prefix}.mode must be one of {list(MODES)}, got {self.mode!r}")
        if self.gpus_per_node is not None and self.gpus_per_node < 1:
            raise ValueError(f"{prefix}.gpus_per_node must be >= 1 (or null), got {self.gpus_per_node}")
        for key in ("policy_gpu_fraction", "engine_gpu_fraction"):
            value = getattr(self, key)
            if not 0 < value <= 1:
                raise ValueError(f"{prefix}.{key} must be in (0, 1], got {value}")
        total = self.policy_gpu_fraction + self.engine_gpu_fraction
        if total > 1 + _EPS:
            raise ValueError(f"{prefix}.policy_gpu_fraction + {prefix}.engine_gpu_fraction must be <= 1 (they share "
                             f"one GPU), got {total:g}")
        if self.cpus_per_bundle < 0:
            raise ValueError(f"{prefix}.cpus_per_bundle must be >= 0, got {self.cpus_per_bundle}")
        if self.ready_timeout_s <= 0:
            raise ValueError(f"{prefix}.ready_timeout_s must be > 0, got {self.ready_timeout_s}")
        for key in ("policy_resources", "engine_resources"):
            bad = {name: amount for name, amount in getattr(self, key).items() if not amount > 0}
            if bad:
                raise ValueError(f"{prefix}.{key} amounts must be > 0, got {bad}")


class Slot(NamedTuple):
    """One actor's place: a bundle of the placement group (None without one) and its share of that GPU."""

    bundle: int | None
    num_gpus: float


@dataclass
class Layout:
    """The plan: how many 1-GPU bundles to reserve and which bundle (and fraction) each actor gets."""

    mode: str  # colocated | split | none (auto already resolved)
    num_bundles: int
    gpus_needed: int
    policy: list[Slot] = field(default_factory=list)
    engines: list[Slot] = field(default_factory=list)
    cpus_per_bundle: float = 0

    def describe(self) -> str:
        """One line for the run log, so a placement surprise is visible before anything starts."""
        if self.mode == "none":
            return f"placement none (CPU): {len(self.policy)} policy ranks, {len(self.engines)} engines, no GPUs"
        parts = [_describe_role("policy ranks", self.policy), _describe_role("engines", self.engines)]
        return f"placement {self.mode}: {self.gpus_needed} GPUs; " + "; ".join(p for p in parts if p)

    def bundle_gpus(self) -> list[float]:
        """GPU fraction claimed on each bundle: every entry must be <= 1 or the actors cannot all start."""
        used = [0.0] * self.num_bundles
        for slot in self.policy + self.engines:
            if slot.bundle is not None:
                used[slot.bundle] += slot.num_gpus
        return used


def _describe_role(name: str, slots: list[Slot]) -> str:
    if not slots:
        return ""
    bundles = [s.bundle for s in slots]
    where = (f"bundles {bundles[0]}-{bundles[-1]}" if bundles == list(range(bundles[0], bundles[0] + len(bundles)))
             else "bundles " + ",".join(map(str, bundles)))
    return f"{len(slots)} {name} x{slots[0].num_gpus:g} GPU on {where}"


def resolve_mode(placement: PlacementConfig, gpus_requested: bool) -> str:
    """`auto` becomes colocated on GPU runs (fits the most on the fewest GPUs) and none on CPU-only runs."""
    if placement.mode != "auto":
        return placement.mode
    return "colocated" if gpus_requested else "none"


def plan_layout(world_size: int, num_engines: int, placement: PlacementConfig, gpus_requested: bool,
                gpus_per_engine: float | None = 1) -> Layout:
    """Decide every actor's bundle before asking Ray, so the GPU count is known (and checkable) up front.

    `gpus_per_engine` is `engine.num_gpus_per_engine` (None: 1); tensor-parallel engines (> 1 GPU) would
    need multi-GPU bundles, which this planner does not make, so they are refused rather than misplaced.
    """
    placement.validate()
    if world_size < 1:
        raise ValueError(f"trainer.fsdp.world_size must be >= 1, got {world_size}")
    if num_engines < 0:
        raise ValueError(f"engine.num_engines must be >= 0, got {num_engines}")
    if gpus_per_engine is not None and gpus_per_engine > 1:
        raise ValueError(f"engine.num_gpus_per_engine={gpus_per_engine}: engines spanning several GPUs (tensor "
                         "parallelism) are not supported by the placement planner; use 1 GPU per engine")
    mode = resolve_mode(placement, gpus_requested)
    plan = {"colocated": _colocated, "split": _split, "none": _cpu_only}[mode]
    layout = plan(world_size, num_engines, placement)
    layout.cpus_per_bundle = placement.cpus_per_bundle if layout.num_bundles else 0
    return layout


def plan_run_layout(cfg, gpus_requested: bool) -> Layout:
    """The layout of a run's config (RunConfig): its policy ranks (each with its reference shard) and engines."""
    return plan_layout(cfg.trainer.fsdp.world_size, cfg.engine.num_engines, cfg.placement, gpus_requested,
                       cfg.engine.num_gpus_per_engine)


def role_options(pg: PlacementGroup | None, slots: list[Slot], resources: dict[str, float] | None = None
                 ) -> list[dict] | None:
    """Per-actor `.options()` for one role, or None without a placement group and node resources (the actors
    decide themselves). `resources`: the custom Ray resources pinning the role to its nodes (CPU layouts)."""
    if resources and pg is not None:
        raise ValueError(f"placement.policy_resources / placement.engine_resources ({dict(resources)}) pin roles to "
                         "nodes in CPU layouts (placement.mode=none) only; GPU layouts place actors by placement-group "
                         "bundles")
    if pg is None:
        return [{"num_gpus": s.num_gpus, "resources": dict(resources)} for s in slots] if resources else None
    return [actor_options(pg, s.bundle, s.num_gpus) for s in slots]


def describe_nodes(roles: dict[str, list[str]]) -> str:
    """Which node each actor runs on (`policy rank 0 on 10.0.0.1 (node 3f2a9c1b)`), for the start-up log: on a
    cluster, where the roles landed is the first thing to check when a sync or a node fails."""
    import ray

    ips = {n["NodeID"]: n.get("NodeManagerAddress", "?") for n in ray.nodes()}
    parts = []
    for role, node_ids in roles.items():
        for i, node in enumerate(node_ids):
            parts.append(f"{role} {i} on {ips.get(node, '?')} (node {str(node)[:8]})")
    distinct = len({n for ids in roles.values() for n in ids})
    return f"nodes: {distinct} in use; " + ", ".join(parts)


def _colocated(world: int, engines: int, p: PlacementConfig) -> Layout:
    bundles = max(world, engines)
    stride = bundles // engines if engines else 0
    return Layout(
        mode="colocated", num_bundles=bundles, gpus_needed=bundles,
        policy=[Slot(i, p.policy_gpu_fraction) for i in range(world)],
        engines=[Slot(j * stride, p.engine_gpu_fraction) for j in range(engines)],
    )


def _split(world: int, engines: int, p: PlacementConfig) -> Layout:
    return Layout(
        mode="split", num_bundles=world + engines, gpus_needed=world + engines,
        policy=[Slot(i, 1.0) for i in range(world)],
        engines=[Slot(world + j, 1.0) for j in range(engines)],
    )


def _cpu_only(world: int, engines: int, p: PlacementConfig) -> Layout:
    return Layout(
        mode="none", num_bundles=0, gpus_needed=0,
        policy=[Slot(None, 0) for _ in range(world)],
        engines=[Slot(None, 0) for _ in range(engines)],
    )


def check_fits(layout: Layout, gpus_per_node: dict[str, float]) -> None:
    """Fail at start-up with the numbers and the keys to change, instead of Ray waiting forever.

    Each bundle is one whole GPU on one node, so a node holds floor(its GPUs) bundles.
    """
    slots = sum(math.floor(g + _EPS) for g in gpus_per_node.values())
    if layout.num_bundles <= slots:
        return
    room = f", room for {slots} one-GPU bundles" if slots < sum(gpus_per_node.values()) - _EPS else ""
    raise ValueError(f"{layout.describe()}; needs {layout.gpus_needed} GPUs but the cluster has "
                     f"{_format_gpus(gpus_per_node)}{room}. Change {_FIX_KEYS}" + _hint(layout))


def _format_gpus(gpus_per_node: dict[str, float]) -> str:
    total = sum(gpus_per_node.values())
    nodes = ", ".join(f"{node[:8]}: {g:g}" for node, g in gpus_per_node.items())
    count = f"{len(gpus_per_node)} node" + ("s" if len(gpus_per_node) > 1 else "")
    return f"{total:g} GPUs ({count}: {nodes})" if gpus_per_node else "0 GPUs (no nodes)"


def _hint(layout: Layout) -> str:
    if layout.mode == "split":
        return " (placement.mode=colocated shares GPUs between policy ranks and engines)"
    return " (colocated needs max(trainer.fsdp.world_size, engine.num_engines) GPUs)"


def cluster_gpus() -> dict[str, float]:
    """GPUs of every alive node, by node id: what `check_fits` must compare the layout with."""
    import ray

    return {n["NodeID"]: float(n.get("Resources", {}).get("GPU", 0)) for n in ray.nodes() if n.get("Alive")}


def create_placement_group(layout: Layout, timeout_s: float) -> PlacementGroup | None:
    """Reserve every bundle at once, or fail within `timeout_s` naming needed vs available GPUs.

    One group (PACK: fill a node before the next) makes the reservation all-or-nothing, so two roles
    cannot each grab half the GPUs and deadlock. A layout larger than the cluster fails at once
    (`check_fits`); one that fits but whose GPUs are held by others times out and is removed.
    """
    if layout.num_bundles == 0:
        return None
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    check_fits(layout, cluster_gpus())
    bundle: dict[str, float] = {"GPU": 1}
    if layout.cpus_per_bundle:
        bundle["CPU"] = layout.cpus_per_bundle
    pg = placement_group([dict(bundle) for _ in range(layout.num_bundles)], strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        free = ray.available_resources().get("GPU", 0)
        raise RuntimeError(f"{layout.describe()}; needs {layout.gpus_needed} GPUs, not reserved within "
                           f"{timeout_s:g} s (placement.ready_timeout_s): the cluster has "
                           f"{_format_gpus(cluster_gpus())}, {free:g} free now (the rest are held by other actors "
                           f"or placement groups). Free them, or change {_FIX_KEYS}") from None
    return pg


def actor_options(pg: PlacementGroup | None, bundle_index: int | None, num_gpus: float) -> dict:
    """`ActorClass.options(**actor_options(...))`: pins the actor to its bundle with its GPU fraction.

    Child tasks are captured so that whatever the actor starts stays inside the group's reservation.
    """
    if pg is None:
        return {"num_gpus": num_gpus}
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle_index,
                                                placement_group_capture_child_tasks=True)
    return {"num_gpus": num_gpus, "scheduling_strategy": strategy}
