"""Tool specs as YAML, the way verl's multi-turn docs configure them:

    tools:
      - class_name: calculator                # builtin short name, or a dotted path "pkg.module.Class"
        config: {max_exponent: 100}            # passed to the tool's constructor
        tool_schema:                           # the OpenAI function schema the model is shown
          type: function
          function: {name: calculator, description: ..., parameters: {type: object, properties: ...}}
      - mcp_server: {command: [python, my_server.py]}   # every tool an MCP server lists (tools/mcp.py)

Everything is checked at load time, before a single rollout, so a typo in a schema fails with the file, the
tool index and the key instead of a model that silently never gets its arguments validated.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from skyrl_stepwise.tools.schema import (FUNCTION_KEYS, SCHEMA_KEYS, TOOL_NAME_RE, ToolConfigError, ToolSpecConfig,
                                        check_satisfiable, validate_tool_schema)

SPEC_KEYS = {"class_name", "config", "tool_schema"}
__all__ = ["FUNCTION_KEYS", "SCHEMA_KEYS", "SPEC_KEYS", "TOOL_NAME_RE", "ToolConfigError", "ToolSpecConfig",
           "check_satisfiable", "load_tools_yaml", "parse_tool_specs", "validate_tool_schema"]

if TYPE_CHECKING:
    from skyrl_stepwise.tools.base import ToolLike


def _to_container(data: Any) -> Any:
    """Plain dicts/lists from an OmegaConf node, so a tools list embedded in a Hydra config works too."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf ships with the project
        return data
    if isinstance(data, (DictConfig, ListConfig)):
        return OmegaConf.to_container(data, resolve=True)
    return data


def parse_tool_specs(data: Any, source: str = "<dict>") -> list[ToolSpecConfig]:
    """Validate `{"tools": [...]}` (already parsed YAML/JSON/OmegaConf) into specs; `source` names the origin.

    Separate from the file reader so a tools list embedded in a larger config is checked the same way."""
    data = _to_container(data)
    if not isinstance(data, dict) or "tools" not in data:
        raise ToolConfigError(f"{source}: expected a mapping with a top-level 'tools' list")
    unknown = sorted(set(data) - {"tools"})
    if unknown:
        raise ToolConfigError(f"{source}: unknown top-level key {unknown[0]!r} (only 'tools' is read)")
    entries = data["tools"]
    if not isinstance(entries, list) or not entries:
        raise ToolConfigError(f"{source}: 'tools' must be a non-empty list, got {entries!r:.80}")
    specs: list[ToolSpecConfig] = []
    seen: dict[str, int] = {}
    for i, entry in enumerate(entries):
        where = f"{source}: tools[{i}]"
        if not isinstance(entry, dict):
            raise ToolConfigError(f"{where}: must be a mapping with class_name/config/tool_schema, "
                                  f"got {type(entry).__name__}")
        if "mcp_server" in entry:  # tools listed by an MCP server (tools/mcp.py)
            if set(entry) != {"mcp_server"}:
                raise ToolConfigError(f"{where}: an mcp_server entry takes no other key, got {sorted(set(entry))}")
            from skyrl_stepwise.tools.mcp import mcp_tool_specs

            for spec in mcp_tool_specs(entry["mcp_server"], where, source):
                if spec.name in seen:
                    raise ToolConfigError(f"{where}.mcp_server: tool name {spec.name!r} clashes with tools"
                                          f"[{seen[spec.name]}]; set mcp_server.prefix or mcp_server.tools")
                seen[spec.name] = i
                specs.append(spec)
            continue
        unknown = sorted(set(entry) - SPEC_KEYS)
        if unknown:
            raise ToolConfigError(f"{where}: unknown key {unknown[0]!r} (allowed: {sorted(SPEC_KEYS)})")
        class_name = entry.get("class_name")
        if not isinstance(class_name, str) or not class_name.strip():
            raise ToolConfigError(f"{where}.class_name: must be a builtin name or 'pkg.module.Class', "
                                  f"got {class_name!r}")
        config = entry.get("config") or {}
        if not isinstance(config, dict):
            raise ToolConfigError(f"{where}.config: must be a mapping, got {type(config).__name__}")
        if "tool_schema" not in entry:
            raise ToolConfigError(f"{where}: missing key 'tool_schema'")
        validate_tool_schema(entry["tool_schema"], f"{where}.tool_schema")
        name = entry["tool_schema"]["function"]["name"]
        if name in seen:
            raise ToolConfigError(f"{where}.tool_schema.function.name: duplicate tool name {name!r} "
                                  f"(already used by tools[{seen[name]}])")
        seen[name] = i
        specs.append(ToolSpecConfig(class_name.strip(), dict(config), entry["tool_schema"], source=source))
    return specs


def load_tools_yaml(path: str | Path) -> list[ToolSpecConfig]:
    """Read and validate a tools YAML file; fails before training starts on any bad spec."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ToolConfigError(f"{path}: cannot read tools file: {e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ToolConfigError(yaml_error_message(path, e)) from None
    return parse_tool_specs(data, str(path))


def yaml_error_message(path: str | Path, error: yaml.YAMLError) -> str:
    """`file:line:column: problem` (1-based, as editors count) for a YAML syntax error, and the offending line."""
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    problem = " ".join(str(p) for p in (getattr(error, "context", None), getattr(error, "problem", None)) if p) \
        or str(error)
    if mark is None:
        return f"{path}: invalid YAML: {problem}"
    lines = (mark.buffer or "").splitlines() if getattr(mark, "buffer", None) else []
    shown = f"\n  {lines[mark.line]}\n  {' ' * mark.column}^" if mark.line < len(lines) else ""
    return f"{path}:{mark.line + 1}:{mark.column + 1}: invalid YAML: {problem}{shown}"


def load_tools(path: str | Path) -> dict[str, ToolLike]:
    """Read, validate and instantiate a tools YAML file in one step (what a recipe usually wants)."""
    from skyrl_stepwise.tools.base import build_tools

    return build_tools(load_tools_yaml(path))


def configured_tool_schemas(tools_path: str | Path | None) -> list[dict[str, Any]]:
    """The schemas the `tool` env shows the model for `environment.tool.tools_path` (None: the built-in search and
    calculator), without building any tool: what SFT prompts and rollout logs need to match RL prompts."""
    from skyrl_stepwise.tools.base import resolve_tool_class

    if tools_path is None:
        return [resolve_tool_class("search").default_schema, resolve_tool_class("calculator").default_schema]
    return [spec.tool_schema for spec in load_tools_yaml(tools_path)]
