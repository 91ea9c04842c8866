"""Infrastructure failures stay in their trajectory: counted, never trained, excluded from the baseline, and
every engine session is released. The last test runs one real training step (SmolLM2 policy, scripted engine)."""

from __future__ import annotations

import re

import pytest

from skyrl_stepwise.envs.base import EnvRegistry, StepResult
from skyrl_stepwise.generator import GeneratorConfig, GeneratorSamplingConfig, StepwiseGenerator, TrajectoryID
from skyrl_stepwise.inference.base import GenerationResult
from skyrl_stepwise.inference.pool import EnginePool
from skyrl_stepwise.inference.scripted import ScriptedEngine
from skyrl_stepwise.algorithms.advantages import group_advantages

PROMPT = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
ROWS = ("a", "b", "c", "d")
REPS = 3


class FaultyEnv:
    """Reward 1 for 'yes'; raises in reset or step when told to."""

    def __init__(self, fault: str | None = None) -> None:
        self.fault = fault

    async def reset(self, prompt_messages, extras):
        if self.fault == "reset":
            raise ConnectionError("sandbox did not start")
        return list(prompt_messages)

    async def step(self, action_text):
        if self.fault == "step":
            raise TimeoutError("grader timed out")
        return StepResult([], reward=float("yes" in action_text), done=True)


class FaultyEngine(ScriptedEngine):
    """Aborts one session's request and raises on another's; everything else follows the script."""

    def __init__(self, script, tokenizer, abort: str, error: str) -> None:
        super().__init__(script, tokenizer)
        self.abort, self.error = abort, error

    async def generate(self, prompt_ids, sampling, session_id=None):
        if session_id == self.error:
            raise RuntimeError("engine core died")
        if session_id == self.abort:
            return GenerationResult([self.tokenizer.eos_token_id - 1], [-1.0], "abort")
        return await super().generate(prompt_ids, sampling, session_id)


def _setup(tokenizer, tag: str):
    """4 prompts x 3 samples; faults: a/rep0 env.step, b/rep0 env.reset, b/rep1 engine abort, c/rep0 engine error."""
    eos = tokenizer.eos_token_id
    answers = {0: "yes", 1: "no", 2: "yes"}

    def script(prompt, session, index):
        rep = int(session.rsplit("_", 1)[1]) if session and session[-1].isdigit() else 0
        return tokenizer.encode(answers[rep], add_special_tokens=False) + [eos]

    key = lambda row, rep: TrajectoryID(f"{tag}/{row}/{ROWS.index(row)}", rep).key()  # as loop.expand names them
    engine = EnginePool([FaultyEngine(script, tokenizer, abort=key("b", 1), error=key("c", 0))])
    faults = {0: "step", 3: "reset"}  # envs are created in trajectory order: row * REPS + rep
    created: list[FaultyEnv] = []
    registry = EnvRegistry()
    registry.register("faulty", lambda: created.append(FaultyEnv(faults.get(len(created)))) or created[-1])
    return engine, registry


def _generator_config(**overrides) -> GeneratorConfig:
    return GeneratorConfig(max_turns=2, max_input_length=512, n_samples_per_prompt=REPS, show_progress=False,
                           sampling=GeneratorSamplingConfig(max_generate_length=8), **overrides)


def test_a_group_left_with_one_trajectory_gets_no_advantage():
    scores = {TrajectoryID("p", 0): 1.0, TrajectoryID("q", 0): 1.0, TrajectoryID("q", 1): 0.0,
              TrajectoryID("solo", 0): 0.7}
    adv = group_advantages(scores, "grpo", failed=[TrajectoryID("p", 1), TrajectoryID("q", 2)])
    assert adv[TrajectoryID("p", 0)] == 0.0  # its siblings failed: nothing to compare with
    assert adv[TrajectoryID("q", 0)] > 0 > adv[TrajectoryID("q", 1)]  # two left: a normal baseline
    assert adv[TrajectoryID("solo", 0)] == pytest.approx(0.7)  # sampled alone (n=1): raw score, as before


