"""The supervised warm start as a cached model folder: train the policy on conversations, write it under
`$SKYRL_STEPWISE_CACHE/sft/<key>`, where the key hashes every input (model, data, tools, SFT and rendering
settings), so the main job redoes SFT only when one of them changes. `skyrl-stepwise sft` and the main job call it.

The conversations (Search-R1 demonstrations built from the embedded data, or a parquet of `messages`) become
samples through the rollout path (loop/sft.py), the FSDP policy ranks train on them with cross-entropy on the
assistant tokens.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from pathlib import Path

COMPLETE = "COMPLETE"


def _conversations(cfg, log=print) -> tuple[list[list[dict]], list[list[dict] | None] | None, str]:
    """The SFT conversations, each one's own tools (None: no conversation carries any) and a digest of both (part
    of the cache key)."""
    import pyarrow.parquet as pq

    from skyrl_stepwise.data.demonstrations import (build_search_r1_demonstrations, load_conversation_tools,
                                                    load_conversations)
    from skyrl_stepwise.data.python_tool import SPEC_PREFIX as PYTHON_TOOL_PREFIX
    from skyrl_stepwise.data.python_tool import parse_spec as parse_python_tool_spec
    from skyrl_stepwise.data.python_tool_demos import cached_demos_file
    from skyrl_stepwise.loop.sft import AGENT_DEMOS

    own: list[list[dict] | None]
    if cfg.sft.data == "embedded":  # observations exactly as the run's search env will format them
        search = cfg.environment.search
        path = build_search_r1_demonstrations(topk=search.topk, env_cfg=search)
        conversations = load_conversations(path)
        found = pq.read_table(path, columns=["answer_found"]).column("answer_found").to_pylist()
        conversations = [c for c, ok in zip(conversations, found) if ok]  # teach answers that are right
        own = [None] * len(conversations)
    elif cfg.sft.data == AGENT_DEMOS:  # recorded now through the agent endpoint (loop/agent_demos.py)
        from skyrl_stepwise.loop.agent_demos import record_for_config

        demos = record_for_config(cfg, log)
        conversations, own = demos.conversations(), demos.tools()
    else:
        path = Path(cfg.sft.data)
        if str(cfg.sft.data).startswith(PYTHON_TOOL_PREFIX):  # python_tool:demos:SIZE:SEED, played through the env
            path = cached_demos_file(parse_python_tool_spec(cfg.sft.data, "sft.data"))
        conversations = load_conversations(path)
        own = load_conversation_tools(path)
    conversations, own = conversations[: cfg.sft.max_rows], own[: cfg.sft.max_rows]
    if all(t is None for t in own):  # the digest of data without own tools is what it always was (cached keys hold)
        return conversations, None, hashlib.sha256(json.dumps(conversations, sort_keys=True).encode()).hexdigest()
    payload = {"conversations": conversations, "tools": own}
    return conversations, own, hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def check_gateway_conversations(cfg, conversations: list[list[dict]], own: list[list[dict] | None] | None) -> None:
    """With gateway.enabled the agent program sends its own tool schemas, rendered into every call's prompt; a
    tool-using SFT conversation without its own tools would be rendered with environment.tool's schemas instead, a
    prompt the endpoint never renders. Refused naming the rows and the fix."""
    from skyrl_stepwise.loop.sft import uses_tools

    if not cfg.gateway.enabled:
        return
    bare = [i for i, c in enumerate(conversations) if uses_tools(c) and (own is None or own[i] is None)]
    if bare:
        raise ValueError(f"sft.data={cfg.sft.data}: conversations {bare[:5]} call tools but carry no `tools` column: "
                         "with gateway.enabled=true the agent program sends its own tool schemas, and SFT would "
                         "render environment.tool's instead (prompts the endpoint never renders). Record them through "
                         "the endpoint (`skyrl-stepwise data agent-demos`, or sft.data=agent_demos), or add a `tools` "
                         "column (JSON text of the tools the agent sends)")


# Generator keys that conversation_samples overrides or that never reach a replayed conversation (the engine is
# scripted): every other generator key is part of the SFT key, so a new key can only make the cache miss, never
# reuse a warm start trained on different samples.
_GENERATOR_KEYS_NOT_IN_SFT = {"max_turns", "max_input_length", "n_samples_per_prompt", "step_wise_trajectories",
                              "merge_stepwise_output", "apply_overlong_filtering", "show_progress",
                              "context"}  # SFT replays demonstrations with no context policy (loop/sft.py)
# SFT keys that never change the trained weights: whether the main job runs it, how often it checkpoints (a resume is
# exact), and the divergence guard (it only stops a run). num_warmup_steps is in the key: it changes the weights.
# sft.lora (and sft.lora_lr) is keyed as the adapter it trains ("lora" below), not as its spelling: full SFT under
# LoRA RL and under full RL is one cached warm start. sft.agent_demos is how demonstrations are recorded: what they
# are (the conversations and their tools) is in the key.
_SFT_KEYS_NOT_IN_KEY = {"enabled", "ckpt_interval", "divergence", "lora", "lora_lr", "agent_demos"}
_SAMPLING_KEYS_IN_SFT = {"stop"}  # the rest (temperature, lengths, logprobs, seed) only steers a real engine
_FSDP_KEYS_NOT_IN_SFT = {"offload_during_rollout", "num_threads_per_rank", "reshard_after_forward",
                         "gradient_checkpointing", "accumulate_unsharded"}  # where, how fast, in what memory: not what


def file_digest(path: Path, memo_path: Path | None = None) -> str:
    """sha256 of a file's content. Weight files are large, so their digest is remembered in `memo_path` under
    (path, size, mtime): a warm start is keyed on what the weights are, not on what they are called."""
    stat = path.stat()
    memo_key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    memo = {}
    if memo_path is not None and memo_path.is_file():
        try:
            memo = json.loads(memo_path.read_text())
        except json.JSONDecodeError:
            memo = {}
    if memo_key in memo:
        return memo[memo_key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    digest = h.hexdigest()
    if memo_path is not None:
        memo[memo_key] = digest
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo_path.with_name(memo_path.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(memo))
        tmp.replace(memo_path)
    return digest


def model_digest(model_path: str, memo_path: Path | None = None) -> dict[str, str] | str:
    """The content of a model folder: every file (weights, config, tokenizer, chat template) by its sha256.
    A hub id (not a folder) is its name."""
    model = Path(model_path)
    if not model.is_dir():
        return str(model_path)
    return {f.name: file_digest(f, memo_path) for f in sorted(model.iterdir()) if f.is_file()}


def sft_lora_config(cfg):
    """The LoRA settings SFT trains with: trainer.lora's adapter, switched on by sft.lora alone (default false: full
    SFT, whatever RL trains), at SFT's own adapter lr (sft.lora_lr; null: 10 x SFT's chosen lr), never RL's
    trainer.lora.lr."""
    return dataclasses.replace(cfg.trainer.lora, enabled=bool(cfg.sft.lora), lr=cfg.sft.lora_lr)


def cache_key(cfg, data_digest: str, tools: list[dict] | None = None,
              memo_path: Path | None = None) -> str:
    """Everything the warm-started weights depend on: the base model's content (weights and chat template),
    the conversations, the SFT settings, every generator setting that reaches the SFT samples, the optimizer
    and the trainer's numerics; `tools`: the schemas rendered into tool-using prompts."""
    gen = dataclasses.asdict(cfg.generator)
    gen = {k: v for k, v in gen.items() if k not in _GENERATOR_KEYS_NOT_IN_SFT}
    gen["sampling"] = {k: v for k, v in gen["sampling"].items() if k in _SAMPLING_KEYS_IN_SFT}
    optim = {k: v for k, v in dataclasses.asdict(cfg.trainer.optim).items()
             if k not in ("lr", "scheduler", "num_warmup_steps")}  # SFT sets these from cfg.sft
    fsdp = {k: v for k, v in dataclasses.asdict(cfg.trainer.fsdp).items() if k not in _FSDP_KEYS_NOT_IN_SFT}
    inputs = {"model": model_digest(cfg.trainer.model_path, memo_path), "data": data_digest,
              "sft": {k: v for k, v in dataclasses.asdict(cfg.sft).items() if k not in _SFT_KEYS_NOT_IN_KEY},
              "generator": gen, "optim": optim, "fsdp": fsdp,
              "trainer": [cfg.trainer.micro_batch_tokens, cfg.trainer.seed, cfg.trainer.attn_implementation]}
    if tools:
        inputs["tools"] = tools
    if cfg.trainer.keep_dropout:  # a key only when set: warm starts cached before the key existed stay valid
        inputs["keep_dropout"] = True
    sft_lora = sft_lora_config(cfg)
    if sft_lora.enabled:  # SFT trains the adapter alone: another model than full fine-tuning's
        inputs["lora"] = dataclasses.asdict(sft_lora)
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:16]


