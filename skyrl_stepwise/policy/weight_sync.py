"""Trainer -> engines after each update (a shared-memory file, a torch.distributed broadcast, or through the
driver), then proof that the engine now scores like the trainer."""

from __future__ import annotations

import asyncio
import logging
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


METHODS = ("auto", "file", "broadcast", "driver")


@dataclass
class WeightSyncConfig:
    """How updated weights reach the engines (the `weight_sync` section).

    file: rank 0 writes one safetensors file in the engines' dtype to shared memory and the engines on its node
    read it. broadcast: rank 0 broadcasts buckets to every engine worker over a torch.distributed group of their
    own (gloo on CPU, NCCL on GPU; any node). driver: the full state dict through the driver (the fallback for
    engines that can do neither). auto: file when every engine is on rank 0's node, else broadcast.
    """

    method: str = "auto"
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
        await asyncio.gather(*(e.load_adapter(exported["adapter"], version) for e in engines))
        self.adapter_version = version
        self.history.append(("adapter", version))
        self.adapter_stats = {"sync/adapter_bytes": float(exported["bytes"]),
                              "sync/adapter_export_s": exported["seconds"],
                              "sync/adapter_load_s": time.perf_counter() - start}
        return exported["params"]

    def verify_adapter(self, probe: ProbeResult, tolerance: float, probe_ids: list[int]) -> dict[str, float]:
        """After an adapter sync: the probe must show the engines score with adapter v (this version) and not
        with v-1's (check_adapter_applied); returns the check's metrics. A no-op for the other methods."""
        if self.method != "adapter":
            return {}
        if self._last_probe is not None and probe_ids != self._last_probe_prompt:
            self._last_probe = None  # another prompt: nothing to compare with
        self._last_probe_prompt = list(probe_ids)
        previous, rescored = self._last_probe, None
        if previous is not None and previous.token_ids:  # what the update did to the previous probe's tokens
            rescored = self.group.call("compute_logprobs", TrainBatch(
                prompt_ids=[self._last_probe_prompt], response_ids=[previous.token_ids],
                loss_masks=[[1] * len(previous.token_ids)], instance_ids=["probe"]))[0]
        # what tells two versions apart: past the engine's float noise (fp32 ~1e-5; bf16 logprobs ~1e-2)
        noise = 1e-3 if engine_dtype(self.engine) == "float32" else tolerance
        base = "the policy's base the full sync sent (sync_base)" if self.base_synced else \
            "the model the engines started from"
        changed = check_adapter_applied(probe, previous, self.adapter_version, tolerance, rescored, noise, base)
        self._last_probe = probe
        return {**self.adapter_stats, "sync/adapter_version": float(self.adapter_version),
                "sync/probe_changed_tokens": float(changed),
                "sync/base_syncs": float(sum(kind == "base" for kind, _ in self.history))}

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


class AdapterNotApplied(RuntimeError):
    """After an adapter sync the engine does not score with the new version's adapter (an old one, or none)."""


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


def check_adapter_applied(probe: ProbeResult, previous: ProbeResult | None, version: int, tolerance: float,
                          rescored: list[float] | None = None, noise: float = 1e-3,
                          base: str = "the model the engines started from") -> int:
    """Raise AdapterNotApplied unless the engine scored the probe with adapter `version`: its logprobs agree with
    the trainer's (mean |diff| <= `tolerance`), and on the tokens both probes share (the probe is seeded: an engine
    still on the previous adapter samples the previous probe's tokens again) the engine is nearer the new version's
    logprobs than the previous one's wherever the update moved them by more than `noise` (the engine's own float
    noise against the trainer: an update smaller than the alarm's tolerance is still caught). `rescored`: the
    trainer's logprobs, now, of the previous probe's tokens; returns how many of them the update moved past `noise`
    (0: this version could not be told from the previous one on the probe, only the agreement was checked).
    `base`: what the adapters apply to, named in the error (version 0 is that base with no adapter)."""
    if probe.num_tokens == 0:
        raise AdapterNotApplied(f"policy version {version}: the weight-sync probe compared no tokens (no logprobs "
                                f"from the engine), so the adapter cannot be verified")
    moved_past = min(noise, tolerance)
    changed = nearer_old = shared = 0
    if previous is not None:
        changed = sum(abs(a - b) > moved_past for a, b in zip(rescored or [], previous.trainer_logprobs))
        for i, (a, b) in enumerate(zip(probe.token_ids, previous.token_ids)):
            if a != b:
                break
            new, old, engine = probe.trainer_logprobs[i], previous.trainer_logprobs[i], probe.engine_logprobs[i]
            if abs(new - old) > moved_past:
                shared += 1
                nearer_old += abs(engine - old) < abs(engine - new)
    if probe.mean_abs_diff > tolerance or (shared and nearer_old * 2 >= shared):
        stale = f"; on {nearer_old} of the {shared} probe tokens the update moved, the engine scores like version " \
                f"{version - 1}" if nearer_old else ""
        what = f"adapter v{version} on {base}" if version else f"{base} (no adapter yet)"
        raise AdapterNotApplied(
            f"weight sync to policy version {version}: the engine does not score with {what} (probe "
            f"mean |trainer - engine| logprob {probe.mean_abs_diff:.4g}, max {probe.max_abs_diff:.4g}, tolerance "
            f"{tolerance:g}{stale}). It still serves an old adapter or none, or another base; stopping instead of "
            f"sampling from it")
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
                         seed: int | None = None) -> ProbeResult:
    """Sample from the engine and rescore the same ids with the trainer: the two must agree.

    `temperature`, `top_k` and `top_p` must be the run's (the trainer's = the rollout's): the engine returns
    logprobs of the truncated distribution it sampled from and the trainer scores the same truncation, so
    probing with other values would hide a mismatch the rollouts have (or report one they do not; greedy,
    which vLLM scores at T=1, is refused). `seed` (the run's generator.sampling.seed): the probe's tokens are then
    a function of the weights alone, so a resumed run probes exactly what the uninterrupted one did.
    """
    if temperature <= 0:
        raise ValueError(f"probe_logprobs: temperature must be > 0 (the trainer's temperature), got {temperature}")
    sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                              logprobs=True, seed=seed)
    try:
        result = await engine.generate(probe_ids, sampling, session_id=PROBE_SESSION)
    finally:
        if hasattr(engine, "end_session"):  # an EnginePool would otherwise keep the probe's routing entry
            engine.end_session(PROBE_SESSION)
    ids = list(result.token_ids)
    batch = TrainBatch(prompt_ids=[probe_ids], response_ids=[ids], loss_masks=[[1] * len(ids)],
                       instance_ids=["probe"])
    trainer_lp = group.call("compute_logprobs", batch)[0]
    diffs = [abs(a - b) for a, b in zip(trainer_lp, result.logprobs or [])]
    if not diffs:  # nothing compared (no tokens, or an engine that returned no logprobs) proves nothing: NaN, not 0
        return ProbeResult(float("nan"), float("nan"), 0)
    return ProbeResult(max(diffs), sum(diffs) / len(diffs), len(diffs), ids[:len(diffs)], list(trainer_lp[:len(diffs)]),
                       list(result.logprobs[:len(diffs)]))
