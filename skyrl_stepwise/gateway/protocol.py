"""Chat-completions requests as typed values: every field checked, and every refusal an OpenAI-style error body
naming the field, so a bad request never reaches the engine and never crashes the run.

Sampling is the run's (generator.sampling): a request may restate it but not change it, because the trainer
computes logprobs under the sampler's distribution; anything that would reshape that distribution (another
temperature, top_p, penalties, logit bias, constrained decoding, forced tool calls) is refused with the reason.
`max_tokens` may only shorten a turn and `stop` may only cut it: neither changes a sampled token's probability.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from skyrl_stepwise.chat.base import ContentError, text_content
from skyrl_stepwise.generator.config import GeneratorSamplingConfig

ROLES = ("system", "developer", "user", "assistant", "tool")


class GatewayError(Exception):
    """A refused request: HTTP status + the OpenAI error body (`message`, `type`, `param`, `code`)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        """The JSON body OpenAI clients parse into their APIError."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(message: str, param: str, code: str = "invalid_value") -> GatewayError:
    """A 400 naming the field."""
    return GatewayError(400, message, param, code)


@dataclass
class ChatRequest:
    """A validated request: messages in OpenAI shape, tools, and the only per-request sampling a run can train on."""

    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str = "auto"  # "auto" or "none"
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    logprobs: bool = False  # the sampled tokens' logprobs in the response (the run must record them)
    extra: dict[str, Any] = field(default_factory=dict)


# fields that reshape the sampling distribution and the value at which they do not
_NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "min_p": 0, "min_tokens": 0}
_CONSTRAINED = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                "structured_outputs")


def parse_request(body: Any, sampling: GeneratorSamplingConfig, model_names: list[str]) -> ChatRequest:
    """The request as a ChatRequest, or a GatewayError naming the first bad field."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", "body")
    model = body.get("model")
    if not isinstance(model, str) or model not in model_names:
        raise GatewayError(404, f"model {model!r} is not served by this run; served: {model_names}", "model",
                           "model_not_found")
    _check_sampling(body, sampling)
    tools = _check_tools(body.get("tools"))
    tool_choice = _check_tool_choice(body.get("tool_choice"), tools)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise bad(f"max_tokens must be a positive integer, got {max_tokens!r}", "max_tokens")
    stop = body.get("stop")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise bad("stop must be a non-empty string or a list of them", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad(f"stream must be a boolean, got {stream!r}", "stream")
    for key in ("functions", "function_call"):  # the legacy function-calling API: ignoring it would hide the tools
        if body.get(key) is not None:
            raise bad(f"{key} is the deprecated function-calling API, not served here: send `tools` (and "
                      f"`tool_choice`) instead", key, "unsupported_parameter")
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise bad(f"logprobs must be a boolean, got {logprobs!r}", "logprobs")
    if logprobs and not sampling.logprobs:
        raise bad("logprobs=true needs the run to record them (generator.sampling.logprobs=true); it does not",
                  "logprobs", "unsupported_parameter")
    top = body.get("top_logprobs")
    if top not in (None, 0):
        raise bad(f"top_logprobs={top!r}: only the sampled tokens' logprobs are recorded; omit it or send 0",
                  "top_logprobs", "unsupported_parameter")
    messages = _check_messages(body.get("messages"))
    return ChatRequest(model, messages, tools, tool_choice, max_tokens, tuple(stop), stream, bool(logprobs))


def _check_sampling(body: dict, sampling: GeneratorSamplingConfig) -> None:
    """Refuse what would make the trainer's logprobs differ from the sampler's (see module docstring)."""
    for key, run_value in (("temperature", sampling.temperature), ("top_p", sampling.top_p), ("top_k", sampling.top_k)):
        value = body.get(key)
        if value is None:
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isclose(value, run_value,
                                                                                             abs_tol=1e-6):
            raise bad(f"{key}={value!r} differs from the run's generator.sampling.{key}={run_value}: the trainer's "
                      f"logprobs are computed under the run's sampling, so a turn sampled otherwise cannot be "
                      f"trained; omit {key} or send {run_value}", key, "sampling_not_trainable")
    for key, neutral in _NEUTRAL.items():
        value = body.get(key)
        if value is not None and value != neutral:
            raise bad(f"{key}={value!r} reshapes the sampling distribution, which the trainer's logprobs do not "
                      f"model; omit it (or send {neutral})", key, "sampling_not_trainable")
    if body.get("logit_bias"):
        raise bad("logit_bias reshapes the sampling distribution, which the trainer's logprobs do not model",
                  "logit_bias", "sampling_not_trainable")
    for key in _CONSTRAINED:
        value = body.get(key)
        if value is not None and not (key == "response_format" and isinstance(value, dict)
                                      and value.get("type") == "text"):
            raise bad(f"{key} asks for constrained decoding, which masks tokens the trainer's logprobs do not "
                      f"mask; it is not supported on a training endpoint", key, "sampling_not_trainable")
    n = body.get("n")
    if n is not None and n != 1:
        raise bad(f"n={n!r}: one choice per call (each call is one step of one trajectory)", "n")


def _check_tools(tools: Any) -> list[dict] | None:
    """OpenAI function tools; each entry checked so a template never renders half a schema."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise bad(f"tools must be a list, got {type(tools).__name__}", "tools")
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad(f"{where} must be an object with type 'function'", f"{where}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise bad(f"{where}.function must be an object", f"{where}.function")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad(f"{where}.function.name must be a non-empty string", f"{where}.function.name")
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise bad(f"{where}.function.parameters must be a JSON schema object", f"{where}.function.parameters")
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise bad(f"tools has duplicate function names: {names}", "tools")
    return tools


def _check_tool_choice(choice: Any, tools: list[dict] | None) -> str:
    """auto or none; forcing a call needs constrained decoding, which the trainer cannot reproduce."""
    if choice is None:
        return "auto"
    if isinstance(choice, dict) and set(choice) == {"type"}:  # {"type": "auto"}: the Responses API's spelling
        choice = choice["type"]
    if choice in ("auto", "none"):
        return choice
    raise bad(f"tool_choice={choice!r}: forcing a call needs constrained decoding, whose masked distribution the "
              f"trainer's logprobs do not model; use 'auto' (or 'none')", "tool_choice", "sampling_not_trainable")


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    """Messages with known roles and text content (parts joined); images are refused, not dropped."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list", "messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise bad(f"{where}.role must be one of {list(ROLES)}", f"{where}.role")
        content = message.get("content")
        if content is not None:
            try:
                content = text_content(content, f"{where}.content")
            except ContentError as e:
                raise bad(str(e), e.param) from None
        if message.get("function_call") is not None:
            raise bad(f"{where}.function_call is the deprecated function-calling API: echo the turn's `tool_calls`",
                      f"{where}.function_call", "unsupported_parameter")
        calls = message.get("tool_calls")
        if calls is not None:
            if message["role"] != "assistant" or not isinstance(calls, list):
                raise bad(f"{where}.tool_calls must be a list on an assistant message", f"{where}.tool_calls")
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise bad(f"{where}.tool_calls[{j}].function.name must be a string",
                              f"{where}.tool_calls[{j}].function.name")
        out.append({**message, "content": content})
    return out
