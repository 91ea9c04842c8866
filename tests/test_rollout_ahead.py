"""Async rollouts with bounded staleness (trainer.max_staleness): the engines generate the next steps while the
trainer updates, never with weights more than max_staleness updates old, and never across a weight sync."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import pytest

from skyrl_stepwise.loop.rollout_ahead import RolloutAhead


class FakeRun:
    """A trainer and engines in miniature: `sample` takes `generate_s`, an update `train_s`; every event is logged
    with the weights version it saw, so the tests can check what overlapped with what."""

    def __init__(self, generate_s: float, train_s: float, fail_at: int | None = None) -> None:
        self.generate_s, self.train_s, self.fail_at = generate_s, train_s, fail_at
        self.events: list[tuple[str, int]] = []
        self.version = 0

    async def sample(self, step: int) -> str:
        self.events.append(("generate start", step))
        await asyncio.sleep(self.generate_s)
        if step == self.fail_at:
            raise ConnectionError(f"engine died during step {step}")
        self.events.append(("generate end", step))
        return f"rollouts of step {step}"

    async def train(self, ahead: RolloutAhead, first_step: int, total_steps: int) -> list[int]:
        """The trainer's side: returns the staleness of every step's batch."""
        staleness = []
        for step in range(first_step, total_steps):
            rollout = await ahead.next()
            assert rollout.step == step and rollout.result == f"rollouts of step {step}"
            staleness.append(step - rollout.weights_version)
            await asyncio.sleep(self.train_s)
            async with ahead.weights_update():
                self.events.append(("sync start", step))
                await asyncio.sleep(0.01)
                self.events.append(("sync end", step))
        return staleness


def _never_during_a_sync(events: list[tuple[str, int]]) -> None:
    generating = syncing = False
    for kind, _ in events:
        generating = {"generate start": True, "generate end": False}.get(kind, generating)
        syncing = {"sync start": True, "sync end": False}.get(kind, syncing)
        assert not (generating and syncing), events


@pytest.mark.parametrize("max_staleness", [1, 2])
async def test_rollouts_run_ahead_by_at_most_max_staleness_and_never_across_a_sync(max_staleness):
    run = FakeRun(generate_s=0.02, train_s=0.1)  # the update is the slow part: generation runs as far ahead as allowed
    ahead = RolloutAhead(run.sample, 0, 6, max_staleness)
    try:
        staleness = await run.train(ahead, 0, 6)
    finally:
        await ahead.close()
    # step s trains on rollouts from the weights of update s - max_staleness (the first steps: the initial ones)
    assert staleness == [min(step, max_staleness) for step in range(6)]
    _never_during_a_sync(run.events)
    # overlap: step 1's rollouts were generated before step 0's update was synced
    assert run.events.index(("generate end", 1)) < run.events.index(("sync start", 0))
    assert [step for kind, step in run.events if kind == "generate start"] == list(range(6))


async def test_slow_generation_keeps_the_trainer_waiting_not_the_bound():
    run = FakeRun(generate_s=0.08, train_s=0.01)  # generation is the slow part: batches are fresh when they arrive
    ahead = RolloutAhead(run.sample, 0, 4, 2)
    try:
        staleness = await run.train(ahead, 0, 4)
    finally:
        await ahead.close()
    assert all(0 <= s <= 2 for s in staleness) and staleness[0] == 0
    _never_during_a_sync(run.events)


async def test_a_resumed_run_starts_at_its_step_with_its_weights():
    run = FakeRun(generate_s=0.01, train_s=0.05)
    ahead = RolloutAhead(run.sample, 3, 5, 1)
    try:
        assert await run.train(ahead, 3, 5) == [0, 1]
    finally:
        await ahead.close()
    assert [step for kind, step in run.events if kind == "generate start"] == [3, 4]


async def test_a_generation_failure_is_raised_to_the_trainer():
    run = FakeRun(generate_s=0.01, train_s=0.01, fail_at=1)
    ahead = RolloutAhead(run.sample, 0, 3, 1)
    try:
        with pytest.raises(ConnectionError, match="engine died during step 1"):
            await run.train(ahead, 0, 3)
    finally:
        await ahead.close()


async def test_close_stops_generating():
    run = FakeRun(generate_s=0.05, train_s=0.0)
    ahead = RolloutAhead(run.sample, 0, 100, 1)
    await ahead.next()
    await ahead.close()
    started = len(run.events)
    await asyncio.sleep(0.1)
    assert len(run.events) == started and started <= 4


async def test_zero_staleness_is_the_synchronous_loop_not_this():
    with pytest.raises(ValueError, match="trainer.max_staleness must be >= 1"):
        RolloutAhead(FakeRun(0, 0).sample, 0, 1, 0)


# --- the RL loop with rollouts ahead -----------------------------------------------------------------------------


class SlowPolicy:
    """PolicyGroup's interface; an update or a checkpoint save blocks its thread for a while, as a Ray get does."""

    def __init__(self) -> None:
        self.trained_steps: list[str] = []
        self.saved_steps: list[int] = []

    def call(self, method: str, *args):
        if method == "save_checkpoint":
            time.sleep(0.5)
            self.saved_steps.append(args[0])
            return None
        if method == "compute_logprobs":
            return [[-0.5] * len(ids) for ids in args[0].response_ids]
        if method == "train_step":
            time.sleep(0.3)
            self.trained_steps.append(sorted({iid.split("/")[0] for iid in args[0].instance_ids})[0])
            return {"policy/loss": 0.0, "train/real_tokens": 4.0, "train/packed_tokens": 4.0,
                    "train/padded_batch_tokens": 4.0}
        return None