def export_hf_config(base_model: str | Path, out_dir: Path) -> None:
    """Make `out_dir` (which holds the trained model.safetensors) a loadable HF folder: the base folder's config,
    tokenizer and generation files, not its weights."""
    for f in Path(base_model).iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".bin", ".gguf")) and f.name != "model.safetensors.index.json":
            shutil.copy2(f, out_dir / f.name)


def sft_model(cfg, log=print, actor_options: list[dict] | None = None, metrics_path: Path | None = None) -> Path:
    """The warm-started model folder for this config: from the cache, or trained now (then cached).

    `actor_options`: the policy ranks' placement (placement.py), so SFT runs on the GPUs the run reserved.
    `metrics_path`: each SFT step's metrics are appended there as they happen (the run dir's sft_metrics.jsonl),
    so a warm start that diverges or is killed leaves its evidence on disk, not only on the console."""
    from transformers import AutoTokenizer

    from skyrl_stepwise.models.prepare import cache_root
    from skyrl_stepwise.tools.config import configured_tool_schemas
    from skyrl_stepwise.loop.divergence import DivergenceGuard
    from skyrl_stepwise.loop.sft import (conversation_samples, sft_batches, sft_renderer, terminator_nats,
                                            train_sft, uses_tools, warm_start_settings)
    from skyrl_stepwise.policy.worker_group import PolicyGroup

    conversations, own_tools, digest = _conversations(cfg, log)
    check_gateway_conversations(cfg, conversations, own_tools)
    tools = configured_tool_schemas(cfg.environment.tool.tools_path) \
        if any(uses_tools(c) and (own_tools is None or own_tools[i] is None)
               for i, c in enumerate(conversations)) else None
    key = cache_key(cfg, digest, tools, memo_path=cache_root() / "sft" / "file_digests.json")
    out = cache_root() / "sft" / key
    if (out / COMPLETE).is_file():
        log(f"sft: cached warm start {out} (inputs unchanged)")
        return out
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(cfg.trainer.model_path)
    samples = conversation_samples(tokenizer, conversations, cfg.generator, tools, own_tools)
    batches = sft_batches(samples, cfg.sft.batch_size, cfg.sft.epochs, cfg.sft.seed)
    trained = sum(sum(m) for m in samples.loss_masks)
    log(f"sft: {len(conversations)} conversations, {trained} assistant tokens, {len(batches)} steps "
        f"({cfg.sft.epochs} epochs of {cfg.sft.batch_size})")
    ckpts = out.with_name(out.name + ".ckpts")  # an interrupted SFT resumes from here
    optim = dataclasses.replace(cfg.trainer.optim, lr=cfg.sft.lr, scheduler="constant_with_warmup",
                                num_warmup_steps=cfg.sft.warmup_steps(len(batches)))
    sft_lora = sft_lora_config(cfg)
    trains = f"a LoRA adapter (rank {sft_lora.rank}), merged into the warm start" if sft_lora.enabled \
        else "every weight"
    log(f"sft: trains {trains} (sft.lora={str(bool(cfg.sft.lora)).lower()})")
    policy = PolicyGroup(dataclasses.replace(cfg.trainer, optim=optim, ckpt_dir=str(ckpts), max_ckpts_to_keep=1,
                                             ckpt_interval=cfg.sft.ckpt_interval, lora=sft_lora),
                         actor_options=actor_options)
    for note in policy.call("packing_summary")["notes"]:  # SFT trains without dropout too, unless asked
        log(f"sft: {note}")
    try:
        # the lr and warm-up follow from what the model pays for the turn terminator (a pure function of the
        # cache key's inputs, so a resumed or cached warm start chose the same)
        close_id = sft_renderer(tokenizer, cfg.generator).close_id
        nats = None
        if cfg.sft.unseen_terminator_nats is not None:  # on the first step's batch: a forward over every demo
            probe = batches[0]  # took 2-3 min of a 7-min SFT on a CPU without bf16; 1 nat vs 20 shows in 8 demos
            nats = terminator_nats(probe.loss_masks, probe.response_ids, policy.call("compute_logprobs", probe),
                                   close_id)
        chosen = warm_start_settings(cfg.sft, len(batches), tokenizer.decode([close_id]), nats)
        log(chosen.describe(cfg.sft, optim.num_warmup_steps))
        if sft_lora.enabled:  # the worker scales the adapter's lr (LoRAConfig.optimizer_lr)
            log(f"sft: the LoRA adapter trains at {sft_lora.describe_lr(chosen.lr, 'the SFT lr', 'sft.lora_lr')}")
        if (chosen.lr, chosen.warmup_steps) != (optim.lr, optim.num_warmup_steps):
            policy.call("set_optim", dataclasses.replace(optim, lr=chosen.lr, num_warmup_steps=chosen.warmup_steps))
        if metrics_path is not None:
            Path(metrics_path).parent.mkdir(parents=True, exist_ok=True)
            Path(metrics_path).write_text("")  # this warm start's steps only (a resumed one re-writes its restored)

        def record(step: int, m: dict) -> None:
            if metrics_path is not None:
                with open(metrics_path, "a") as f:
                    f.write(json.dumps({"step": step, **m}) + "\n")

        def on_step(step: int, m: dict) -> None:
            log(f"sft step {step}/{len(batches)}: loss={m['sft/loss']:.4f} grad_norm={m['train/grad_norm']:.3g} "
                f"entropy={m.get('sft/entropy', float('nan')):.3f} lr={m.get('train/lr', float('nan')):.3g} "
                f"({m['train/step_time_s']:.0f} s)")
            record(step, m)

        history = train_sft(policy, batches, cfg.sft.ckpt_interval, str(ckpts), on_step=on_step, on_restored=record,
                            guard=DivergenceGuard(cfg.sft.divergence, "sft.divergence", loss_key="sft/loss",
                                                  entropy_key="sft/entropy", what="sft step"))
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        # rank 0 writes the weights itself: the driver never holds them (same node: the cache is local)
        policy.call("export_weights", str(tmp / "model.safetensors"), "float32")
    finally:
        policy.shutdown()
    export_hf_config(cfg.trainer.model_path, tmp)
    (tmp / "sft_metrics.json").write_text(json.dumps(history, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    (out / COMPLETE).write_text("ok\n")
    shutil.rmtree(ckpts, ignore_errors=True)  # the model folder is complete: nothing left to resume
    log(f"sft: done in {time.perf_counter() - start:.0f} s, loss {history[0]['sft/loss']:.3f} -> "
        f"{history[-1]['sft/loss']:.3f}; model in {out}")
    return out


def sft_history(model_dir: str | Path) -> list[dict]:
    """The SFT steps' metrics saved in a warm-start folder (sft_metrics.json), or [] for any other folder."""
    path = Path(model_dir) / "sft_metrics.json"
    try:
        return json.loads(path.read_text()) if path.is_file() else []
    except (OSError, json.JSONDecodeError):
        return []


def expected_signal_groups(pass_rate: float, samples: int, prompts: int) -> float:
    """Groups per RL step expected to carry signal (not all samples alike) when each sample succeeds with
    `pass_rate`: prompts x (1 - (1 - p)^n - p^n)."""
    return prompts * (1.0 - (1.0 - pass_rate) ** samples - pass_rate ** samples)


def sft_left_no_signal(cfg, evals: list, history: list[dict] | None = None) -> str | None:
    """A loud sentence when the eval after SFT is so near 0 that RL steps will mostly have no signal, naming the
    likely key; None otherwise.

    At 0 every RL group scores 0 and is skipped: the run completes having trained nothing and says nothing (issue
    59: `trainer.lora.enabled=true` trained the warm start as an adapter at the full-weight lr, loss 1.763 -> 1.682,
    eval 0.000 on 128 prompts). Near 0 it is the same in effect: an adapter warm start at 0.008 (1 of 128 prompts)
    had `signal_groups=0` at step 1, and "exactly 0" missed it. So the bar is the groups a step is expected to have
    with signal at the after-SFT rate (`expected_signal_groups`): under one, most steps train nothing (with
    groups of 2 or more samples).
    `evals`: the run's EvalResults; `history`: SFT's step metrics."""
    after = next((r for r in evals if r.stage == "after SFT"), None)
    if after is None or after.num_prompts == 0:
        return None
    samples, prompts = cfg.generator.n_samples_per_prompt, cfg.data.train_batch_size
    groups = expected_signal_groups(after.mean, samples, prompts)
    # one sample a prompt has no group to compare within (nothing for this bar to say): only exactly 0 is claimed
    if max(after.scores, default=0.0) > 0 and (groups >= 1.0 or samples < 2):
        return None
    before = next((r for r in evals if r.stage == "before SFT"), None)
    was = f", {before.mean:.3f} before it" if before is not None and before.num_prompts else ""
    loss = f" (SFT loss {history[0]['sft/loss']:.3f} -> {history[-1]['sft/loss']:.3f})" \
        if history and "sft/loss" in history[0] else ""
    sft_lora = sft_lora_config(cfg)
    if sft_lora.enabled:
        why = (f"`sft.lora=true` trained the SFT warm start as a LoRA adapter at "
               f"{sft_lora.describe_lr(cfg.sft.lr, 'sft.lr', 'sft.lora_lr')}, which moved the model too little. "
               f"Likely key: sft.lora_lr (higher), or sft.lora=false (full SFT, then LoRA RL: the measured "
               f"combination in docs/lora.md)")
    else:
        why = (f"the full SFT (sft.lr={cfg.sft.lr:g}, sft.epochs={cfg.sft.epochs}) did not teach the task's answer "
               f"format. Likely keys: sft.lr, sft.epochs")
    if max(after.scores, default=0.0) <= 0:
        return (f"SFT LEFT THE EVAL AT 0: the eval after SFT scored 0 on all {after.num_prompts} prompts{was}{loss}. "
                f"Every RL group will score 0 and carry no signal, so the RL steps will train nothing "
                f"(signal_groups=0). {why}.")
    right = sum(1 for score in after.scores if score > 0)
    return (f"SFT LEFT THE EVAL NEAR 0: the eval after SFT scored {after.mean:.3f} ({right} of {after.num_prompts} "
            f"prompts){was}{loss}. At that rate a step of {prompts} prompts x {samples} samples expects "
            f"{groups:.2f} groups with signal, so most RL steps will train nothing (signal_groups=0). {why}.")
