"""The endpoint's core, without HTTP: sessions, one sampled call per request, replay of echoed history.

`complete(session, body)` turns a chat-completions body into one engine call whose prompt is exactly the ids a
continuation of the session's earlier calls needs (matching.py finds which; the renderer's `next_prompt` bridges
only the new messages, as the agent loop does), records it as a step sample, and answers in OpenAI shape with the
turn parsed by the family's own parser. A changed history starts a new chain from the template's rendering,
counted by reason under `gateway/chain_breaks/*`; a template that rewrites history is counted under
`gateway/bridge_fallbacks/*`. A sampled turn is never re-encoded from the client's text.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from skyrl_stepwise.chat import (ChatRenderer, Message, ParsedTurn, conversation_turn, create_renderer,
                                 observations_in_roles)
from skyrl_stepwise.envs.contract import EnvOutputError, check_reward
from skyrl_stepwise.gateway.config import GatewayConfig, check_generator_for_gateway
from skyrl_stepwise.gateway.matching import Key, assistant_echoes, break_reason, find_match, message_key
from skyrl_stepwise.gateway.reasoning import split_reasoning
from skyrl_stepwise.gateway.protocol import ChatRequest, GatewayError, parse_request
from skyrl_stepwise.gateway.session import SampledCall, Session
from skyrl_stepwise.generator.agent_loop import StepSample, TrajectoryResult
from skyrl_stepwise.generator.config import GeneratorConfig
from skyrl_stepwise.generator.output import TrajectoryID
from skyrl_stepwise.inference.base import InferenceEngine, SamplingParams

logger = logging.getLogger(__name__)
MAX_ENDED_SESSIONS = 100_000  # how many ended sessions a late call is still told about (then: unknown session)


class Gateway:
    """Sessions over one engine and one renderer; every call an exact step sample of its session's trajectory."""

    def __init__(self, tokenizer, engine: InferenceEngine, cfg: GeneratorConfig,
                 gateway: GatewayConfig | None = None, renderer: ChatRenderer | None = None) -> None:
        if not cfg.use_conversation_multi_turn or cfg.history != "exact":
            raise ValueError("the agent endpoint serves chat turns with exact history: it needs "
                             "generator.use_conversation_multi_turn=true and generator.history=exact")
        check_generator_for_gateway(cfg)
        self.cfg, self.engine = cfg, engine
        self.gateway = gateway or GatewayConfig()
        self.renderer = renderer or create_renderer(tokenizer, cfg.renderer, dict(cfg.chat_template_kwargs),
                                                    cfg.thinking_retention, cfg.tool_parser)
        self.model_names = list(self.gateway.model_names) or [tokenizer.name_or_path, "policy"]
        self.sessions: dict[str, Session] = {}
        self.counters: dict[str, float] = {}
        # why each recently closed session ended: an abandoned agent (timed out, its thread still running) calling
        # again gets that answer at once, not a sample nobody trains
        self.ended: OrderedDict[str, tuple[str, str]] = OrderedDict()  # session -> (why, error code)

    # sessions -------------------------------------------------------------------------------------------------
    def open_session(self, trajectory_id: TrajectoryID, session_id: str | None = None) -> str:
        """A session for one trajectory; its id goes in the agent's base URL (`/s/{id}/v1`)."""
        # a trajectory key holds '/' (train0/row/0_1): one URL path segment must not, or every call is a 404
        sid = session_id or f"{re.sub(r'[^A-Za-z0-9._-]', '_', trajectory_id.key())}-{uuid.uuid4().hex[:8]}"
        if sid in self.sessions:
            raise ValueError(f"session {sid!r} is already open")
        self.sessions[sid] = Session(sid, trajectory_id)
        return sid

    def session(self, session_id: str) -> Session:
        """The open session; a 409 naming why it ended where it did (failed, or closed for training); or the
        OpenAI-style 404 an agent with a wrong URL gets."""
        session = self.sessions.get(session_id)
        if session is not None:
            self._check_live(session)
        elif session_id in self.ended:
            raise self._ended(session_id, *self.ended[session_id])
        if session is None:
            self.count("refused/unknown_session")
            raise GatewayError(404, f"unknown session {session_id!r}: open one per trajectory (its id is the path "
                                    f"segment /s/{{session}}/v1)", "session", "session_not_found")
        return session

    def _check_live(self, session: Session) -> None:
        """A failed or closed session takes no more calls (409 naming it and why): its trajectory is not trained,
        so a sample for it would only spend engine time."""
        if session.closed or session.failure is not None:
            raise self._ended(session.id, *_why_ended(session))

    def _ended(self, session_id: str, why: str, code: str) -> GatewayError:
        self.count(f"refused/{code}")
        return GatewayError(409, f"session {session_id!r} has ended: {why}", "session", code)

    def post_reward(self, session_id: str, reward: Any, metrics: dict | None = None) -> None:
        """The agent (or its harness) reports the trajectory's reward instead of returning it. Reward and metrics
        are checked together before either is stored (an infinite reward would make its group's advantages NaN
        and skip the whole step), so a refused post leaves the session as it was."""
        session = self.session(session_id)
        try:
            value, numbers = checked_outcome(reward, metrics)
        except RewardError as e:
            self.count("refused/invalid_reward")
            raise GatewayError(400, str(e), e.param) from None
        session.reward = value
        session.metrics.update(numbers)

    def close_session(self, session_id: str) -> TrajectoryResult:
        """The trajectory of the session (failed ones carry their cause and no samples); the engine route is
        released."""
        session = self.sessions.pop(session_id)
        session.closed = True
        self.ended[session_id] = _why_ended(session)
        while len(self.ended) > MAX_ENDED_SESSIONS:
            self.ended.popitem(last=False)
        end_session = getattr(self.engine, "end_session", None)
        if end_session is not None:
            end_session(session.trajectory_id.key())
        result = session.result(self.renderer.stop_ids, self.renderer.close_id)
        if result.failure is not None:
            self.count(f"failed_trajectories/{result.failure}")
            # as the agent loop warns of a failed env trajectory: a timeout or a bad return is not only a counter
            logger.warning("agent trajectory %s failed (%s: %s); it is counted and not trained",
                           session.trajectory_id.key(), result.failure, result.failure_message)
        return result

    def count(self, name: str, by: float = 1) -> None:
        """A `gateway/*` counter."""
        key = f"gateway/{name}"
        self.counters[key] = self.counters.get(key, 0) + by

    def metrics(self, reset: bool = True) -> dict[str, float]:
        """The `gateway/*` counters since the last reset (one generate() call)."""
        out = dict(self.counters)
        if reset:
            self.counters = {}
        return out

    # one call -------------------------------------------------------------------------------------------------
    async def complete(self, session_id: str, body: Any) -> tuple[ChatRequest, dict[str, Any]]:
        """One chat completion: the validated request and the OpenAI response body. Refusals raise GatewayError
        and leave the session as it was; engine and renderer failures fail the session's trajectory only."""
        session = self.session(session_id)
        try:
            request = parse_request(body, self.cfg.sampling, self.model_names)
        except GatewayError as e:
            self.count(f"refused/{e.code or 'invalid'}")
            raise
        async with session.lock:
            self._check_live(session)  # it may have ended while this call waited for the one before
            prompt = self._prompt(session, request)
            if len(prompt.ids) > self.cfg.max_input_length:
                # the trajectory has reached the run's context limit: if the agent stops here, it stopped at a
                # limit (generator.context.mask_limit_stops), as the agent loop's trajectory would
                session.limit_stop = "context_exhausted"
                self.count("refused/context_length_exceeded")
                raise GatewayError(400, f"the prompt has {len(prompt.ids)} tokens, more than the run's "
                                        f"generator.max_input_length={self.cfg.max_input_length}", "messages",
                                   "context_length_exceeded")
            call = await self._sample(session, request, prompt.ids, prompt.history)
            session.limit_stop = None  # the agent went on within the limit (it shortened its history)
            self._account(session, prompt)
        self.count("calls")
        return request, self._response(session, request, call)

    def _prompt(self, session: Session, request: ChatRequest) -> Prompt:
        """The engine input: the earlier call's ids extended by the new messages where the request continues one,
        else the template's rendering (a new chain, with its reason). Nothing is counted here: what serving the
        call means for the chain is applied by `_account` once it is served, so a refused request changes
        nothing."""
        chat, tools_key = self.renderer, _tools_key(request.tools)
        calls = [(c.request_keys, c.reply, c.tools_key) for c in session.calls]
        counts: list[str] = []
        if calls:
            match = find_match(request.messages, calls, tools_key)
            if match is not None:
                call = session.calls[match.index]
                if match.index != len(calls) - 1:
                    counts.append("branches")  # continues an earlier call (a retry or a fork): still exact
                if match.repeated:
                    return Prompt(list(call.prompt_ids), list(call.history), counts + ["repeated_prompts"])
                new = self._template_messages(self._tie_tool_results(call.parsed.call_ids(), match.new, counts),
                                              call.parsed)
                turn = conversation_turn(call.parsed, new, chat.roles)
                history = call.history + [turn.assistant] + turn.observations
                nxt = self._render(session, chat.next_prompt, call.prompt_ids, call.response_ids, history,
                                   turn.observations, request.tools, call.parsed.malformed)
                # not extended: the template rewrites history (Qwen3 drops past reasoning), as in the agent loop
                return Prompt(nxt.ids, history, counts + (["extended"] if nxt.extended else []),
                              role_fallbacks=turn.role_fallbacks, bridge_fallback=None if nxt.extended else nxt.reason)
            reason = break_reason(request.messages, calls, tools_key)
        else:
            counts.append("chain_starts")
            reason = None
        history, moved = self._client_history(request.messages, session, counts)
        return Prompt(self._render(session, chat.prompt_ids, history, request.tools), history, counts,
                      role_fallbacks=moved, chain_break=reason)

    def _account(self, session: Session, prompt: Prompt) -> None:
        """What a served call did to its session's chain: counters, the trajectory's stats, the new-chain line."""
        for name in prompt.counts:
            self.count(name)
        session.stats.observation_role_fallbacks += prompt.role_fallbacks
        if prompt.bridge_fallback is not None:
            reason = prompt.bridge_fallback
            self.count(f"bridge_fallbacks/{reason}")
            session.stats.bridge_fallbacks += 1
            session.stats.fallback_reasons[reason] = session.stats.fallback_reasons.get(reason, 0) + 1
        if prompt.chain_break is not None:
            self.count("chain_breaks")
            self.count(f"chain_breaks/{prompt.chain_break}")
            session.stats.chain_breaks += 1
            logger.info("session %s: the client changed its history (%s%s); a new chain starts", session.id,
                        prompt.chain_break, ": it left out the reply it got, e.g. an agent that answers a reply "
                        "it cannot parse with a format error instead" if prompt.chain_break == "reply_dropped"
                        else "")

    async def _sample(self, session: Session, request: ChatRequest, prompt_ids: list[int],
                      history: list[Message]) -> SampledCall:
        """Sample one turn on the run's own settings and record it as a step sample."""
        chat, s = self.renderer, self.cfg.sampling
        index = len(session.calls)
        sampling = SamplingParams(max_tokens=min(request.max_tokens or s.max_generate_length, s.max_generate_length),
                                  temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                  stop=(*s.stop, *request.stop), logprobs=s.logprobs,
                                  seed=None if s.seed is None else
                                  zlib.crc32(f"{s.seed}:{session.trajectory_id.key()}:{index}".encode()) & 0x7FFFFFFF,
                                  stop_token_ids=tuple(sorted(chat.stop_ids)))
        t0 = time.perf_counter()
        try:
            result = await self.engine.generate(prompt_ids, sampling, session_id=session.trajectory_id.key())
        except Exception as e:
            session.fail("engine_error", repr(e))
            raise GatewayError(502, f"the engine failed: {e!r}", None, "engine_error", "server_error") from e
        session.stats.engine_seconds += time.perf_counter() - t0
        self._check_live(session)  # ended while the engine sampled (the agent timed out): not answered, not recorded
        if result.finish_reason == "abort":  # a half-sampled turn is neither answered nor trained
            session.fail("engine_abort", f"request aborted after {len(result.token_ids)} tokens")
            raise GatewayError(502, "the engine aborted the request", None, "engine_abort", "server_error")
        sampled = list(result.token_ids)
        logprobs = list(result.logprobs) if result.logprobs is not None else None
        response, mask = list(sampled), [1] * len(sampled)
        model_closed = bool(sampled) and sampled[-1] in chat.stop_ids
        if not model_closed and (result.finish_reason != "stop" or self.cfg.append_eos_after_stop_str):
            response.append(chat.close_id)  # ours, so the next turn can follow: never a training target
            mask.append(0)
            if logprobs is not None:
                logprobs.append(0.0)
        parsed = self._render(session, chat.parse, sampled, prompt_ids, request.tools)
        reply = reply_message(parsed, request.tool_choice)
        session.steps.append(StepSample(list(prompt_ids), list(response), mask, logprobs, 0.0, result.finish_reason))
        session.stats.sampled_tokens += len(sampled)
        call = SampledCall([message_key(m) for m in request.messages], reply, _tools_key(request.tools),
                           list(prompt_ids), response, history, parsed)
        session.calls.append(call)
        return call

    def _render(self, session: Session, fn, *args):
        """A renderer call; the template refusing the client's conversation is the client's 400, anything else
        fails the session (cause `render`)."""
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - templates raise what they like
            self.count("refused/render")
            raise GatewayError(400, f"the chat template cannot render this conversation: {type(e).__name__}: {e}",
                               "messages", "render_error") from e

    def _response(self, session: Session, request: ChatRequest, call: SampledCall) -> dict[str, Any]:
        """The OpenAI chat.completion body of a call."""
        step = session.steps[-1]
        finish = "length" if step.stop_reason == "length" else "tool_calls" if call.reply.get("tool_calls") \
            else "stop"
        completion = sum(step.loss_mask)
        return {"id": f"chatcmpl-{session.id}-{len(session.calls)}", "object": "chat.completion",
                "created": int(time.time()), "model": request.model,
                "choices": [{"index": 0, "message": call.reply, "finish_reason": finish,
                             "logprobs": self._logprobs(step) if request.logprobs else None}],
                "usage": {"prompt_tokens": len(call.prompt_ids), "completion_tokens": completion,
                          "total_tokens": len(call.prompt_ids) + completion}}

    def _logprobs(self, step: StepSample) -> dict[str, Any]:
        """OpenAI's `choices[0].logprobs`: each sampled token (never one we appended) with its recorded logprob."""
        tokens = [(t, lp) for t, lp, m in zip(step.response_ids, step.logprobs or [], step.loss_mask) if m]
        content = []
        for token, logprob in tokens:
            text = self.renderer.decode([token])
            content.append({"token": text, "logprob": float(logprob), "bytes": list(text.encode("utf-8")),
                            "top_logprobs": []})
        return {"content": content, "refusal": None}

    # messages -------------------------------------------------------------------------------------------------
    def _template_messages(self, messages: list[Message], answered: ParsedTurn | None) -> list[Message]:
        """Client messages in the shape the renderer takes: `developer` as `system` where the template does not render
        it, tool results named after the call they answer, arguments as the template wants them (dict, or JSON text
        for DeepSeek R1)."""
        names = {i: c.name for c, i in zip(answered.tool_calls, answered.call_ids())} if answered else {}
        out = []
        for m in messages:
            role = "system" if m["role"] == "developer" and not self.renderer.roles.developer else m["role"]
            msg: Message = {"role": role, "content": m.get("content") or ""}
            if role == "tool":
                if m.get("tool_call_id"):
                    msg["tool_call_id"] = m["tool_call_id"]
                name = m.get("name") or names.get(m.get("tool_call_id"))
                if name:
                    msg["name"] = name
            elif role == "assistant" and m.get("tool_calls"):
                msg["tool_calls"] = [self._template_call(c) for c in m["tool_calls"]]
                if getattr(self.renderer, "string_arguments", False) and not m.get("content"):
                    msg["content"] = None
            out.append(msg)
        return out

    def _tie_tool_results(self, call_ids: list[str], messages: list[Message], counts: list[str]) -> list[Message]:
        """The `tool` messages that open `messages` answer the calls `call_ids` of the turn before them: one whose
        `tool_call_id` names none of them (a client that numbers calls its own way, or echoes a stale id) is tied
        to the call at its position, counted in `gateway/tool_call_id_mismatches`, so the template renders it as
        that call's result (Mistral refuses a result that answers no call; others would render it as answering
        nothing). The count goes to `counts` (applied when the call is served)."""
        known, out = set(call_ids), []
        for k, m in enumerate(messages):
            if m.get("role") != "tool":
                out.extend(messages[k:])
                break
            if call_ids and m.get("tool_call_id") not in known and k < len(call_ids):
                counts.append("tool_call_id_mismatches")
                m = {**m, "tool_call_id": call_ids[k]}
            out.append(m)
        return out

    def _template_call(self, call: dict) -> dict:
        fn = call["function"]
        arguments = fn.get("arguments")
        if isinstance(arguments, str) and not getattr(self.renderer, "string_arguments", False):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass
        return {"type": "function", "id": call.get("id") or "", "function": {"name": fn["name"],
                                                                            "arguments": arguments}}

    def _client_history(self, messages: list[Message], session: Session,
                        counts: list[str]) -> tuple[list[Message], int]:
        """A new chain's messages: the client's, except that an assistant turn this server sampled is rendered from
        its parsed ids (as the agent loop's history holds it), not from the client's re-serialised echo; and how
        many observations went in a fallback role."""
        out: list[Message] = []
        moved_total = 0
        last_turn: ParsedTurn | None = None
        assistant: Message | None = None
        after: list[Message] = []  # the messages since the last assistant turn, placed in roles at the next one

        def place() -> None:
            # a `tool` message the template refuses or drops goes in its fallback role, as in a continued chain
            nonlocal moved_total
            ids = [c.get("id") for c in (assistant or {}).get("tool_calls") or []]
            placed, moved = observations_in_roles(assistant, self._tie_tool_results(ids, after, counts),
                                                  self.renderer.roles)
            moved_total += moved
            out.extend(placed)
            after.clear()

        for m in messages:
            if m["role"] == "assistant":
                place()
                call = next((c for c in reversed(session.calls) if assistant_echoes(m, c.reply)), None)
                if call is not None:
                    assistant = conversation_turn(call.parsed, [], self.renderer.roles).assistant
                    last_turn = call.parsed
                else:
                    assistant = self._template_messages([m], None)[0]
                    last_turn = None
                out.append(assistant)
                continue
            after.extend(self._template_messages([m], last_turn))
        place()
        return out, moved_total


