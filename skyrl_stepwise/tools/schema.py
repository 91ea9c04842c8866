"""A configured tool's spec and the checks of its OpenAI function schema: shared by the YAML reader (config.py) and
the tools an MCP server lists (mcp.py), so both are held to the same rules and neither imports the other."""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from jsonschema.validators import validator_for
from jsonschema_specifications import REGISTRY as METASCHEMAS
from referencing import Registry
from referencing.exceptions import Unresolvable
from referencing.jsonschema import DRAFT202012, specification_with

# OpenAI's rule for function names; chat templates and tool parsers rely on it too.
TOOL_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
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
        validator_class(parameters).check_schema(parameters)
    except SchemaError as e:
        path = "".join(f"[{p!r}]" if isinstance(p, int) else f".{p}" for p in e.path)
        raise ToolConfigError(f"{where}.function.parameters{path}: not a valid JSON schema: {e.message}") from None
    check_refs(parameters, f"{where}.function.parameters")
    check_satisfiable(parameters, f"{where}.function.parameters")


# Keywords whose values are data (argument values), not subschemas: a "$ref" key inside them is not a reference.
DATA_KEYWORDS = {"enum", "const", "default", "examples"}


def check_refs(schema: dict, where: str) -> None:
    """Refuse a `$ref` that does not resolve within the schema itself (`#/$defs/Missing`, a typo) or points
    elsewhere (`https://...`, nothing is fetched): valid JSON schema, but checking a call's arguments would have to
    follow it, so every call would fail on our side instead of reaching the tool."""
    spec = specification_with(schema.get("$schema", ""), default=DRAFT202012) \
        if isinstance(schema.get("$schema", ""), str) else DRAFT202012
    root = spec.create_resource(schema)
    resolver = Registry().with_resource(root.id() or "", root).combine(METASCHEMAS).resolver(root.id() or "")

    def walk(node: Any, path: str, resolver) -> None:
        if isinstance(node, list):
            for i, item in enumerate(node):
                walk(item, f"{path}[{i}]", resolver)
            return
        if not isinstance(node, dict):
            return
        if node is not schema and isinstance(node.get("$id"), str):
            resolver = resolver.in_subresource(spec.create_resource(node))
        ref = node.get("$ref")
        if isinstance(ref, str):
            try:
                resolver.lookup(ref)
            except Unresolvable as e:
                raise ToolConfigError(f"{where}{path}.$ref: {ref!r} does not resolve within the schema "
                                      f"({type(e).__name__}); only references into the schema itself "
                                      f"(e.g. '#/$defs/Name') are followed, nothing is fetched") from None
        for key, value in node.items():
            if key not in DATA_KEYWORDS:
                walk(value, f"{path}.{key}", resolver)

    walk(schema, "", resolver)


def validator_class(parameters: dict):
    """The validator for the draft the schema names in `$schema` (a draft-07 schema's `items: [...]` is a tuple, not
    an error), 2020-12 when it names none or one jsonschema does not know."""
    with warnings.catch_warnings():  # an unknown `$schema` warns, then falls back to the default
        warnings.simplefilter("ignore")
        return validator_for(parameters, default=Draft202012Validator)


def check_satisfiable(schema: dict, where: str) -> None:
    """Refuse an object schema that requires a property it does not declare: valid JSON schema, but almost always a
    typo (`required: [querry]`), and with `additionalProperties: false` no call could ever pass, so every call
    would come back as an error while the run trains on. Nested object schemas are checked too, and the ones
    under `$defs`/`definitions` that a `$ref` names."""
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
    for defs in ("$defs", "definitions"):  # the models a `$ref` names (pydantic puts nested models there)
        for name, sub in (schema.get(defs) or {}).items() if isinstance(schema.get(defs), dict) else ():
            if isinstance(sub, dict):
                check_satisfiable(sub, f"{where}.{defs}.{name}")