def _trainer(tokenizer, tmp_path, max_staleness: int):
    from skyrl_stepwise.run.config import RunConfig
    from skyrl_stepwise.data.dataset import PromptRow
    from skyrl_stepwise.envs.base import EnvRegistry, StepResult
    from skyrl_stepwise.generator import GeneratorConfig, GeneratorSamplingConfig, StepwiseGenerator
    from skyrl_stepwise.inference.scripted import ScriptedEngine
    from skyrl_stepwise.loop.loop import RLTrainer, eval_config
    from skyrl_stepwise.loop.tracking import Tracker

    class OneTurn:
        async def reset(self, prompt_messages, extras):
            return list(prompt_messages)

        async def step(self, action_text):
            return StepResult([], reward=float("yes" in action_text), done=True)

    class VersionedEngine(ScriptedEngine):
        """Records the weights version (syncs so far) each training rollout was sampled with."""

        version = 0
        seen: dict[str, set[int]] = {}

        async def generate(self, prompt_ids, sampling, session_id=None):
            if session_id and session_id.startswith("train"):
                self.seen.setdefault(session_id.split("/")[0], set()).add(self.version)
            await asyncio.sleep(0.02)
            return await super().generate(prompt_ids, sampling, session_id)

    class Sync:
        method = "recorded"

        def __init__(self, engine) -> None:
            self.engine = engine

        async def sync(self) -> int:
            self.engine.version += 1
            return 0

    def script(prompt, session, index):  # rewards differ within a group, so every step trains
        return tokenizer.encode("yes" if session.endswith("_0") else "no", add_special_tokens=False) + \
            [tokenizer.eos_token_id]

    cfg = RunConfig(total_steps=4)
    cfg.generator = GeneratorConfig(max_turns=1, max_input_length=512, n_samples_per_prompt=2, show_progress=False,
                                    sampling=GeneratorSamplingConfig(max_generate_length=8))
    cfg.data.train_batch_size, cfg.data.shuffle = 1, False
    cfg.trainer.algorithm.use_kl_loss = False
    cfg.trainer.ckpt_interval, cfg.trainer.ckpt_dir = 0, str(tmp_path / "ckpts")
    cfg.trainer.max_staleness = max_staleness
    cfg.validate()
    registry = EnvRegistry()
    registry.register("one", OneTurn)
    engine = VersionedEngine(script, tokenizer)
    engine.seen = {}
    rows = [PromptRow(prompt=[{"role": "user", "content": f"Question {i}?"}], env_class="one", reward_spec={},
                      data_source="toy", instance_id=f"q{i}") for i in range(4)]
    policy = SlowPolicy()
    trainer = RLTrainer(cfg, StepwiseGenerator(tokenizer, engine, registry, cfg.generator),
                        StepwiseGenerator(tokenizer, engine, registry, eval_config(cfg.generator)), engine,
                        policy, None, Tracker(tmp_path, "p", "r", "disabled", {}), rows, [], [1, 2], Sync(engine))
    return trainer, engine, policy


