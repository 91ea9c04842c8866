"""Tools from an MCP server, through the `mcp` SDK's own client: a tools YAML entry names the server, its listed
tools become tool schemas shown in the model's own template, and calls go through one client session per server.

    tools:
      - mcp_server:
          command: [python, my_server.py]      # a stdio server the run starts (or url: http://host:port/mcp)
          tools: [add, lookup]                 # optional: only these of the listed tools
          prefix: ""                           # optional: prepended to each name, to avoid a clash
          call_timeout_s: 60                   # the SDK's read timeout; the tool env's timeout_s applies too
          connect_timeout_s: 30                # the handshake, and the tools/list answer at start-up

The listing happens when the tools file is loaded (start-up): an unreachable server, a tool whose input schema we
cannot satisfy or a name clash fails then, naming the file and the entry. At run time an error the server
reports (`isError`, a JSON-RPC error, a timeout) answers that call as a tool error, never as a result; a server
whose connection closes raises ToolUnavailable, which ends that trajectory (counted, not trained), and the next
call starts a new connection.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import re
import sys
from dataclasses import dataclass, field
from typing import Any

from skyrl_stepwise.tools.base import FailedCall, Tool, ToolUnavailable, config_from_dict
from skyrl_stepwise.tools.schema import ToolConfigError, ToolSpecConfig, validate_tool_schema

MCP_TOOL_CLASS = "skyrl_stepwise.tools.mcp.MCPTool"


@dataclass
class MCPServerConfig:
    """How to reach one MCP server (exactly one of `command`, `url`) and which of its tools to use."""

    command: list[str] | None = None
    url: str | None = None
    env: dict[str, str] | None = None
    cwd: str | None = None
    tools: list[str] | None = None
    prefix: str = ""
    connect_timeout_s: float = 30.0
    call_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if (self.command is None) == (self.url is None):
            raise ValueError("give exactly one of `command` (a stdio server: [program, args...]) or `url`")
        if self.command is not None and (not isinstance(self.command, list) or not self.command
                                         or not all(isinstance(c, str) for c in self.command)):
            raise ValueError(f"`command` must be a non-empty list of strings, got {self.command!r}")

    def key(self) -> str:
        """Identifies the server: tools of one server share its connection."""
        return json.dumps({"command": self.command, "url": self.url, "env": self.env, "cwd": self.cwd},
                          sort_keys=True)

    def describe(self) -> str:
        return self.url or " ".join(self.command or [])


@dataclass
class MCPToolConfig:
    """What one MCPTool is built from (written by the loader, not by hand): its server and its MCP name."""

    server: dict[str, Any] = field(default_factory=dict)
    tool: str = ""


PYTHON_NAMES = re.compile(r"^python(3(\.\d+)?)?$")


def server_command(command: list[str]) -> list[str]:
    """A stdio server's command, its `python` resolved to the run's own interpreter: the host's `python` on PATH
    usually lacks the `mcp` package (the server then dies at its import, before the handshake). A path to another
    interpreter is kept as written."""
    if command and PYTHON_NAMES.match(command[0]):
        return [sys.executable, *command[1:]]
    return list(command)


def _transport(cfg: MCPServerConfig):
    """The SDK's transport for `cfg`: a URL is streamable HTTP, a command a stdio server whose stderr goes to the
    run's log (a traceback per failing call would otherwise flood the console)."""
    if cfg.url is not None:
        return cfg.url
    from mcp.client.stdio import StdioServerParameters, get_default_environment, stdio_client

    from skyrl_stepwise.host.logs import active_run_log

    command = server_command(cfg.command)
    params = StdioServerParameters(command=command[0], args=command[1:], cwd=cfg.cwd,
                                   env={**get_default_environment(), **(cfg.env or {})} if cfg.env else None)
    log = active_run_log()
    errlog = open(log, "a", encoding="utf-8") if log is not None else sys.stderr  # noqa: SIM115 - lives with the server
    return stdio_client(params, errlog=errlog)


# mcp 2.x's MCPServer answers any exception but ToolError with only "Error executing tool <name>" (the text stays in
# the server's log): the model then reads no reason at all
_WITHHELD = re.compile(r"^Error executing tool [\w.-]+$")
_warned_withheld: set[tuple[str, str]] = set()


def warn_withheld_message(server: str, tool: str, text: str) -> None:
    """Once per server and tool: say on the console that the model read an error without its reason, and how the
    server passes one on (raise ToolError), since nothing in the trajectory shows the reason was withheld."""
    if not _WITHHELD.match(text.strip()) or (server, tool) in _warned_withheld:
        return
    _warned_withheld.add((server, tool))
    logging.getLogger(__name__).warning(
        f"MCP tool {tool!r} of {server!r} failed and the model read only {text.strip()!r}: mcp 2.x servers withhold "
        "an exception's text unless the tool raises mcp.server.mcpserver.exceptions.ToolError(message) "
        "(examples/mcp_server/my_mcp_server.py); the server's stderr (run.log) has the traceback")