async def test_each_failure_is_contained_counted_and_releases_its_session(tokenizer):
    from skyrl_stepwise.loop.loop import expand

    engine, registry = _setup(tokenizer, "t")
    gen = StepwiseGenerator(tokenizer, engine, registry, _generator_config())
    rows = [_row(r) for r in ROWS]
    out = await gen.generate(*expand(rows, REPS, "t"))
    m = out.rollout_metrics
    assert m["generate/failed_trajectories"] == 4 and m["generate/num_trajectories"] == 8
    for cause in ("env_reset", "env_step", "engine_error", "engine_abort"):
        assert m[f"generate/failed_trajectories/{cause}"] == 1
    failed = {(t.instance_id.split("/")[1], t.repetition_id) for t in out.failed_trajectory_ids}
    assert failed == {("a", 0), ("b", 0), ("b", 1), ("c", 0)}
    assert not {(t.instance_id.split("/")[1], t.repetition_id) for t in out.trajectory_ids} & failed
    assert engine.sessions == {} and engine.inflight == [0]


async def test_a_batch_where_everything_failed_fails_loudly(tokenizer):
    from skyrl_stepwise.loop.loop import expand

    registry = EnvRegistry()
    registry.register("faulty", lambda: FaultyEnv("reset"))
    gen = StepwiseGenerator(tokenizer, ScriptedEngine(lambda p, s, i: [1], tokenizer), registry, _generator_config())
    with pytest.raises(RuntimeError, match="every trajectory of the batch failed \\(env_reset\\).*sandbox"):
        await gen.generate(*expand([_row("a")], REPS, "t"))


def _row(name: str):
    from skyrl_stepwise.data.dataset import PromptRow

    return PromptRow(prompt=PROMPT, env_class="faulty", reward_spec={}, data_source="toy", instance_id=name)


class CapturingPolicy:
    """The in-process PolicyWorker behind the Ray group's `.call`, recording every train_step batch."""

    def __init__(self, worker) -> None:
        self.worker, self.batches = worker, []

    def call(self, method, *args):
        if method == "train_step":
            self.batches.append(args[0])
        return getattr(self.worker, method)(*args)


@pytest.mark.integration
async def test_one_real_training_step_with_failures(tokenizer, tiny_smollm2, tmp_path):
    """A real trainer step over failed trajectories: plumbing, on SmolLM2's tiny twin."""
    model_path = tiny_smollm2
    from skyrl_stepwise.run.config import RunConfig
    from skyrl_stepwise.policy.config import FSDPConfig, TrainerConfig
    from skyrl_stepwise.policy.fsdp_worker import PolicyWorker
    from skyrl_stepwise.loop.loop import RLTrainer, eval_config
    from skyrl_stepwise.loop.tracking import Tracker

    cfg = RunConfig(total_steps=1)
    cfg.generator = _generator_config()
    cfg.data.train_batch_size, cfg.data.shuffle = len(ROWS), False
    cfg.trainer = TrainerConfig(model_path=str(model_path), fsdp=FSDPConfig(world_size=1, mixed_precision=False),
                                policy_mini_batch_size=2, ckpt_interval=0, ckpt_dir=str(tmp_path / "ckpts"))
    cfg.trainer.algorithm.use_kl_loss = False
    cfg.validate()
    engine, registry = _setup(tokenizer, "train0")
    policy = CapturingPolicy(PolicyWorker(cfg.trainer))
    trainer = RLTrainer(cfg, StepwiseGenerator(tokenizer, engine, registry, cfg.generator),
                        StepwiseGenerator(tokenizer, engine, registry, eval_config(cfg.generator)), engine, policy,
                        None, Tracker(tmp_path, "p", "r", "disabled", {}), [_row(r) for r in ROWS], [],
                        tokenizer.encode("Hello", add_special_tokens=False))
    metrics = await trainer.train_step()

    assert metrics["generate/failed_trajectories"] == 4
    yes = len(tokenizer.encode("yes", add_special_tokens=False)) + 1
    no = len(tokenizer.encode("no", add_special_tokens=False)) + 1
    # survivors: yes from a2 b2 c2 d0 d2, no from a1 c1 d1; the failed four contribute no token
    assert metrics["train/loss_tokens"] == 5 * yes + 3 * no == sum(b.num_loss_tokens() for b in policy.batches)
    assert metrics["train/real_tokens"] == sum(sum(b.seq_lens()) for b in policy.batches)  # summed, not averaged
    assert metrics["train/optimizer_steps"] == 2 and len(policy.batches) == 2
    advantages = {}
    for batch in policy.batches:
        for iid, adv in zip(batch.instance_ids, batch.advantages):
            advantages.setdefault(iid.split("/")[1], []).append(adv[0])
    assert advantages["b"] == [0.0]  # left alone by its failed siblings: no baseline, no gradient
    for row in ("a", "c", "d"):
        assert any(a > 0 for a in advantages[row]) and any(a < 0 for a in advantages[row])
    assert metrics["train/grad_norm"] > 0
    assert engine.sessions == {}  # trajectories and the weight-sync probe all released their sessions
    assert engine.engines[0].weight_updates == 1


