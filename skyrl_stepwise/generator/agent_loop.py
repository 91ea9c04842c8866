"""One trajectory, one async loop: generate, act in the env, extend the history, go again.

History is kept as token ids. The next prompt is `prompt + sampled (+ appended EOS) + what the model's
renderer puts next` (`skyrl_stepwise.chat`); where that cannot be proven exact, the renderer re-renders the
full history, which starts a new step chain, and we count it with its reason. The length check always runs
on the prompt that is about to be sent.

Infrastructure failures (env.reset or env.step raising or returning what the env contract refuses, e.g. a NaN
reward or an observation that is not text (envs/contract.py), the engine raising or aborting a request) end
the trajectory as *failed*: it is counted by cause and never becomes training data, because a reward
of 0 for a crashed env or a half-sampled aborted turn is something we made up, not something the
policy did. The engine session is released whatever happens.

Every env call is bounded by generator.env_timeout_s: a hung env (or the reward function inside its step) fails
its trajectory (cause env_reset / env_step, "timed out") instead of hanging the batch. The env's `aclose` runs
after the outcome is decided: if it raises or hangs, the trajectory's samples stand (its reward came from the
steps, which completed) and the failure is logged and counted in `generate/env_close_errors`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
import zlib
from dataclasses import dataclass, field

from skyrl_stepwise.chat import ChatRenderer, conversation_turn, create_renderer, developer_as_system
from skyrl_stepwise.envs.base import Env, Message, TurnEnv
from skyrl_stepwise.envs.contract import EnvOutputError, check_messages, check_step_result, env_name
from skyrl_stepwise.generator.config import GeneratorConfig
from skyrl_stepwise.generator.context import (ContextEdit, ContextView, KeptTurn, Tokens, flatten, make_policy,
                                              rebuild)
from skyrl_stepwise.generator.output import TrajectoryID
from skyrl_stepwise.inference.base import InferenceEngine, SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class StepSample:
    """One model turn: the prompt it saw and exactly the ids it produced (plus a masked EOS)."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float] | None  # None when the engine was not asked for logprobs: never made up
    reward: float
    stop_reason: str
    kind: str = "action"  # "summary": a summary turn the context policy asked for (no env step)


@dataclass
class TrajectoryStats:
    """Per-trajectory counters that become `rollout_metrics`."""

    bridge_fallbacks: int = 0
    fallback_reasons: dict[str, int] = field(default_factory=dict)
    retokenize_drift_steps: int = 0
    first_divergence: list[int] = field(default_factory=list)
    env_seconds: float = 0.0
    engine_seconds: float = 0.0
    chain_breaks: int = 0  # next prompt does not extend prompt + response (a new step chain starts)
    observation_role_fallbacks: int = 0  # observations rendered in another role than the env gave (template refuses it)
    prompt_too_long: bool = False
    env_metrics: dict[str, float] = field(default_factory=dict)
    # context management (generator/context.py): edits are chain breaks of their own, never template fallbacks
    context_edits: int = 0
    context_fires: int = 0  # how often the policy changed anything (a truncated observation counts once)
    context_tokens_dropped: int = 0
    context_summaries: int = 0
    context_summaries_skipped: int = 0  # the summary prompt itself would not fit
    context_rerenders: int = 0  # rebuilding an edited context, the template forced a re-render
    sampled_tokens: int = 0
    observed_tokens: int = 0
    env_close_errors: int = 0  # the env's aclose raised or timed out (the trajectory's samples stand)
    tool_call_turns: int = 0  # agent programs: replies that carried a tool call the client could run
    context_events: list[dict] = field(default_factory=list)  # where the context was edited and what was dropped


FAILURE_CAUSES = ("env_reset", "env_step", "env_output", "engine_error", "engine_abort", "render", "context_policy")
# why a trajectory stopped at a limit of its own (not the per-turn `length` of max_generate_length)
LIMIT_STOPS = ("context_exhausted", "budget_exhausted")


