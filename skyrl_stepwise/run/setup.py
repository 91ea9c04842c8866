"""What every run needs before its engines start: the datasets, the start-up checks of their env classes and tools,
the model on disk, the run's memory plan (a CPU engine's KV cache sized to the run), and the local retriever for data that searches.

Shared by the main job (train.py) and the ablation (ablate.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time

logger = logging.getLogger("skyrl_stepwise.cli.train")


def _since(start: float) -> str:
    return f"{time.perf_counter() - start:.1f} s"


def _datasets(cfg):
    from skyrl_stepwise.data.dataset import check_reward_spec, load_prompt_dataset

    train, val = cfg.data.train_path, cfg.data.val_path
    if "embedded" in (train, val):
        from skyrl_stepwise.data.embedded import build_embedded_search_r1

        built = build_embedded_search_r1()
        train = built.train if train == "embedded" else train
        val = built.validation if val == "embedded" else val
    train, val = _generated(train, "data.train_path"), (_generated(val, "data.val_path") if val else val)
    rows = load_prompt_dataset(train), (load_prompt_dataset(val) if val else [])
    if cfg.data.env_class:
        rows = tuple([dataclasses.replace(r, env_class=cfg.data.env_class) for r in part] for part in rows)
        for path, part in zip((train, val), rows):
            for i, row in enumerate(part):
                check_reward_spec(row, f"{path}: row {i} (instance_id={row.instance_id!r}, data.env_class)")
    return rows


def _generated(path, key: str):
    """A generated task's spec (reasoning_gym:NAME[:SIZE[:SEED]], python_tool:SPLIT[:SIZE[:SEED]]) -> its cached
    parquet, built on first use; any other path as it is."""
    from skyrl_stepwise.data import python_tool, reasoning_gym

    for module in (reasoning_gym, python_tool):
        if str(path).startswith(module.SPEC_PREFIX):
            return module.cached_task_file(module.parse_spec(str(path), key))
    return path


def plan_resources(cfg, train_rows, val_rows, needs_search: bool):
    """The run's memory plan (resource_plan.py), made once the model is on disk and before anything starts: sizes
    a CPU engine's KV cache to what the run keeps in flight at the prompts' real lengths, clamped to what the
    engine will accept on this host, and refuses a run that cannot fit, naming the knob. Logs the plan's line."""
    from transformers import AutoTokenizer

    from skyrl_stepwise.run.resource_plan import longest_prompt_tokens, make_plan

    tokenizer = AutoTokenizer.from_pretrained(cfg.engine.model_path)
    plan = make_plan(cfg, longest_prompt_tokens(tokenizer, train_rows + val_rows), len(val_rows), needs_search)
    logger.info(plan.describe())
    return plan


def check_envs_and_tools(cfg, rows) -> bool:
    """Every row's env_class registered and every tool of the `tool` env importable with known config keys,
    checked before anything slow starts (model, retriever, engines), so a typo fails in seconds naming what is
    registered. Returns whether the data needs the retriever (search rows, or tool rows with a search tool)."""
    from skyrl_stepwise.envs.builtin import check_env_classes
    from skyrl_stepwise.tools.base import check_tool_spec
    from skyrl_stepwise.tools.config import load_tools_yaml

    used = {r.env_class for r in rows}
    where = f"data ({cfg.data.train_path}" + (f", {cfg.data.val_path})" if cfg.data.val_path else ")")
    check_env_classes(sorted(used), cfg.environment, where)
    from skyrl_stepwise.gateway.rollout import check_agent_rows

    # agent rows run through the endpoint (every agent imported now), and only with gateway.enabled
    check_agent_rows([r.env_extras() for r in rows], where, cfg.gateway.enabled)
    searches = "search" in used
    if "tool" in used:
        tools_path = cfg.environment.tool.tools_path
        if tools_path is None:
            searches = True  # the built-in search + calculator
        else:
            specs = load_tools_yaml(tools_path)
            for i, spec in enumerate(specs):
                check_tool_spec(spec, i)
            searches = searches or any(spec.class_name == "search" for spec in specs)
    return searches


def corpus_path(corpus: str) -> str:
    """`environment.retriever.corpus` as a file: `embedded` is the embedded Wikipedia corpus, built on first use."""
    if corpus and corpus != "embedded":
        return corpus
    from skyrl_stepwise.data.embedded import build_embedded_search_r1

    return str(build_embedded_search_r1().corpus)


@contextlib.contextmanager
def prepared(cfg):
    """Model and data on disk, the local retriever up for as long as the block runs; yields the rows."""
    from skyrl_stepwise.host.logs import active_run_log, children_output_to
    from skyrl_stepwise.models import resolve_model_path
    from skyrl_stepwise.retrieval.launch import local_retriever
    from skyrl_stepwise.run.startup_failures import starting

    train_rows, val_rows = _datasets(cfg)
    logger.info(f"data: {len(train_rows)} train prompts, {len(val_rows)} eval prompts")
    needs_search = check_envs_and_tools(cfg, train_rows + val_rows)
    start = time.perf_counter()
    model = str(resolve_model_path(cfg.model_path))
    cfg.engine.model_path = cfg.trainer.model_path = model
    logger.info(f"model ready: {model} ({_since(start)})")
    from skyrl_stepwise.models.prepare import prepared_base_model

    if (base := prepared_base_model(model)) is not None:  # said at `model prepare`, maybe long ago: again here
        logger.warning(base)
    plan_resources(cfg, train_rows, val_rows, needs_search)
    retriever = cfg.environment.retriever
    with contextlib.ExitStack() as stack:
        url = None
        if needs_search and retriever.start_local:
            start = time.perf_counter()
            with starting("the local retriever"), children_output_to(active_run_log()):  # its output: run.log
                url = stack.enter_context(local_retriever(corpus_path(retriever.corpus), retriever.kind,
                                                          retriever.port))
            cfg.environment.search.search_url = url
            logger.info(f"retriever up at {url} ({retriever.kind} over the {retriever.corpus} corpus, "
                        f"{_since(start)})")
        yield train_rows, val_rows
