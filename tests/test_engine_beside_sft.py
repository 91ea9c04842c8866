"""The engine starts beside the SFT warm start when nothing before the SFT needs it (cli/train.py): both run, each
failure surfaces when it happens, and no engine outlives a run whose SFT failed."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from skyrl_stepwise.cli.train import _beside_sft, engine_beside_sft
from skyrl_stepwise.run.startup_failures import StartupFailure


class _Engine:
    def __init__(self) -> None:
        self.shut_down = False

    def shutdown(self) -> None:
        self.shut_down = True


def test_only_cpu_layouts_with_sft_and_no_base_eval_start_the_engine_beside_it():
    from skyrl_stepwise.cli.train import load_config

    cfg = load_config(["experiment=search_r1_tiny"])
    assert cfg.sft.enabled and cfg.data.max_base_eval_prompts == 0
    assert engine_beside_sft(cfg, "none")
    # on a GPU vLLM sizes its KV cache from the memory free at start-up: an SFT beside it would change that
    assert not engine_beside_sft(cfg, "colocated") and not engine_beside_sft(cfg, "split")
    cfg.data.max_base_eval_prompts = 32  # the base model's eval needs the engine before the SFT
    assert not engine_beside_sft(cfg, "none")
    cfg.data.max_base_eval_prompts, cfg.sft.enabled = 0, False
    assert not engine_beside_sft(cfg, "none")


def test_both_run_at_once_and_both_results_come_back():
    engine, both_running = _Engine(), threading.Barrier(2, timeout=10)

    def start_engine():
        both_running.wait()  # would time out (BrokenBarrierError) if the SFT only began after the engine was up
        return engine

    def warm_start():
        both_running.wait()
        return "/cache/sft/abc"

    assert asyncio.run(_beside_sft(start_engine, warm_start)) == (engine, "/cache/sft/abc")
    assert not engine.shut_down


def test_a_failed_engine_start_raises_without_waiting_for_the_sft():
    sft_may_end = threading.Event()

    def start_engine():
        raise RuntimeError("KV cache does not fit")

    def warm_start():
        sft_may_end.wait(30)
        return "/cache/sft/abc"

    async def run() -> float:
        began = time.perf_counter()
        try:
            await _beside_sft(start_engine, warm_start)
        except RuntimeError as error:
            assert "KV cache does not fit" in str(error)
            return time.perf_counter() - began
        finally:
            sft_may_end.set()  # asyncio.run waits for the SFT's thread at its end
        raise AssertionError("the engine's failure was not raised")

    assert asyncio.run(run()) < 10  # the SFT would have held it 30 s


def test_a_failed_sft_is_named_and_the_engine_it_started_beside_is_shut_down():
    engine = _Engine()

    def start_engine():
        time.sleep(0.3)  # still starting when the SFT fails: waited for, then shut down
        return engine

    def warm_start():
        raise ValueError("sft.data names no file: /nope.parquet")

    with pytest.raises(StartupFailure, match="SFT warm start.*/nope.parquet"):
        asyncio.run(_beside_sft(start_engine, warm_start))
    assert engine.shut_down
