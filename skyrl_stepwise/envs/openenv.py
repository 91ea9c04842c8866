"""OpenEnv environments as env classes, over openenv-core's own client (`GenericEnvClient`, one WebSocket session
per trajectory: OpenEnv servers allow no concurrent sessions on one connection by default).

Plugged in through `environment.env_classes` with a server address instead of an import path:

    environment.env_classes:
      echo: "openenv:http://127.0.0.1:8000"                         # a text env: the sampled turn is the action
      calc: "openenv-mcp:http://127.0.0.1:8001"                      # an MCP env: its tools, called by the model
      game: "openenv:http://host:8000?action_field=guess&observation_field=prompt"
      mine: "openenv:local://my_env.server:app/text"                 # a server the run starts and stops

Text envs: our sampled turn becomes `{action_field: text}`, the observation's text a user message, reward and done
come from the server. MCP envs: `ListToolsAction` at reset gives the tool schemas shown in the model's own
template; each parsed call becomes a `CallToolAction`, its result (or the server's tool error) a tool message, so
no per-environment action parser is written. A server error, timeout or disconnect raises OpenEnvError, which ends
that trajectory only (counted by the generator, never trained as reward 0); the session is closed however the
trajectory ends.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from skyrl_stepwise.envs.base import Message, StepResult
from skyrl_stepwise.envs.openenv_local import (LOCAL_SCHEME, is_local_url, is_running, local_server_url,
                                               parse_local_url)

TEXT_SCHEME, MCP_SCHEME = "openenv:", "openenv-mcp:"
_QUIET_FIELDS = {"reward", "done", "metadata"}


class OpenEnvError(RuntimeError):
    """The OpenEnv server failed (error reply, timeout, closed connection): an infrastructure failure."""


@dataclass(frozen=True)
class OpenEnvConfig:
    """Where the server is and how our text maps onto its action and observation."""

    base_url: str
    mcp: bool = False
    action_field: str = "message"
    observation_field: str | None = None  # None: the observation's only text field, else all of it as JSON
    connect_timeout_s: float = 10.0
    message_timeout_s: float = 60.0


def is_openenv_spec(value: str) -> bool:
    """Whether an env_classes value names an OpenEnv server rather than an import path."""
    return str(value).startswith((TEXT_SCHEME, MCP_SCHEME))


def parse_openenv_spec(value: str, key: str) -> OpenEnvConfig:
    """`openenv[-mcp]:URL[?action_field=..&observation_field=..&message_timeout_s=..]` -> OpenEnvConfig; a
    malformed one fails naming `key`."""
    mcp = value.startswith(MCP_SCHEME)
    url = value[len(MCP_SCHEME if mcp else TEXT_SCHEME):]
    parts = urlsplit(url)
    if parts.scheme == LOCAL_SCHEME:
        parse_local_url(urlunsplit(parts._replace(query="")), key)  # malformed: fails now, naming the key
    elif parts.scheme not in ("http", "https", "ws", "wss") or not parts.netloc:
        raise ValueError(f"{key}: {value!r}: expected openenv:http://HOST:PORT or openenv:local://MODULE:APP[/PATH] "
                         "(or openenv-mcp:...)")
    options = dict(parse_qsl(parts.query))
    allowed = {"action_field", "observation_field", "connect_timeout_s", "message_timeout_s"}
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ValueError(f"{key}: unknown option {unknown[0]!r} in {value!r} (allowed: {sorted(allowed)})")
    try:
        timeouts = {k: float(options.pop(k)) for k in ("connect_timeout_s", "message_timeout_s") if k in options}
    except ValueError:
        raise ValueError(f"{key}: {value!r}: timeouts must be numbers") from None
    base_url = urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/"), "", ""))
    return OpenEnvConfig(base_url, mcp, **options, **timeouts)


def observation_text(observation: Any, field: str | None) -> str:
    """The observation as the text of a message: `field` if named, the observation's only text field if it has one,
    otherwise every field but reward/done/metadata as JSON."""
    if not isinstance(observation, dict):
        return "" if observation is None else str(observation)
    if field is not None:
        return str(observation.get(field, ""))
    shown = {k: v for k, v in observation.items() if k not in _QUIET_FIELDS and v not in (None, "", [], {})}
    texts = [v for v in shown.values() if isinstance(v, str)]
    if len(shown) == 1 and len(texts) == 1:
        return texts[0]
    return json.dumps(shown, default=str) if shown else ""


def with_observation(prompt_messages: list[Message], text: str) -> list[Message]:
    """The row's prompt, then reset's observation as a user message, unless it has no text or a message of the
    prompt already says exactly that (rows that carry the env's question would otherwise show it twice)."""
    said = {m.get("content").strip() for m in prompt_messages if isinstance(m.get("content"), str)}
    if not text or text.strip() in said:
        return list(prompt_messages)
    return list(prompt_messages) + [{"role": "user", "content": text}]


class _Session:
    """One trajectory's connection; every failure of the client becomes OpenEnvError naming the server."""

    def __init__(self, cfg: OpenEnvConfig) -> None:
        self.cfg = cfg
        self.client = None

    async def open(self):
        from openenv.core.generic_client import GenericEnvClient

        self.client = GenericEnvClient(base_url=self.cfg.base_url, connect_timeout_s=self.cfg.connect_timeout_s,
                                       message_timeout_s=self.cfg.message_timeout_s)
        await self.guarded("connect", self.client.connect())

    async def guarded(self, what: str, awaitable):
        try:
            return await awaitable
        except Exception as e:  # noqa: BLE001 - any client failure is the server's, not the model's
            raise OpenEnvError(f"OpenEnv server {self.cfg.base_url} failed on {what}: {type(e).__name__}: {e}") from e

    async def close(self) -> None:
        if self.client is not None:
            client, self.client = self.client, None
            await client.close()


class OpenEnvTextEnv:
    """A text OpenEnv env: reset's observation joins the prompt, each sampled turn is one `step`."""

    def __init__(self, cfg: OpenEnvConfig) -> None:
        self.cfg = cfg
        self.session = _Session(cfg)

    async def reset(self, prompt_messages: list[Message], extras: dict[str, Any]) -> list[Message]:
        """Open this trajectory's session and reset it (the row's extra_info.openenv_reset: reset kwargs)."""
        await self.session.open()
        kwargs = dict((extras.get("extra_info") or {}).get("openenv_reset") or {})
        result = await self.session.guarded("reset", self.session.client.reset(**kwargs))
        return with_observation(prompt_messages, observation_text(result.observation, self.cfg.observation_field))

    async def step(self, action_text: str) -> StepResult:
        """The turn's text as the action; the server's reward (None: 0) and done; its observation a user message."""
        result = await self.session.guarded("step", self.session.client.step({self.cfg.action_field: action_text}))
        return _step_result(result, self.cfg, role="user")

    async def aclose(self) -> None:
        """Close the session (the generator calls this however the trajectory ended)."""
        await self.session.close()


class OpenEnvMCPEnv:
    """An MCP OpenEnv env: its listed tools are ours to render, each parsed call one `CallToolAction`."""

    def __init__(self, cfg: OpenEnvConfig) -> None:
        self.cfg = cfg
        self.session = _Session(cfg)
        self.tool_schemas: list[dict] = []
        self.last_reward = 0.0

    async def reset(self, prompt_messages: list[Message], extras: dict[str, Any]) -> list[Message]:
        """Open the session, reset, and list the tools (`ListToolsAction`) as OpenAI function schemas."""
        await self.session.open()
        kwargs = dict((extras.get("extra_info") or {}).get("openenv_reset") or {})
        result = await self.session.guarded("reset", self.session.client.reset(**kwargs))
        listed = await self.session.guarded("list_tools", self.session.client.step({"type": "list_tools"}))
        self.tool_schemas = [_function_schema(t, self.cfg.base_url) for t in (listed.observation or {}).get("tools", [])]
        self.last_reward = 0.0
        return with_observation(prompt_messages, observation_text(result.observation, self.cfg.observation_field))

    async def step(self, action_text: str) -> StepResult:
        """Only reachable when nothing parsed the turn: an answer without calls ends the episode."""
        from skyrl_stepwise.chat.base import ParsedTurn

        return await self.step_turn(ParsedTurn(action_text))

    async def step_turn(self, turn) -> StepResult:
        """Each call -> `CallToolAction` -> a tool message (its result, or the server's tool error as an error
        message); no call -> done with the server's last reward. A call the parser could not read, or whose
        arguments are not a readable JSON object, is answered as our executor answers it and never sent: sent as
        `{}`, a tool without required arguments ran, and the model read a success for a broken call."""
        from skyrl_stepwise.tools.executor import parse_refusal, readable_arguments

        if not turn.tool_calls:
            return StepResult([], self.last_reward, True, {"openenv_answered": 1.0})
        messages, done, errors, invalid = [], False, 0, 0
        for call_id, call in zip(turn.call_ids(), turn.tool_calls):
            name = call.name or ""
            refused = parse_refusal(call)
            arguments, why = (None, refused[1]) if refused else readable_arguments(name, call.arguments)
            if arguments is None:
                invalid += 1
                messages.append({"role": "tool", "tool_call_id": call_id, "name": name, "content": f"Error: {why}"})
                continue
            result = await self.session.guarded(f"call_tool {name!r}", self.session.client.step(
                {"type": "call_tool", "tool_name": name, "arguments": arguments}))
            observation = result.observation or {}
            error = observation.get("error")
            errors += error is not None
            content = f"Error: {error.get('message', error) if isinstance(error, dict) else error}" if error \
                else _tool_result_text(observation.get("result"))
            messages.append({"role": "tool", "tool_call_id": call_id, "name": name, "content": content})
            if result.reward is not None:
                self.last_reward = float(result.reward)
            done = done or bool(result.done)
            if done:
                break
        return StepResult([] if done else messages, self.last_reward if done else 0.0, done,
                          {"openenv_tool_calls": float(len(messages)), "openenv_tool_errors": float(errors),
                           "openenv_invalid_calls": float(invalid)})

    async def aclose(self) -> None:
        """Close the session (the generator calls this however the trajectory ended)."""
        await self.session.close()


def _step_result(result, cfg: OpenEnvConfig, role: str) -> StepResult:
    done = bool(result.done)
    text = observation_text(result.observation, cfg.observation_field)
    reward = float(result.reward) if result.reward is not None else 0.0
    return StepResult([] if done or not text else [{"role": role, "content": text}], reward, done)


def _tool_result_text(result: Any) -> str:
    """An MCP call result as text: FastMCP's CallToolResult-like dicts give their text parts."""
    if isinstance(result, str):
        return result
    if isinstance(result, dict):
        content = result.get("content")
        if isinstance(content, list):
            texts = [c.get("text") for c in content if isinstance(c, dict) and isinstance(c.get("text"), str)]
            if texts:
                return "\n".join(texts)
        if "data" in result and result["data"] is not None:
            return str(result["data"])
    return json.dumps(result, default=str)


def _function_schema(tool: dict, server: str) -> dict:
    """A listed OpenEnv/MCP tool as an OpenAI function schema, validated like ours (a bad one names the server)."""
    from skyrl_stepwise.tools.config import validate_tool_schema

    schema = {"type": "function", "function": {
        "name": tool.get("name"), "description": tool.get("description") or "",
        "parameters": tool.get("input_schema") or tool.get("inputSchema") or {"type": "object", "properties": {}}}}
    validate_tool_schema(schema, f"OpenEnv server {server}: tool {tool.get('name')!r}")
    return schema


def openenv_factory(value: str, key: str):
    """The env factory for an env_classes value naming an OpenEnv server (one env, one session, per trajectory)."""
    cfg = parse_openenv_spec(value, key)
    cls = OpenEnvMCPEnv if cfg.mcp else OpenEnvTextEnv
    if not is_local_url(cfg.base_url):
        return lambda: cls(cfg)
    app, path = parse_local_url(cfg.base_url, key)
    served: list[OpenEnvConfig] = []

    def local_factory():
        """Starts the local server on the first trajectory (not when a config is only checked; envs/openenv_local.py)."""
        if not served or not is_running(app):
            served[:] = [replace(cfg, base_url=local_server_url(app, key) + path)]
        return cls(served[0])

    return local_factory
