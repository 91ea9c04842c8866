"""A dead engine is restarted with the current weights, the first sync after the restart is verified by the probe,
and the step whose rollouts it broke is drawn again, whole; a restart whose sync did not take stops the run."""

from __future__ import annotations

import json

import pytest

from skyrl_stepwise.inference.recovery import EngineDeadError, restart_dead_engines
from skyrl_stepwise.inference.scripted import ScriptedEngine
from skyrl_stepwise.loop.engine_recovery import EngineRecoveryError
from test_rollout_ahead import SlowPolicy


class DyingEngine(ScriptedEngine):
    """Dies (every request fails, health false) at the `die_after`-th training request; `restart` brings it back
    with its *initial* weights: its logprobs disagree with the trainer's (-3.0 vs -0.5) until a sync."""

    def __init__(self, script, tokenizer, die_after: int) -> None:
        super().__init__(script, tokenizer)
        self.die_after, self.requests, self.alive, self.synced, self.restarts = die_after, 0, True, True, 0

    async def generate(self, prompt_ids, sampling, session_id=None):
        if session_id and session_id.startswith("train"):
            self.requests += 1
            if self.requests == self.die_after:
                self.alive = False
        if not self.alive:
            raise RuntimeError("ActorDiedError: The actor died unexpectedly before finishing this task.")
        result = await super().generate(prompt_ids, sampling, session_id)
        if not self.synced and result.logprobs is not None:
            result.logprobs = [-3.0] * len(result.logprobs)
        return result

    async def health(self) -> bool:
        return self.alive

    async def restart(self) -> None:
        self.alive, self.synced = True, False
        self.restarts += 1


class Sync:
    method = "recorded"

    def __init__(self, engine, works: bool = True) -> None:
        self.engine, self.works, self.syncs, self.forgotten = engine, works, 0, 0

    async def sync(self) -> int:
        self.syncs += 1
        self.engine.synced = self.engine.synced or self.works
        return 0

    def engines_restarted(self) -> None:
        self.forgotten += 1


def _trainer(tokenizer, tmp_path, die_after: int, sync_works: bool = True):
    from skyrl_stepwise.run.config import RunConfig
    from skyrl_stepwise.data.dataset import PromptRow
    from skyrl_stepwise.envs.base import EnvRegistry, StepResult
    from skyrl_stepwise.generator import GeneratorConfig, GeneratorSamplingConfig, StepwiseGenerator
    from skyrl_stepwise.loop.loop import RLTrainer, eval_config
    from skyrl_stepwise.loop.tracking import Tracker

    class OneTurn:
        async def reset(self, prompt_messages, extras):
            return list(prompt_messages)

        async def step(self, action_text):
            return StepResult([], reward=float("yes" in action_text), done=True)

    def script(prompt, session, index):
        return tokenizer.encode("yes" if session.endswith("_0") else "no", add_special_tokens=False) + \
            [tokenizer.eos_token_id]

    cfg = RunConfig(total_steps=3)
    cfg.generator = GeneratorConfig(max_turns=1, max_input_length=512, n_samples_per_prompt=4, show_progress=False,
                                    sampling=GeneratorSamplingConfig(max_generate_length=8))
    cfg.data.train_batch_size, cfg.data.shuffle = 1, False
    cfg.trainer.algorithm.use_kl_loss = False
    cfg.trainer.ckpt_interval, cfg.trainer.ckpt_dir = 0, str(tmp_path / "ckpts")
    cfg.validate()
    registry = EnvRegistry()
    registry.register("one", OneTurn)
    engine = DyingEngine(script, tokenizer, die_after)
    rows = [PromptRow(prompt=[{"role": "user", "content": f"Question {i}?"}], env_class="one", reward_spec={},
                      data_source="toy", instance_id=f"q{i}") for i in range(3)]
    sync = Sync(engine, sync_works)
    trainer = RLTrainer(cfg, StepwiseGenerator(tokenizer, engine, registry, cfg.generator),
                        StepwiseGenerator(tokenizer, engine, registry, eval_config(cfg.generator)), engine,
                        SlowPolicy(), None, Tracker(tmp_path, "p", "r", "disabled", {}), rows, [], [1, 2], sync)
    return trainer, engine, sync