@dataclass
class TrajectoryResult:
    """A rolled-out trajectory; `failure` names the cause when infrastructure failed (then it is not trained)."""

    trajectory_id: TrajectoryID
    steps: list[StepSample]
    stats: TrajectoryStats
    failure: str | None = None
    failure_message: str = ""
    # a failed trajectory's turns up to the failure (the turn the env failed on included): never trained, kept so
    # `show` and rollouts.jsonl can show what the model wrote before the env or engine failed
    partial_steps: list[StepSample] = field(default_factory=list)


class _TrajectoryFailed(Exception):
    """Internal: unwinds `run` to the single place that turns a failure into a TrajectoryResult."""

    def __init__(self, cause: str, error: BaseException | str) -> None:
        super().__init__(f"{cause}: {error}")
        self.cause = cause


def _first_divergence(a: list[int], b: list[int]) -> int:
    """Index of the first differing token (len of the shorter if one is a prefix)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def _turn_seed(base_seed: int | None, trajectory_id: TrajectoryID, turn: int) -> int | None:
    """A reproducible per-(trajectory, turn) seed, so reruns with a fixed seed sample the same ids."""
    if base_seed is None:
        return None
    return zlib.crc32(f"{base_seed}:{trajectory_id.key()}:{turn}".encode()) & 0x7FFFFFFF


_ROLES_SAID: set[tuple[str, tuple[str, ...]]] = set()  # (env class, roles) already named, once per process


def say_observation_roles(env, observations: list[Message]) -> None:
    """Name, once per env class and set of roles, the roles its observations come in: the start-up line can only
    say how the template renders each role (chat/adaptation.py); which one the env uses is the env's."""
    roles = tuple(sorted({str(m.get("role")) for m in observations}))
    key = (env_name(env), roles)
    if not roles or key in _ROLES_SAID:
        return
    _ROLES_SAID.add(key)
    logger.info("env %s: observations as %s messages", key[0], " and ".join(f"`{r}`" for r in roles))