async def test_the_loop_trains_every_step_on_rollouts_one_update_old(tokenizer, tmp_path, caplog):
    trainer, engine, policy = _trainer(tokenizer, tmp_path, max_staleness=1)
    with caplog.at_level(logging.INFO, logger="skyrl_stepwise"):
        await trainer.fit()
    assert "step 2: " in caplog.text and "staleness=1 " in caplog.text  # on the console line of each step
    trainer.tracker.finish()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["prompts"] for r in records] == [["q0"], ["q1"], ["q2"], ["q3"]]  # the synchronous loop's order
    assert [r["async/staleness"] for r in records] == [0.0, 1.0, 1.0, 1.0]
    # each step's rollouts came from one weights version: the one before the previous step's update
    assert engine.seen == {"train0": {0}, "train1": {0}, "train2": {1}, "train3": {2}}
    assert policy.trained_steps == ["train0", "train1", "train2", "train3"]
    assert all(r["timing/rollout_wait_s"] < r["timing/generate_s"] for r in records[1:])  # hidden by the update
    assert trainer.ahead is None  # closed with the run


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
async def test_a_checkpoint_save_never_stalls_the_rollouts_running_ahead(tokenizer, tmp_path):
    """A save is a blocking Ray get; on the event loop it froze the rollouts ahead (and their tools' timeouts
    then fired for calls that had finished). The loop must keep ticking through every save."""
    trainer, _, policy = _trainer(tokenizer, tmp_path, max_staleness=1)
    trainer.cfg.trainer.ckpt_interval = 1
    gaps: list[float] = []

    async def heartbeat():
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    beat = asyncio.create_task(heartbeat())
    await trainer.fit()
    beat.cancel()
    assert policy.saved_steps == [1, 2, 3, 4]
    assert max(gaps) < 0.25, max(gaps)  # each save blocks its thread for 0.5 s, never the loop


def test_config_refuses_stale_rollouts_without_importance_weights_or_with_memory_handover():
    from skyrl_stepwise.run.config import RunConfig

    cfg = RunConfig()
    cfg.trainer.max_staleness = 1
    cfg.validate()  # the defaults: TIS on, no offload, no sleep
    cfg.trainer.algorithm.tis_ratio_clip_high = None
    with pytest.raises(ValueError, match=r"trainer.max_staleness=1 .* trainer.algorithm.tis_ratio_clip_high"):
        cfg.validate()
    cfg = RunConfig()
    cfg.trainer.max_staleness, cfg.trainer.fsdp.offload_during_rollout = 2, True
    with pytest.raises(ValueError, match="trainer.fsdp.offload_during_rollout=false"):
        cfg.validate()
    cfg = RunConfig()
    cfg.trainer.max_staleness, cfg.engine.sleep_during_update = 1, True
    with pytest.raises(ValueError, match="engine.sleep_during_update=false"):
        cfg.validate()
    cfg = RunConfig()
    cfg.trainer.max_staleness = -1
    with pytest.raises(ValueError, match="trainer.max_staleness must be >= 0"):
        cfg.validate()


class LengthEnv:
    """Reward = length of the answer: continuous, so every group has signal and every update moves the weights."""

    async def reset(self, prompt_messages, extras):
        return list(prompt_messages)

    async def step(self, action_text):
        from skyrl_stepwise.envs.base import StepResult

        return StepResult([], reward=len(action_text) / 10, done=True)


