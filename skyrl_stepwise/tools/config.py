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

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

# OpenAI's rule for function names; chat templates and tool parsers rely on it too.
TOOL_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
SPEC_KEYS = {"class_name", "config", "tool_schema"}
SCHEMA_KEYS = {"type", "function"}
FUNCTION_KEYS = {"name", "description", "parameters", "strict"}


class ToolConfigError(ValueError):
    """A tool spec that cannot be used; the message names the file, the tool index and the bad key."""


@dataclass
class ToolSpecConfig:
    """One configured tool: which class builds it, its constructor config and the schema the model sees.
    `source` (the YAML file, for error messages) is not part of the spec itself."""

    class_name: str
    config: dict[str, Any] = field(default_factory=dict)
    tool_schema: dict[str, Any] = field(default_factory=dict)
    source: str = field(default="<dict>", compare=False, repr=False)

    @property
    def name(self) -> str:
        """The function name the model calls this tool by."""
        return self.tool_schema["function"]["name"]


def _to_container(data: Any) -> Any:
    """Plain dicts/lists from an OmegaConf node, so a tools list embedded in a Hydra config works too."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf ships with the project
        return data
    if isinstance(data, (DictConfig, ListConfig)):
        return OmegaConf.to_container(data, resolve=True)
    return data


def validate_tool_schema(schema: Any, where: str) -> None:
    """Check one OpenAI function schema; `where` (e.g. "tools.yaml: tools[0].tool_schema") prefixes errors.

    Parameters must be a valid JSON schema of type object: the executor validates every call against it, and a
    broken schema would otherwise surface as a confusing error on the first rollout."""
    if not isinstance(schema, dict):
        raise ToolConfigError(f"{where}: must be a mapping, got {type(schema).__name__}")
    unknown = sorted(set(schema) - SCHEMA_KEYS)
    if unknown:
        raise ToolConfigError(f"{where}: unknown key {unknown[0]!r} (allowed: {sorted(SCHEMA_KEYS)})")
    if schema.get("type") != "function":
        raise ToolConfigError(f"{where}.type: must be 'function', got {schema.get('type')!r}")
    function = schema.get("function")
    if not isinstance(function, dict):
        raise ToolConfigError(f"{where}.function: must be a mapping with name/description/parameters, "
                              f"got {type(function).__name__}")
    unknown = sorted(set(function) - FUNCTION_KEYS)
    if unknown:
        raise ToolConfigError(f"{where}.function: unknown key {unknown[0]!r} (allowed: {sorted(FUNCTION_KEYS)})")
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME_RE.match(name):
        raise ToolConfigError(f"{where}.function.name: must be 1-64 characters of [A-Za-z0-9_-], got {name!r}")
    description = function.get("description", "")
    if not isinstance(description, str):
        raise ToolConfigError(f"{where}.function.description: must be a string, got {type(description).__name__}")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise ToolConfigError(f"{where}.function.parameters: must be a JSON schema mapping, "
                              f"got {type(parameters).__name__}")
    if parameters.get("type") != "object":
        raise ToolConfigError(f"{where}.function.parameters.type: must be 'object' (arguments are a JSON object), "
                              f"got {parameters.get('type')!r}")
    try:
        Draft202012Validator.check_schema(parameters)
    except SchemaError as e:
        path = "".join(f"[{p!r}]" if isinstance(p, int) else f".{p}" for p in e.path)
        raise ToolConfigError(f"{where}.function.parameters{path}: not a valid JSON schema: {e.message}") from None
    check_satisfiable(parameters, f"{where}.function.parameters")


def check_satisfiable(schema: dict, where: str) -> None:
    """Refuse an object schema that requires a property it does not declare: valid JSON schema, but almost always a
    typo (`required: [querry]`), and with `additionalProperties: false` no call could ever pass, so every call
    would come back as an error while the run trains on. Nested object schemas are checked too."""
    properties = schema.get("properties")
    required = schema.get("required") or []
    if schema.get("type") == "object" and isinstance(required, list):
        declared = set(properties or {})
        missing = [r for r in required if r not in declared]
        if missing:
            raise ToolConfigError(f"{where}.required: {missing} not among the declared properties "
                                  f"{sorted(declared)}; a call would have to pass an undeclared argument")
    for name, sub in (properties or {}).items():
        if isinstance(sub, dict):
            check_satisfiable(sub, f"{where}.properties.{name}")
    if isinstance(schema.get("items"), dict):
        check_satisfiable(schema["items"], f"{where}.items")


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