class BadOutputEnv:
    """A user's env getting its output wrong on one trajectory each: a NaN or inf reward, a non-text observation,
    a reset returning messages whose content is not text. The others answer like FaultyEnv."""

    def __init__(self, fault: str | None = None) -> None:
        self.fault = fault

    async def reset(self, prompt_messages, extras):
        if self.fault == "reset":
            return [{"role": "user", "content": ["Is the sky blue?"]}]
        return list(prompt_messages)

    async def step(self, action_text):
        if self.fault == "nan":
            return StepResult([], reward=float("nan"), done=True)
        if self.fault == "inf":
            return StepResult([], reward=float("-inf"), done=True)
        if self.fault == "observation":
            return StepResult([{"role": "user", "content": 42}], reward=0.0, done=False)
        return StepResult([], reward=float("yes" in action_text), done=True)


async def test_env_output_outside_the_contract_fails_that_trajectory_only_naming_the_class_and_field(tokenizer,
                                                                                                     caplog):
    """A non-finite reward once reached the advantages (and skipped the whole step's update); a non-text observation
    was reported as a chat-template refusal. Each now fails its own trajectory, counted, named in a warning."""
    import logging
    import math

    from skyrl_stepwise.algorithms.credit import compute_credit
    from skyrl_stepwise.policy.config import AlgorithmConfig
    from skyrl_stepwise.loop.loop import expand

    eos = tokenizer.eos_token_id
    answers = {0: "yes", 1: "no", 2: "yes"}
    script = lambda p, s, i: tokenizer.encode(answers[int(s.rsplit("_", 1)[1])], add_special_tokens=False) + [eos]
    faults = {0: "nan", 4: "inf", 7: "observation", 9: "reset"}  # row * REPS + rep
    created: list[BadOutputEnv] = []
    registry = EnvRegistry()
    registry.register("faulty", lambda: created.append(BadOutputEnv(faults.get(len(created)))) or created[-1])
    gen = StepwiseGenerator(tokenizer, ScriptedEngine(script, tokenizer), registry, _generator_config())
    with caplog.at_level(logging.WARNING):
        out = await gen.generate(*expand([_row(r) for r in ROWS], REPS, "t"))
    m = out.rollout_metrics
    assert m["generate/failed_trajectories"] == 4 and m["generate/failed_trajectories/env_output"] == 4
    failed = {(t.instance_id.split("/")[1], t.repetition_id) for t in out.failed_trajectory_ids}
    assert failed == {("a", 0), ("b", 1), ("c", 1), ("d", 0)}
    assert all(math.isfinite(r) for r in out.trajectory_rewards()) and len(out.trajectory_ids) == 8
    credit = compute_credit(out, AlgorithmConfig())
    assert all(math.isfinite(a) for adv in credit.advantages for a in adv)
    assert any(a != 0 for adv in credit.advantages for a in adv)  # the healthy rows still have a gradient
    env = "test_failures.BadOutputEnv"
    assert f"{env}.step reward is nan, not a finite number" in caplog.text
    assert f"{env}.step reward is -inf" in caplog.text
    assert f"{env}.step observations[0]['content'] must be a string, got int: '42'" in caplog.text
    assert f"{env}.reset return value[0]['content'] must be a string, got list" in caplog.text


def test_the_env_contract_names_each_field():
    from skyrl_stepwise.envs.contract import EnvOutputError, check_step_result

    env = BadOutputEnv()
    for result, field in ((StepResult([], "1", True), "reward must be a real number, got str"),
                          (StepResult([], None, True), "reward must be a real number, got NoneType"),
                          (StepResult("text", 0.0, True), "observations must be a list of chat messages, got str"),
                          (StepResult([{"content": "x"}], 0.0, True), "observations[0]['role'] must be a string"),
                          (StepResult([], 0.0, True, {"hits": "3"}), "metrics['hits'] must be a number, got str"),
                          ((["obs"], 1.0, True), "must return a StepResult, got tuple")):
        with pytest.raises(EnvOutputError, match=re.escape(f"BadOutputEnv.step_turn {field}")):
            check_step_result(result, env, "step_turn")
    assert check_step_result(StepResult([], True, True, {"n": 2}), env).reward is True  # bools and ints are numbers