class AgentLoop:
    """Runs trajectories against one engine and one renderer; stateless across trajectories."""

    def __init__(self, tokenizer, engine: InferenceEngine, cfg: GeneratorConfig,
                 renderer: ChatRenderer | None = None) -> None:
        self.cfg = cfg
        self.engine = engine
        self.renderer = renderer or create_renderer(tokenizer, cfg.renderer, dict(cfg.chat_template_kwargs),
                                                    cfg.thinking_retention, cfg.tool_parser)
        self.close_id = self.renderer.close_id
        self.policy = make_policy(cfg.context)
        self.tokens = Tokens(self.renderer.encode, self.renderer.decode)

    def _sampling(self, trajectory_id: TrajectoryID, turn: int) -> SamplingParams:
        s = self.cfg.sampling
        return SamplingParams(max_tokens=s.max_generate_length, temperature=s.temperature, top_p=s.top_p,
                              top_k=s.top_k, stop=tuple(s.stop), logprobs=s.logprobs,
                              seed=_turn_seed(s.seed, trajectory_id, turn),
                              stop_token_ids=tuple(sorted(self.renderer.stop_ids)))

    async def run(self, env: Env, prompt_messages: list[Message], extras: dict,
                  trajectory_id: TrajectoryID) -> TrajectoryResult:
        """Roll out one trajectory; a failure stays in this trajectory and the engine session is always released."""
        stats = TrajectoryStats()
        steps: list[StepSample] = []  # filled turn by turn: on a failure, what happened before it
        try:
            await self._rollout(env, prompt_messages, extras, trajectory_id, stats, steps)
        except _TrajectoryFailed as failed:
            logger.warning("trajectory %s failed (%s); it is counted and not trained", trajectory_id.key(), failed)
            return TrajectoryResult(trajectory_id, [], stats, failed.cause, str(failed), partial_steps=steps)
        finally:
            end_session = getattr(self.engine, "end_session", None)  # a pool forgets the sticky route
            if end_session is not None:
                end_session(trajectory_id.key())
            close = getattr(env, "aclose", None)  # an env holding a session (OpenEnv) releases it, however it ended
            if close is not None:
                try:
                    await self._bounded(close())
                except Exception as e:  # noqa: BLE001 - the trajectory's outcome stands; the leak is reported
                    stats.env_close_errors += 1
                    logger.warning("closing the env of trajectory %s failed: %r", trajectory_id.key(), e)
        return TrajectoryResult(trajectory_id, steps, stats)

    async def _rollout(self, env: Env, prompt_messages: list[Message], extras: dict, trajectory_id: TrajectoryID,
                       stats: TrajectoryStats, steps: list[StepSample]) -> list[StepSample]:
        """The loop itself, appending each turn to `steps`; never emits a step whose prompt exceeds
        max_input_length. A turn the env fails on is appended before the failure is raised (never trained)."""
        cfg, chat = self.cfg, self.renderer
        try:
            messages = await self._bounded(env.reset(prompt_messages, {**extras, "max_turns": cfg.max_turns}))
        except Exception as e:
            raise _TrajectoryFailed("env_reset", repr(e)) from e
        messages = self._checked(check_messages, messages, f"{env_name(env)}.reset return value")
        messages = developer_as_system(messages, chat.roles)
        tools = getattr(env, "tool_schemas", None) or None  # OpenAI function schemas the env offers, rendered
        history: list[Message] = list(messages)  # text view, for full re-renders and `retokenize`
        prompt_ids = self._render(chat.prompt_ids, history, tools)
        single_message_text = ""  # single-message mode: the one growing assistant message
        limit_stop: str | None = None
        initial, kept = list(messages), []  # what a context policy sees: first messages, then kept turns
        budget = cfg.context.token_budget

        for turn in range(cfg.max_turns):
            if len(prompt_ids) > cfg.max_input_length:
                limit_stop = "context_exhausted"
                stats.prompt_too_long = not steps
                break
            if budget is not None and steps and stats.sampled_tokens + stats.observed_tokens >= budget:
                limit_stop = "budget_exhausted"
                break
            t0 = time.perf_counter()
            try:
                result = await self.engine.generate(prompt_ids, self._sampling(trajectory_id, turn),
                                                    session_id=trajectory_id.key())
            except Exception as e:
                raise _TrajectoryFailed("engine_error", repr(e)) from e
            stats.engine_seconds += time.perf_counter() - t0
            if result.finish_reason == "abort":  # a half-sampled turn is neither acted on nor trained
                raise _TrajectoryFailed("engine_abort", f"request aborted after {len(result.token_ids)} tokens")
            sampled = list(result.token_ids)
            stats.sampled_tokens += len(sampled)
            logprobs = list(result.logprobs) if result.logprobs is not None else None
            model_eos = bool(sampled) and sampled[-1] in chat.stop_ids
            action_ids = sampled[:-1] if model_eos else sampled
            action_text = chat.decode(action_ids)

            turn_parsed = None
            takes_turns = isinstance(env, TurnEnv)  # tool envs take the turn as parsed from the sampled ids
            if takes_turns:
                if not cfg.use_conversation_multi_turn:
                    raise ValueError(f"{type(env).__name__} takes parsed chat turns (tool calls): it needs "
                                     "generator.use_conversation_multi_turn=true")
                turn_parsed = self._render(chat.parse, sampled, prompt_ids, tools)
            t0 = time.perf_counter()
            failed_turn = StepSample(prompt_ids, list(sampled), [1] * len(sampled), logprobs, 0.0, "env_failed")
            try:
                step = await self._bounded(env.step_turn(turn_parsed) if takes_turns else env.step(action_text))
            except Exception as e:
                steps.append(failed_turn)
                raise _TrajectoryFailed("env_step", repr(e)) from e
            try:
                step = self._checked(check_step_result, step, env, "step_turn" if takes_turns else "step")
            except _TrajectoryFailed:
                steps.append(failed_turn)
                raise
            stats.env_seconds += time.perf_counter() - t0
            for k, v in step.metrics.items():
                stats.env_metrics[k] = stats.env_metrics.get(k, 0.0) + float(v)

            # Single-message mode has one assistant message: the model's own EOS ends it, and the trajectory.
            ends_message = model_eos and not cfg.use_conversation_multi_turn
            last_turn = step.done or ends_message or turn == cfg.max_turns - 1
            response, mask = list(sampled), [1] * len(sampled)
            if not model_eos and self._needs_eos(last_turn, result.finish_reason):
                response.append(self.close_id)  # appended after the fact: never a training target
                mask.append(0)
                if logprobs is not None:
                    logprobs.append(0.0)
            steps.append(StepSample(prompt_ids, response, mask, logprobs, float(step.reward), result.finish_reason))
            if last_turn:
                break

            observations = step.observations
            say_observation_roles(env, observations)
            if cfg.use_conversation_multi_turn:
                observations = self._observe(observations, len(steps), stats)
                parsed = turn_parsed or self._render(chat.parse, response, prompt_ids, tools)
                # the turn and its observations in roles the template renders (malformed calls answered)
                conversation = conversation_turn(parsed, observations, chat.roles)
                stats.observation_role_fallbacks += conversation.role_fallbacks
                observations = conversation.observations
                history.append(conversation.assistant)
                history.extend(observations)
                next_ids = self._next_conversation_prompt(prompt_ids, response, observations, history, tools, stats,
                                                          keep_turn=parsed.malformed)
                kept.append(KeptTurn(response, conversation.assistant, observations, parsed.malformed))
                edit = self._decide(initial, kept, next_ids, stats)
                if edit is not None and edit.summarize:
                    summary = await self._summarize(prompt_ids, response, observations, history, initial, kept, tools,
                                                    trajectory_id, turn, stats, edit, len(steps))
                    if summary is not None:
                        summary_step, next_ids, kept = summary
                        steps.append(summary_step)
                        history = flatten(initial, kept)
                elif edit is not None:
                    next_ids = self._apply_edit(initial, kept, edit, tools, stats, len(steps))
                    history = flatten(initial, kept)
            else:
                observation_text = "".join(m["content"] for m in observations)
                single_message_text += action_text + observation_text
                next_ids = prompt_ids + response + chat.encode(observation_text)
                if cfg.history == "retokenize":
                    first_prompt = chat.decode(steps[0].prompt_ids)
                    retok = chat.encode(first_prompt + single_message_text)
                    self._count_drift(retok, next_ids, stats)
                    next_ids = retok
            chain = prompt_ids + response
            if next_ids[:len(chain)] != chain:
                stats.chain_breaks += 1
                stats.observed_tokens += sum(self.tokens.count(m["content"]) for m in observations
                                             if isinstance(m.get("content"), str))
            else:
                stats.observed_tokens += len(next_ids) - len(chain)
            prompt_ids = next_ids

        if limit_stop is not None and steps:
            last = steps[-1]
            last.stop_reason = limit_stop
            if not last.response_ids or last.response_ids[-1] not in chat.stop_ids:
                last.response_ids.append(self.close_id)  # appended by us: masked
                last.loss_mask.append(0)
                if last.logprobs is not None:
                    last.logprobs.append(0.0)
            last.reward += await self._tell_env(env, limit_stop)
        return steps

    async def _bounded(self, awaitable):
        """An env call within generator.env_timeout_s; past it, TimeoutError naming the limit (the caller fails the
        trajectory). A call that is not awaitable (a sync `aclose`) raises TypeError here, as any wrong return."""
        limit = self.cfg.env_timeout_s
        try:
            return await asyncio.wait_for(awaitable, limit) if limit is not None else await awaitable
        except asyncio.TimeoutError:
            raise TimeoutError(f"env call timed out after generator.env_timeout_s={limit:g} s") from None

    async def _tell_env(self, env: Env, reason: str) -> float:
        """The documented hook `Env.on_context_exhausted(reason) -> float | None`: the env learns the trajectory hit
        a limit (`context_exhausted`, `budget_exhausted`) and may return a terminal reward (added to the last step)."""
        hook = getattr(env, "on_context_exhausted", None)
        if hook is None:
            return 0.0
        try:
            value = hook(reason)
            if inspect.isawaitable(value):
                value = await self._bounded(value)
        except Exception as e:
            raise _TrajectoryFailed("env_step", f"on_context_exhausted: {e!r}") from e
        return 0.0 if value is None else float(value)

    def _observe(self, observations: list[Message], step_index: int, stats: TrajectoryStats) -> list[Message]:
        """Observations as the policy lets them into the context (truncate); a policy error fails this trajectory."""
        try:
            edit = self.policy.observe(observations, self.tokens)
        except Exception as e:
            raise _TrajectoryFailed("context_policy", f"{self.policy.name}.observe: {e!r}") from e
        if edit is None:
            return observations
        stats.context_fires += 1
        stats.context_tokens_dropped += edit.tokens_dropped
        stats.context_events.append({"before_step": step_index, "policy": self.policy.name, "kind": "truncate",
                                     "tokens_dropped": edit.tokens_dropped, "note": edit.note})
        return edit.observations

    def _decide(self, initial, kept, next_ids, stats: TrajectoryStats) -> ContextEdit | None:
        """Ask the policy, with the next prompt rendered, whether to edit; a policy error fails this trajectory."""
        view = ContextView(initial, kept, len(next_ids), self.cfg.max_input_length, stats.context_summaries,
                           self.tokens)
        try:
            return self.policy.between_turns(view)
        except Exception as e:
            raise _TrajectoryFailed("context_policy", f"{self.policy.name}.between_turns: {e!r}") from e

    def _apply_edit(self, initial, kept, edit: ContextEdit, tools, stats: TrajectoryStats, step_index: int):
        """Replace the observations the policy dropped and rebuild the next prompt exactly (a new chain)."""
        for i, observations in edit.replace.items():
            if not 0 <= i < len(kept):
                raise _TrajectoryFailed("context_policy", f"{self.policy.name} replaced turn {i} of {len(kept)}")
            kept[i].observations, kept[i].edited = list(observations), True
        built = self._render(rebuild, self.renderer, initial, kept, tools, self.cfg.history == "retokenize")
        stats.context_edits += 1
        stats.context_fires += 1
        stats.context_tokens_dropped += edit.tokens_dropped
        stats.context_rerenders += built.rerenders
        stats.context_events.append({"before_step": step_index, "policy": self.policy.name, "kind": "edit",
                                     "tokens_dropped": edit.tokens_dropped, "note": edit.note})
        return built.ids

    def _ask_for_summary(self, prompt_ids, response, history, observations, tools, keep_turn) -> list[int]:
        """The summary prompt: the instruction as a user message after the observations, or, where the template
        wants alternating roles (Mistral, Gemma 2), appended to the last observation's text."""
        chat, instruction = self.renderer, self.cfg.context.summary_instruction
        last = observations[-1] if observations else None
        if last is None or last.get("role") != "user":
            ask = {"role": "user", "content": instruction}
            try:
                return chat.next_prompt(prompt_ids, response, history + [ask], observations + [ask], tools,
                                        keep_turn).ids
            except Exception:  # noqa: BLE001 - the template refuses a user message here: append it instead
                if last is None:
                    raise
        merged = dict(last, content=f"{last['content']}\n\n{instruction}")
        return chat.next_prompt(prompt_ids, response, history[:-1] + [merged], observations[:-1] + [merged], tools,
                                keep_turn).ids

    async def _summarize(self, prompt_ids, response, observations, history, initial, kept, tools, trajectory_id,
                         turn, stats: TrajectoryStats, edit: ContextEdit, step_index: int):
        """The policy model writes a summary turn (an action, trained unless context.train_summaries=false) on the
        prompt that crossed the threshold plus the instruction; the context restarts from the first messages, the
        summary exactly as sampled and the resume message. None where the summary prompt would not fit."""
        cfg, chat = self.cfg, self.renderer
        ask = self._render(self._ask_for_summary, prompt_ids, response, history, observations, tools,
                           kept[-1].keep_turn)
        if len(ask) > cfg.max_input_length:
            stats.context_summaries_skipped += 1
            return None
        try:
            result = await self.engine.generate(ask, self._sampling(trajectory_id, -1 - stats.context_summaries),
                                                session_id=trajectory_id.key())
        except Exception as e:
            raise _TrajectoryFailed("engine_error", repr(e)) from e
        if result.finish_reason == "abort":
            raise _TrajectoryFailed("engine_abort", f"summary request aborted after {len(result.token_ids)} tokens")
        sampled = list(result.token_ids)
        stats.sampled_tokens += len(sampled)
        logprobs = list(result.logprobs) if result.logprobs is not None else None
        response_ids, mask = list(sampled), [int(cfg.context.train_summaries)] * len(sampled)
        if not (sampled and sampled[-1] in chat.stop_ids) and self._needs_eos(False, result.finish_reason):
            response_ids.append(self.close_id)  # ours: never trained
            mask.append(0)
            if logprobs is not None:
                logprobs.append(0.0)
        step = StepSample(ask, response_ids, mask, logprobs, 0.0, result.finish_reason, kind="summary")
        parsed = self._render(chat.parse, response_ids, ask, tools)
        resume = conversation_turn(parsed, [{"role": "user", "content": cfg.context.resume_message}], chat.roles)
        new_kept = [KeptTurn(response_ids, resume.assistant, resume.observations, parsed.malformed, kind="summary")]
        base = self._render(chat.prompt_ids, initial, tools)
        next_ids = self._next_conversation_prompt(base, response_ids, resume.observations,
                                                  flatten(initial, new_kept), tools, stats, keep_turn=parsed.malformed)
        stats.context_edits += 1
        stats.context_fires += 1
        stats.context_summaries += 1
        stats.context_tokens_dropped += max(len(ask) - len(base), 0)
        stats.context_events.append({"before_step": step_index + 1, "policy": self.policy.name, "kind": "summary",
                                     "tokens_dropped": max(len(ask) - len(base), 0),
                                     "note": f"{edit.note}; {len(ask) - len(base)} context tokens replaced by a "
                                             f"{len(sampled)}-token summary (step {step_index})"})
        return step, next_ids, new_kept

    @staticmethod
    def _checked(check, *args):
        """Env output through its contract check; a violation ends this trajectory only (cause `env_output`), its
        message naming the env class and the field."""
        try:
            return check(*args)
        except EnvOutputError as e:
            raise _TrajectoryFailed("env_output", str(e)) from e

    @staticmethod
    def _render(fn, *args):
        """Call the renderer; a template or parser exception ends this trajectory only (cause `render`)."""
        try:
            return fn(*args)
        except Exception as e:
            raise _TrajectoryFailed("render", f"{type(e).__name__}: {e}") from e

    def _needs_eos(self, last_turn: bool, finish_reason: str) -> bool:
        """A finished trajectory always ends on EOS; a chat turn needs one to close the message."""
        if last_turn:
            return True
        if not self.cfg.use_conversation_multi_turn:
            return False  # single-message mode: the assistant message continues after the observation
        return finish_reason != "stop" or self.cfg.append_eos_after_stop_str

    def _next_conversation_prompt(self, prompt_ids, response, observations, history, tools, stats,
                                  keep_turn: bool = False) -> list[int]:
        """Extend prompt + sampled ids by what the template puts next; a re-render is counted with its reason."""
        chat = self.renderer
        nxt = self._render(chat.next_prompt, prompt_ids, response, history, observations, tools, keep_turn)
        if self.cfg.history == "retokenize":
            retok = self._render(chat.prompt_ids, history, tools)
            if nxt.extended:
                self._count_drift(retok, nxt.ids, stats)
            return retok
        if not nxt.extended:
            stats.bridge_fallbacks += 1
            stats.fallback_reasons[nxt.reason] = stats.fallback_reasons.get(nxt.reason, 0) + 1
            logger.debug("%s: re-rendering the full history (%s)", chat.name, nxt.reason)
        return nxt.ids

    @staticmethod
    def _count_drift(retokenized: list[int], exact: list[int], stats: TrajectoryStats) -> None:
        if retokenized != exact:
            stats.retokenize_drift_steps += 1
            stats.first_divergence.append(_first_divergence(retokenized, exact))