def _result_text(result) -> str:
    """An MCP tool result as the text of a tool message: its text parts (an embedded text resource's text too);
    other parts named by type (and URI), so the model knows something came back that it cannot see."""
    parts = []
    for item in result.content or []:
        resource = getattr(item, "resource", None)  # an embedded resource: its text, if it is a text resource
        text = getattr(item, "text", getattr(resource, "text", None))
        uri = getattr(item, "uri", None) or getattr(resource, "uri", None)
        parts.append(text if isinstance(text, str) else
                     f"[{getattr(item, 'type', 'non-text')} content{f': {uri}' if uri else ''}]")
    if not parts and getattr(result, "structured_content", None) is not None:
        parts.append(json.dumps(result.structured_content))
    return "\n".join(parts)


def _connection_closed(error: BaseException) -> bool:
    from mcp.shared.exceptions import MCPError
    from mcp_types.jsonrpc import CONNECTION_CLOSED

    return isinstance(error, MCPError) and error.code == CONNECTION_CLOSED


class MCPConnection:
    """One client session to one server, opened on first use in the running event loop and held by a background
    task (the SDK's transports must be entered and exited in one task)."""

    def __init__(self, cfg: MCPServerConfig) -> None:
        self.cfg = cfg
        self._client = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock: asyncio.Lock | None = None
        self._stop: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    async def client(self):
        """The open client, connecting first if needed; a server that cannot be reached raises ToolUnavailable."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # a new event loop (a new asyncio.run): the old session is unusable there
            self._loop, self._lock, self._client, self._task = loop, asyncio.Lock(), None, None
        async with self._lock:
            if self._client is None:
                ready: asyncio.Future = loop.create_future()
                self._stop = asyncio.Event()
                self._task = loop.create_task(self._hold(ready, self._stop))
                try:
                    self._client = await asyncio.wait_for(asyncio.shield(ready), self.cfg.connect_timeout_s)
                except Exception as e:
                    self._stop.set()
                    self._task.cancel()  # still in the handshake: a server that never answers would hold it forever
                    why = (f"no connection within connect_timeout_s={self.cfg.connect_timeout_s:g} s"
                           if isinstance(e, asyncio.TimeoutError) else f"{type(e).__name__}: {e}")
                    raise ToolUnavailable(f"MCP server {self.cfg.describe()!r} is unreachable: {why}") from e
        return self._client

    async def _hold(self, ready: asyncio.Future, stop: asyncio.Event) -> None:
        from mcp import Client

        try:
            async with Client(_transport(self.cfg)) as client:
                ready.set_result(client)
                await stop.wait()
        except BaseException as e:  # noqa: BLE001 - reported to whoever waits for the connection
            if not ready.done():  # cancelled: the connect timed out, and nobody waits for `ready` any more
                if isinstance(e, asyncio.CancelledError):
                    ready.cancel()
                else:
                    ready.set_exception(e if isinstance(e, Exception) else RuntimeError(repr(e)))
        finally:
            if self._client is not None and ready.done() and not ready.cancelled() \
                    and ready.exception() is None and self._client is ready.result():
                self._client = None

    async def call(self, name: str, arguments: dict[str, Any]) -> str:
        """Call one tool: its text, FailedCall for an error the server reports, ToolUnavailable if the connection
        closed (the next call reconnects); other SDK errors (a timeout) propagate as the call's tool error."""
        client = await self.client()
        try:
            result = await client.call_tool(name, arguments, read_timeout_seconds=self.cfg.call_timeout_s)
        except Exception as e:
            if _connection_closed(e):
                self._forget(client)
                raise ToolUnavailable(f"MCP server {self.cfg.describe()!r} closed the connection during "
                                      f"{name!r}") from e
            raise
        text = _result_text(result)
        if result.is_error:
            warn_withheld_message(self.cfg.describe(), name, text)
            return FailedCall(f"Error: tool {name!r} failed: {text or '(the server gave no message)'}")
        return text

    def _forget(self, client) -> None:
        if self._client is client:
            self._client = None
            if self._stop is not None:
                self._stop.set()

    async def list_tools(self) -> list:
        """Every tool the server lists, following pagination."""
        client = await self.client()
        tools, cursor = [], None
        while True:
            page = await client.list_tools(cursor=cursor)
            tools.extend(page.tools)
            cursor = getattr(page, "next_cursor", None)
            if not cursor:
                return tools

    async def aclose(self) -> None:
        """Close the session (and stop a stdio server); safe to call twice or from another loop's leftovers."""
        if self._stop is not None:
            self._stop.set()
        task, self._task, self._client = self._task, None, None
        if task is not None and not task.done() and task.get_loop() is asyncio.get_running_loop():
            await asyncio.gather(task, return_exceptions=True)