def _why_ended(session: Session) -> tuple[str, str]:
    """How a session ended, for the answer to a call that comes after, and the error code."""
    if session.failure is not None:
        return (f"its trajectory failed ({session.failure}: {session.failure_message}) and is not trained; "
                "the agent program should stop", "session_failed")
    return "its trajectory was collected for training; later calls are not part of it", "session_ended"


@dataclass
class Prompt:
    """An engine input and what serving it means for its session's chain, applied only once the call is served
    (Gateway._account): a refused request (too long, unrenderable) leaves every counter and the chain as they were."""

    ids: list[int]
    history: list[Message]
    counts: list[str] = field(default_factory=list)  # gateway/* counters (extended, chain_starts, branches, ...)
    role_fallbacks: int = 0  # observations placed in a fallback role
    bridge_fallback: str | None = None  # the template rewrote history: the reason
    chain_break: str | None = None  # the client changed its history: the reason (a new chain starts)


class RewardError(ValueError):
    """A reward or metric outside the contract; `param` names the field (`reward`, `metrics.<key>`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def checked_outcome(reward: Any, metrics: Any = None) -> tuple[float, dict[str, float]]:
    """A trajectory's reward and metrics as finite floats, by the env contract's own check (envs/contract.py), or a
    RewardError naming the field: a NaN or infinite reward poisons its group's advantages, a metric that is not a
    number fails the step's logging. A bool is refused too: `True` is a verdict, not a reward."""
    def number(value: Any, param: str) -> float:
        if isinstance(value, bool):
            raise RewardError(f"{param} must be a finite number, got a bool: {value!r}", param)
        try:
            return check_reward(value, param)
        except EnvOutputError:
            raise RewardError(f"{param} must be a finite number, got {type(value).__name__}: {value!r}",
                              param) from None

    if metrics is not None and not isinstance(metrics, dict):
        raise RewardError(f"metrics must be an object of numbers, got {type(metrics).__name__}: {metrics!r}",
                          "metrics")
    numbers = {str(k): number(v, f"metrics.{k}") for k, v in (metrics or {}).items()}
    return number(reward, "reward"), numbers


def reply_message(parsed: ParsedTurn, tool_choice: str) -> Message:
    """The assistant message the client gets: content, reasoning_content and the calls the family's parser read.
    A malformed call has no OpenAI form: the turn's sampled call text stays in the content, so the client sees
    what the model wrote; with tool_choice=none no call is offered for execution either."""
    calls = [(c, i) for c, i in zip(parsed.tool_calls, parsed.call_ids()) if c.error is None]
    # the text before the calls: a template that cannot render `tool_calls` keeps their text in the turn's content
    # (its history shows them that way), but a client gets them as structured calls only, so an echo with
    # `content: null` is the same turn
    answer = parsed.answer
    reasoning, content = (parsed.reasoning, answer) if parsed.reasoning else split_reasoning(answer)
    if parsed.tool_calls and (tool_choice == "none" or not calls):
        content, calls = content + parsed.calls_text, []
    message: Message = {"role": "assistant", "content": content if content or not calls else None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [
            {"id": i, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments if isinstance(c.arguments, str)
                          else json.dumps(c.arguments, ensure_ascii=False)}} for c, i in calls]
    return message


def _tools_key(tools: list[dict] | None) -> Key:
    return (json.dumps(tools, sort_keys=True),) if tools else ()