async def test_an_engine_killed_mid_rollout_is_restarted_synced_probed_and_the_step_retried(tokenizer, tmp_path):
    trainer, engine, sync = _trainer(tokenizer, tmp_path, die_after=6)  # step 2's 2nd request: mid-rollout
    await trainer.fit()
    trainer.tracker.finish()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]  # the run finished every step
    assert engine.restarts == 1 and sync.forgotten == 1
    assert sync.syncs == 3 + 1  # one per step, and the one that put the current weights into the restarted engine
    assert [r["recovery/engine_restarts"] for r in records] == [0.0, 1.0, 0.0]
    assert [r["recovery/step_retries"] for r in records] == [0.0, 1.0, 0.0]
    # step 2 trained on its whole retried batch, sampled by the restarted engine with the trainer's weights
    assert records[1]["generate/failed_trajectories"] == 0 and records[1]["generate/num_trajectories"] == 4
    assert trainer.policy.trained_steps == ["train0", "train1", "train2"]
    assert records[1]["sync/probe_logprob_max_diff"] == 0.0


async def test_a_restart_whose_weight_sync_did_not_take_stops_the_run(tokenizer, tmp_path):
    trainer, engine, _ = _trainer(tokenizer, tmp_path, die_after=6, sync_works=False)
    with pytest.raises(EngineRecoveryError, match=r"engine\(s\) \[0\] restarted, but the first weight sync"):
        await trainer.fit()
    assert engine.restarts == 1 and trainer.policy.trained_steps == ["train0"]  # nothing sampled from wrong weights


async def test_a_dead_engine_that_cannot_restart_is_named():
    class Dead:
        async def health(self):
            raise ConnectionError("gone")

    with pytest.raises(EngineDeadError, match="engine 0 \\(Dead\\) is dead and cannot be restarted"):
        await restart_dead_engines(Dead())


@pytest.mark.integration
async def test_a_killed_vllm_actor_is_restarted_and_takes_the_trainers_weights(vllm_engine, model_path, tokenizer,
                                                                               tmp_path):
    """The real thing, on the session's engine: a vLLM actor killed by Ray is dead (health false); recovery starts a
    fresh actor (the checkpoint's weights) and the first sync must make it score like the trainer, trained one step
    at lr 1e-3, to 1e-3 (a checkpoint-weights engine differs from it by > 1e-2: test_weight_sync)."""
    import ray

    from skyrl_stepwise.policy.batching import TrainBatch
    from skyrl_stepwise.policy.config import TrainerConfig
    from skyrl_stepwise.loop.engine_recovery import recover_engines
    from skyrl_stepwise.policy.fsdp_worker import PolicyWorker
    from skyrl_stepwise.policy.weight_sync import WeightSync, WeightSyncConfig, probe_logprobs

    class Group:
        def __init__(self, worker):
            self.worker = worker

        def call(self, method, *args):
            return getattr(self.worker, method)(*args)

    engine = vllm_engine
    cfg = TrainerConfig(model_path=str(model_path), ckpt_dir=str(tmp_path / "ckpts"))
    cfg.fsdp.mixed_precision, cfg.optim.lr = False, 1e-3
    group = Group(PolicyWorker(cfg))
    original = tmp_path / "original.safetensors"
    group.call("export_weights", str(original), "float32")
    probe_ids = tokenizer.encode("The capital of France is", add_special_tokens=False)
    target = tokenizer.encode(" Lyon, of course.", add_special_tokens=False)
    group.call("train_step", TrainBatch(prompt_ids=[probe_ids], response_ids=[target],
                                        loss_masks=[[1] * len(target)], instance_ids=["sft"]), "sft")
    sync = WeightSync(WeightSyncConfig(), group, engine)
    probe = lambda: probe_logprobs(group, engine, probe_ids)  # noqa: E731
    try:
        assert await recover_engines(engine, sync, probe, 1e-3) is None  # alive: nothing to do
        ray.kill(engine.actor, no_restart=True)
        assert await _dead_within(engine, 60.0)  # ray.kill is asynchronous: the actor may answer once more
        recovery = await recover_engines(engine, sync, probe, 1e-3)
        assert recovery is not None and recovery.restarted == [0] and recovery.probe.max_abs_diff < 1e-3
        assert await engine.health()
    finally:  # the session engine is shared: alive again (whatever failed above), with the base model
        if not await engine.health():
            await engine.restart()
        await engine.update_weights_from_file(str(original))


async def _dead_within(engine, seconds: float) -> bool:
    """Poll the engine's health until it reports dead; False if it still answers after `seconds`."""
    import asyncio
    import time

    deadline = time.monotonic() + seconds
    while await engine.health():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.5)
    return True