_connections: dict[str, MCPConnection] = {}
_listings: dict[str, list[tuple[str, str, dict]]] = {}


def connection_for(cfg: MCPServerConfig) -> MCPConnection:
    """The one connection per server this process uses, so every tool of it shares a session."""
    return _connections.setdefault(cfg.key(), MCPConnection(cfg))


def _run_isolated(coro_fn):
    """Run an async function to completion on a fresh loop in a worker thread: the tools file is loaded both from
    plain code and from inside the trainer's running loop, where `asyncio.run` is not allowed."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro_fn()).result()


def _listing(cfg: MCPServerConfig) -> list[tuple[str, str, dict]]:
    """(name, description, input schema) of every tool the server lists; listed once per process."""
    if cfg.key() not in _listings:
        async def list_once():
            connection = MCPConnection(cfg)
            try:
                await connection.client()  # its own connect_timeout_s
                try:  # a server that connects but never answers tools/list must not hang the start-up
                    listed = await asyncio.wait_for(connection.list_tools(), cfg.connect_timeout_s)
                except asyncio.TimeoutError:
                    raise RuntimeError(f"no answer to tools/list within connect_timeout_s="
                                       f"{cfg.connect_timeout_s:g} s") from None
                return [(t.name, t.description or "", dict(t.input_schema)) for t in listed]
            finally:
                await connection.aclose()

        _listings[cfg.key()] = _run_isolated(list_once)
    return _listings[cfg.key()]


def mcp_tool_specs(entry: Any, where: str, source: str) -> list[ToolSpecConfig]:
    """A tools-YAML `mcp_server:` entry -> one spec per tool the server lists (or per name in `tools:`), each an
    OpenAI function schema validated like a hand-written one; any failure names `where` and the server."""
    if not isinstance(entry, dict):
        raise ToolConfigError(f"{where}.mcp_server: must be a mapping with command or url, got {type(entry).__name__}")
    try:
        cfg = config_from_dict(MCPServerConfig, dict(entry), f"{where}.mcp_server")
    except (TypeError, ValueError) as e:
        raise ToolConfigError(str(e) if str(e).startswith(where) else f"{where}.mcp_server: {e}") from None
    try:
        listed = _listing(cfg)
    except Exception as e:  # noqa: BLE001 - any reason the server cannot list its tools is a start-up error
        cause = e.__cause__ or e
        why = str(e) if isinstance(e, ToolUnavailable) else f"{type(cause).__name__}: {cause}"  # names the server
        raise ToolConfigError(f"{where}.mcp_server: cannot list the tools of MCP server {cfg.describe()!r}: "
                              f"{why}") from None
    by_name = {name: (description, schema) for name, description, schema in listed}
    wanted = cfg.tools if cfg.tools is not None else list(by_name)
    missing = [n for n in wanted if n not in by_name]
    if missing:
        raise ToolConfigError(f"{where}.mcp_server.tools: {missing} not listed by MCP server {cfg.describe()!r} "
                              f"(it lists {sorted(by_name)})")
    specs, refused = [], []
    for name in wanted:
        description, parameters = by_name[name]
        schema = {"type": "function", "function": {"name": cfg.prefix + name, "description": description,
                                                   "parameters": parameters or {"type": "object", "properties": {}}}}
        try:
            validate_tool_schema(schema, f"{where}.mcp_server tool {name!r} of {cfg.describe()!r}")
        except ToolConfigError as e:
            refused.append(str(e))
            continue
        specs.append(ToolSpecConfig(MCP_TOOL_CLASS, {"server": dict(entry), "tool": name}, schema, source=source))
    if refused and cfg.tools is not None:
        raise ToolConfigError(refused[0])
    if refused:  # all of a server's tools were asked for: name every one we cannot offer, and the way out
        usable = [spec.config["tool"] for spec in specs]
        raise ToolConfigError(f"{'; '.join(refused)}. The server lists {len(refused)} tool(s) whose schema no call "
                              f"could satisfy; name the tools to offer in {where}.mcp_server.tools (usable: {usable})")
    return specs


class MCPTool(Tool):
    """One tool of an MCP server; the schema is the server's listing, calls go through the shared session."""

    config_class = MCPToolConfig

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: dict[str, Any] | None = None) -> None:
        super().__init__(config, tool_schema)
        self.server = config_from_dict(MCPServerConfig, dict(self.cfg.server), f"MCP tool {self.cfg.tool!r}")

    async def call(self, arguments: dict[str, Any]) -> str:
        """Through the server's session (see MCPConnection.call for what each failure becomes)."""
        return await connection_for(self.server).call(self.cfg.tool, arguments)

    async def aclose(self) -> None:
        """Close the server's session (shared: the first tool closing it closes it for all)."""
        await connection_for(self.server).aclose()