async def test_a_failed_trajectory_is_shown_up_to_its_failure_and_reported(tokenizer, tmp_path, capsys):
    """report.md said nothing of failed trajectories (12 in one run read as a clean run on 4 samples) and `show`
    could not show one: its turns up to the failure (the turn the env failed on included) and the cause are in
    rollouts.jsonl, `show --failed` prints them, and the report counts them by cause."""
    import json

    from skyrl_stepwise.run.config import RunConfig
    from skyrl_stepwise.run.report import write_run_report
    from skyrl_stepwise.cli.show import main as show
    from skyrl_stepwise.loop.loop import expand
    from skyrl_stepwise.loop.rollout_samples import RolloutLog
    from skyrl_stepwise.loop.tracking import Tracker

    engine, registry = _setup(tokenizer, "t")
    gen = StepwiseGenerator(tokenizer, engine, registry, _generator_config())
    out = await gen.generate(*expand([_row(r) for r in ROWS], REPS, "t"))
    by_key = {f["trajectory"]: f for f in out.failed_trajectories}
    step_failure = by_key["t/a/0_0"]  # the env raised on the model's first turn: that turn is kept
    assert step_failure["cause"] == "env_step" and "timed out" in step_failure["message"]
    assert len(step_failure["samples"]) == 1 and tokenizer.decode(step_failure["samples"][0][1]).startswith("yes")
    assert by_key["t/b/1_0"]["samples"] == []  # reset failed: no turn

    log = RolloutLog(tmp_path, gen.loop.renderer, num_samples=8)
    log.record(out, 1, "train")
    tracker = Tracker(tmp_path, "p", "r", "disabled", {})
    tracker.log(dict(out.rollout_metrics), 1)
    tracker.finish()
    assert show([str(tmp_path), "--failed"]) == 0
    printed = capsys.readouterr().out
    assert "t/a/0_0 (failed) | reward not scored | stop failed: env_step" in printed
    assert "[FAILED, not trained: env_step: TimeoutError(" in printed and "yes" in printed
    assert "(no turn before the failure)" in printed  # env_reset
    recorded = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert sum(r["pick"] == "failed" for r in recorded) == 4

    cfg = RunConfig()
    cfg.total_steps, cfg.trainer.ckpt_dir = 1, str(tmp_path / "ckpts")
    text = write_run_report(cfg, tmp_path).read_text()
    assert "**4 trajectories failed** on 1 of 1 steps (" in text and "env_step 1" in text
    assert f"skyrl-stepwise show {tmp_path} --failed" in text
    assert "[FAILED, not trained" in text  # among the last step's samples


class _EngineThatShutsDown:
    """Holds every request until cancelled; a request cancelled after the engine shut down fails as Ray's do then
    (`ray.cancel` with Ray gone)."""

    def __init__(self) -> None:
        self.down = False

    async def generate(self, prompt_ids, sampling, session_id=None):
        import asyncio

        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            if self.down:
                raise RuntimeError("No owner found for object 0x1234") from None
            raise


async def test_trajectories_in_flight_when_the_run_stops_are_cancelled_not_failed(tokenizer, caplog):
    """Ctrl-C / SIGTERM cancels the step awaiting the rollouts; the trajectories still sampling were cancelled only
    after the engines and Ray shut down, and logged as failed (`No owner found for object`) on the way out."""
    import asyncio
    import logging

    from skyrl_stepwise.loop.loop import expand

    caplog.set_level(logging.WARNING)
    engine = _EngineThatShutsDown()
    registry = EnvRegistry()
    registry.register("faulty", lambda: FaultyEnv())
    gen = StepwiseGenerator(tokenizer, engine, registry, _generator_config())
    step = asyncio.ensure_future(gen.generate(*expand([_row(r) for r in ROWS], REPS, "t")))
    await asyncio.sleep(0.2)  # every trajectory is waiting for its first turn
    step.cancel()  # what the stop does to the step
    with pytest.raises(asyncio.CancelledError):
        await step
    engine.down = True  # the run's `finally`: engines and Ray shut down
    leftover = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in leftover:  # then asyncio.run cancels whatever is left
        task.cancel()
    await asyncio.gather(*leftover, return_exceptions=True)
    assert not [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
