"""The tool contract and how configured specs become tool instances.

A tool is anything with a `name`, an OpenAI `schema` (`{"type": "function", "function": {...}}`) and
`async def call(self, arguments: dict) -> str`. The executor has already validated `arguments` against the
schema's `parameters`, so a tool only checks what a JSON schema cannot express. Each tool runs on its own
event loop, off the rollout's (tools/offloop.py): one that blocks (CPU work, sync I/O) is named in a warning and
then given a thread per call, so it stalls no other trajectory and its timeout holds; it should still hand off
with `asyncio.to_thread`.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any, ClassVar, Protocol, runtime_checkable

from skyrl_stepwise.tools.schema import ToolConfigError, ToolSpecConfig, validate_tool_schema

# Builtin short names for `class_name`; imported lazily so base does not depend on builtin.
BUILTIN_TOOLS: dict[str, str] = {
    "calculator": "skyrl_stepwise.tools.builtin.CalculatorTool",
    "search": "skyrl_stepwise.tools.builtin.SearchTool",
    "python": "skyrl_stepwise.tools.code.PythonTool",  # runs the model's code in a sandbox (skyrl_stepwise/sandbox)
}


class FailedCall(str):
    """Text a tool returns for a call that failed but should reach the model as written (e.g. "Search failed:
    ..."), without the executor's "Error: tool ... failed" wrapping. The executor marks its result not ok
    (error_kind tool_error), so nothing downstream takes it for a real result: a failure message can quote the
    model's own arguments, and the tool env's retrieval reward must not pay for them."""


class ToolUnavailable(RuntimeError):
    """The service behind a tool is gone after its own retries (an MCP server whose connection closed, a retriever
    that stays down): not the call's fault, so the executor does not answer the model with it; it ends the
    trajectory as an infrastructure failure (dropped and counted, never trained on) instead of teaching the model
    from an observation no working system would give."""


def is_retrieval_tool(tool: ToolLike | None) -> bool:
    """Whether a tool's successful results are retrieved text (class attribute `retrieval = True`, e.g. search):
    only those may earn the tool env's intermediate reward, since the answer in them came from outside the model."""
    return getattr(tool, "retrieval", False) is True


@runtime_checkable
class ToolLike(Protocol):
    """What the executor needs; `Tool` below is the convenient base class implementing it."""

    name: str
    schema: dict[str, Any]
    # A dataclass whose fields are the keys the tools YAML may set under `config:` (checked when the file loads,
    # an unknown key named); None: the tool takes no config, so any `config:` key is refused.
    config_class: ClassVar[type | None]

    async def call(self, arguments: dict[str, Any]) -> str:
        """Run the tool on schema-checked arguments; the returned text is the tool message the model sees
        next. Raising is allowed: the executor answers the model with the error instead of crashing the step."""
        ...


class Tool:
    """Base class for tools built from YAML: `Tool(config, tool_schema)` like verl's BaseTool.

    Subclasses set `default_schema` (used when the YAML gives none), `config_class` (a dataclass of the options
    their YAML `config:` may set; `self.cfg` is then an instance of it) and implement `call`."""

    default_schema: dict[str, Any] | None = None
    config_class: ClassVar[type | None] = None
    # True for tools whose results are retrieved text (search, lookup): the tool env's intermediate reward looks
    # for golden answers in their successful results only (see is_retrieval_tool)
    retrieval: ClassVar[bool] = False

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: dict[str, Any] | None = None) -> None:
        schema = tool_schema if tool_schema is not None else self.default_schema
        if schema is None:
            raise ToolConfigError(f"{type(self).__name__}: no tool_schema given and the class has no default_schema")
        validate_tool_schema(schema, f"{type(self).__name__}.tool_schema")
        self.config: dict[str, Any] = dict(config or {})
        self.cfg = check_tool_config(type(self), self.config, type(self).__name__)
        self.schema: dict[str, Any] = schema

    @property
    def name(self) -> str:
        """The function name the model calls; always the schema's, so the two cannot disagree."""
        return self.schema["function"]["name"]

    @property
    def parameters(self) -> dict[str, Any]:
        """The JSON schema the executor validates arguments against (an empty object schema if omitted)."""
        return self.schema["function"].get("parameters", {"type": "object", "properties": {}})

    async def call(self, arguments: dict[str, Any]) -> str:
        """Run the tool on validated arguments; the returned text is what the model reads next."""
        raise NotImplementedError(f"{type(self).__name__}.call")

    async def aclose(self) -> None:
        """Release connections or processes the tool holds; the default holds none."""