class ScoringPolicy:
    """A real single-process PolicyWorker; before each update it scores the batch with the weights it is about
    to update, so a test can see how far those are from the weights that sampled the batch."""

    def __init__(self, worker) -> None:
        self.worker, self.rollout_gap = worker, []

    def call(self, method: str, *args):
        if method == "train_step":
            batch = args[0]
            trainer = self.worker.compute_logprobs(batch)
            self.rollout_gap.append(max(abs(a - b) for t, r, m in zip(trainer, batch.rollout_logprobs, batch.loss_masks)
                                        for a, b, keep in zip(t, r, m) if keep))
        return getattr(self.worker, method)(*args)


@pytest.mark.integration
async def test_a_real_trainer_trains_on_rollouts_sampled_one_update_ago(tokenizer, tiny_smollm2, tmp_path):
    """SmolLM2's tiny twin in a transformers engine and a real trainer: step 0's rollouts were sampled by the
    trainer's own weights, later steps' by the weights of one update before (the gap truncated IS corrects), and
    after every sync the engine scores exactly like the trainer. Staleness bookkeeping: no real weights needed."""
    import json

    from skyrl_stepwise.run.config import RunConfig
    from skyrl_stepwise.data.dataset import PromptRow
    from skyrl_stepwise.envs.base import EnvRegistry
    from skyrl_stepwise.generator import GeneratorConfig, GeneratorSamplingConfig, StepwiseGenerator
    from skyrl_stepwise.inference import EngineConfig, HFEngine
    from skyrl_stepwise.policy.config import FSDPConfig, TrainerConfig
    from skyrl_stepwise.policy.fsdp_worker import PolicyWorker
    from skyrl_stepwise.loop.loop import RLTrainer, eval_config
    from skyrl_stepwise.loop.tracking import Tracker

    cfg = RunConfig(total_steps=3)
    cfg.generator = GeneratorConfig(max_turns=1, max_input_length=256, n_samples_per_prompt=4, show_progress=False,
                                    sampling=GeneratorSamplingConfig(max_generate_length=12))
    cfg.data.train_batch_size, cfg.data.shuffle = 1, False
    model_path = tiny_smollm2
    cfg.trainer = TrainerConfig(model_path=str(model_path), fsdp=FSDPConfig(world_size=1, mixed_precision=False),
                                ckpt_interval=0, ckpt_dir=str(tmp_path / "ckpts"), max_staleness=1)
    cfg.trainer.algorithm.use_kl_loss = False
    cfg.trainer.optim.lr = 1e-2  # one update moves a random tiny model's logprobs well past float32 noise
    cfg.validate()
    registry = EnvRegistry()
    registry.register("length", LengthEnv)
    engine = HFEngine(EngineConfig(backend="transformers", model_path=str(model_path), dtype="float32",
                                   max_model_len=512, seed=0))
    policy = ScoringPolicy(PolicyWorker(cfg.trainer))
    rows = [PromptRow(prompt=[{"role": "user", "content": f"Name a colour ({i})."}], env_class="length",
                      reward_spec={}, data_source="toy", instance_id=f"c{i}") for i in range(3)]
    trainer = RLTrainer(cfg, StepwiseGenerator(tokenizer, engine, registry, cfg.generator),
                        StepwiseGenerator(tokenizer, engine, registry, eval_config(cfg.generator)), engine, policy,
                        None, Tracker(tmp_path, "p", "r", "disabled", {}), rows, [],
                        tokenizer.encode("Hello", add_special_tokens=False))
    await trainer.fit()
    trainer.tracker.finish()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]

    assert [r["async/staleness"] for r in records] == [0.0, 1.0, 1.0]
    assert all(r["train/grad_norm"] > 0 and r["sync/probe_logprob_max_diff"] < 1e-3 and r["sync/probe_tokens"] > 0
               for r in records)
    same_weights, *one_update_old = policy.rollout_gap
    assert same_weights < 1e-3, policy.rollout_gap  # sampled and trained by the same weights: float32 noise
    assert all(gap > 1e-2 for gap in one_update_old), policy.rollout_gap  # the staleness the IS weights correct
    assert all("policy/tis_weight" in r for r in records)
