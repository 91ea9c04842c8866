"""`skyrl-stepwise train [hydra overrides]` / `python -m skyrl_stepwise.train`: the main job.

Builds every component from the config (model, data, local retriever, engines, generator, FSDP2
policy workers on Ray, tracker), then hands them to RLTrainer.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import sys
import time
from pathlib import Path

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")


def load_config(overrides: list[str] | None = None, config_name: str = "config"):
    """Compose conf/ + overrides into a validated RunConfig (a wrong key or combination fails here)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from skyrl_stepwise.config import RunConfig, register_configs

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        composed = compose(config_name=config_name, overrides=list(overrides or []))
    cfg: RunConfig = OmegaConf.to_object(composed)
    cfg.validate()
    return cfg


def _datasets(cfg):
    from skyrl_stepwise.data.dataset import load_prompt_dataset

    train, val = cfg.data.train_path, cfg.data.val_path
    if "embedded" in (train, val):
        from skyrl_stepwise.data.embedded import build_embedded_search_r1

        built = build_embedded_search_r1()
        train = built.train if train == "embedded" else train
        val = built.validation if val == "embedded" else val
    rows = load_prompt_dataset(train), (load_prompt_dataset(val) if val else [])
    if cfg.data.env_class:
        rows = tuple([dataclasses.replace(r, env_class=cfg.data.env_class) for r in part] for part in rows)
    return rows


async def _run(cfg, train_rows, val_rows) -> dict:
    import ray
    from transformers import AutoTokenizer

    from skyrl_stepwise.envs.builtin import build_env_registry
    from skyrl_stepwise.generator import StepwiseGenerator
    from skyrl_stepwise.inference import create_engine
    from skyrl_stepwise.inference.vllm_engine import ensure_ray
    from skyrl_stepwise.trainer.loop import RLTrainer, eval_config
    from skyrl_stepwise.trainer.tracking import Tracker
    from skyrl_stepwise.trainer.worker_group import PolicyGroup

    owns_ray = not ray.is_initialized()  # a caller's Ray (e.g. a test session) is left running
    ensure_ray()
    tokenizer = AutoTokenizer.from_pretrained(cfg.trainer.model_path)
    registry = build_env_registry(cfg.environment)
    engine = create_engine(cfg.engine)
    policy = PolicyGroup(cfg.trainer)
    reference = PolicyGroup(cfg.trainer, trainable=False) if cfg.trainer.algorithm.use_kl_loss else None
    tracker = Tracker(cfg.logging.output_dir, cfg.logging.project, cfg.logging.run_name, cfg.logging.wandb_mode,
                      dataclasses.asdict(cfg))
    probe = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                          tokenize=False, add_generation_prompt=True)
    trainer = RLTrainer(cfg, StepwiseGenerator(tokenizer, engine, registry, cfg.generator),
                        StepwiseGenerator(tokenizer, engine, registry, eval_config(cfg.generator)),
                        engine, policy, reference, tracker, train_rows, val_rows,
                        tokenizer(probe, add_special_tokens=False)["input_ids"])
    try:
        return await trainer.fit()
    finally:
        tracker.finish()
        for group in (policy, reference):
            if group is not None:
                group.shutdown()
        getattr(engine, "shutdown", lambda: None)()
        if owns_ray:
            ray.shutdown()


@contextlib.contextmanager
def prepared(cfg):
    """Model and data on disk, the local retriever up for as long as the block runs; yields the rows."""
    from skyrl_stepwise.models import resolve_model_path
    from skyrl_stepwise.retrieval.launch import local_retriever

    model = str(resolve_model_path(cfg.model_path))
    cfg.engine.model_path = cfg.trainer.model_path = model
    train_rows, val_rows = _datasets(cfg)
    needs_search = any(r.env_class in ("search", "tool") for r in train_rows + val_rows)
    retriever = cfg.environment.retriever
    with (local_retriever(retriever.corpus, retriever.kind, retriever.port)
          if needs_search and retriever.start_local else contextlib.nullcontext(None)) as url:
        if url:
            cfg.environment.search.search_url = url
        yield train_rows, val_rows


def run(cfg) -> dict:
    """Train, then say where everything is."""
    start = time.perf_counter()
    with prepared(cfg) as (train_rows, val_rows):
        metrics = asyncio.run(_run(cfg, train_rows, val_rows))
    print(f"\ndone: {cfg.total_steps} steps in {time.perf_counter() - start:.0f} s; "
          f"metrics in {Path(cfg.logging.output_dir).resolve()}/metrics.jsonl, "
          f"checkpoints in {Path(cfg.trainer.ckpt_dir).resolve()}", flush=True)
    for key in sorted(metrics):
        if key.startswith(("reward/", "eval/", "train/loss", "policy/", "generate/batch_padded")):
            print(f"  {key:40s} {metrics[key]:.4g}")
    if metrics.get("train/grad_norm") == 0.0:
        print("note: in the last step every prompt group's trajectories scored the same (with SmolLM2-135M on "
              "Search-R1: all 0), so every GRPO advantage was 0 and the step had no policy gradient (only AdamW's "
              "weight decay and momentum moved the weights). "
              "`python benchmarks/reward_learning.py` trains on a task this model can learn.", flush=True)
    return metrics


def main(argv: list[str] | None = None) -> int:
    """CLI entry: Hydra-style overrides (`key=value`, `+experiment=search_r1_tiny`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    run(load_config(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