def config_from_dict(cls: type, data: dict[str, Any], owner: str) -> Any:
    """Build the dataclass `cls` from a YAML `config` mapping, naming an unknown key instead of a TypeError
    about `__init__`, so a typo like `top_k` is caught when the tools file is loaded."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ToolConfigError(f"{owner}: unknown config key {unknown[0]!r} (allowed: {sorted(names)})")
    return cls(**data)


def check_tool_config(cls: type, config: dict[str, Any], owner: str) -> Any:
    """The tool's typed config from a YAML `config:` mapping: an instance of `cls.config_class`, or None for a tool
    that takes none. Any key the class does not declare is refused, naming it, so a typo never trains silently
    with a default."""
    config_cls = getattr(cls, "config_class", None)
    if config_cls is None:
        if config:
            raise ToolConfigError(f"{owner}: unknown config key(s) {sorted(config)}: {cls.__name__} declares no "
                                  "`config_class`, so it takes no config; give the class `config_class = <a "
                                  "dataclass>` whose fields are the keys it accepts")
        return None
    if not dataclasses.is_dataclass(config_cls):
        raise ToolConfigError(f"{owner}: {cls.__name__}.config_class must be a dataclass, got {config_cls!r}")
    return config_from_dict(config_cls, dict(config), owner)


def resolve_tool_class(class_name: str) -> type:
    """A builtin short name ("search", "calculator") or a dotted "pkg.module.Class" -> the class object."""
    path = BUILTIN_TOOLS.get(class_name, class_name)
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ToolConfigError(f"class_name {class_name!r} is neither a builtin tool ({sorted(BUILTIN_TOOLS)}) "
                              "nor a dotted path 'pkg.module.Class'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ToolConfigError(f"class_name {class_name!r}: cannot import module {module_name!r}: {e}") from None
    try:
        cls = getattr(module, attr)
    except AttributeError:
        raise ToolConfigError(f"class_name {class_name!r}: module {module_name!r} has no attribute {attr!r}") from None
    if not inspect.isclass(cls):
        raise ToolConfigError(f"class_name {class_name!r} is not a class but {type(cls).__name__}")
    return cls


def check_tool_spec(spec: ToolSpecConfig, index: int = 0) -> type:
    """The spec's class, importable, with its `config:` keys checked against the class's typed config, without
    building the tool (no connections): what a run checks at start-up, before any engine starts."""
    where = f"{spec.source}: tools[{index}] (class_name {spec.class_name!r})"
    try:
        cls = resolve_tool_class(spec.class_name)
    except ToolConfigError as e:
        raise ToolConfigError(f"{where}: {e}") from None
    try:
        check_tool_config(cls, spec.config, f"{where}.config")
    except (TypeError, ValueError) as e:  # a config class's own checks (__post_init__) do not know the file
        raise ToolConfigError(str(e) if str(e).startswith(where) else f"{where}.config: {e}") from None
    return cls


def build_tool(spec: ToolSpecConfig, index: int = 0) -> ToolLike:
    """Instantiate one spec as `cls(config=..., tool_schema=...)` and check it honours the tool contract."""
    where = f"{spec.source}: tools[{index}] (class_name {spec.class_name!r})"
    cls = check_tool_spec(spec, index)
    try:
        tool = cls(config=dict(spec.config), tool_schema=spec.tool_schema)
    except ToolConfigError as e:
        raise ToolConfigError(f"{where}.config: {e}") from None
    except (TypeError, ValueError) as e:
        raise ToolConfigError(f"{where}: constructing {cls.__name__} failed: {type(e).__name__}: {e}") from None
    if not inspect.iscoroutinefunction(getattr(tool, "call", None)):
        raise ToolConfigError(f"{where}: {cls.__name__}.call must be `async def call(self, arguments) -> str`")
    if getattr(tool, "name", None) != spec.name:
        raise ToolConfigError(f"{where}: the tool calls itself {getattr(tool, 'name', None)!r} but its "
                              f"tool_schema names it {spec.name!r}")
    if not isinstance(getattr(tool, "schema", None), dict):
        raise ToolConfigError(f"{where}: {cls.__name__} has no `schema` dict")
    return tool


def build_tools(specs: list[ToolSpecConfig]) -> dict[str, ToolLike]:
    """Name -> tool for the executor; names are unique (checked again here for specs built in code)."""
    tools: dict[str, ToolLike] = {}
    for i, spec in enumerate(specs):
        if spec.name in tools:
            raise ToolConfigError(f"{spec.source}: tools[{i}]: duplicate tool name {spec.name!r}")
        tools[spec.name] = build_tool(spec, i)
    return tools


def tool_schemas(tools: dict[str, ToolLike]) -> list[dict[str, Any]]:
    """The schemas in a stable order, for the renderer's `tools=` argument (what the chat template shows)."""
    return [tools[name].schema for name in tools]


async def close_tools(tools: dict[str, ToolLike]) -> None:
    """Close every tool that has an `aclose` (pooled HTTP clients), e.g. at the end of training."""
    for tool in tools.values():
        close = getattr(tool, "aclose", None)
        if close is not None:
            await close()
