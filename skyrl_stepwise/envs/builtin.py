"""The environments a run can name in its rows' `env_class`: the built-ins, the run's own, and installed plugins.

Three sources, one registry (envs/base.py), checked against the data at start-up (before any engine starts):
- built-in: `search` (Search-R1 tags), `tool` (function calling), `keyword` and `key_door` (toys),
  `reasoning_gym` (a reasoning-gym task's own scorer, rows from data/reasoning_gym.py);
- the run's config: `environment.env_classes: {guess: my_pkg.guess:GuessEnv}` (or `my_pkg.guess.GuessEnv`), or an
  OpenEnv server: `{echo: "openenv:http://127.0.0.1:8000"}` (`openenv-mcp:` for an MCP env; envs/openenv.py);
- installed packages: the entry-point group `skyrl_stepwise.envs` (pyproject:
  `[project.entry-points."skyrl_stepwise.envs"] guess = "my_pkg.guess:GuessEnv"`).
A plugin is a class (or a no-argument factory) whose instances implement `Env` or `TurnEnv`; one instance per
trajectory. A plugin cannot take a built-in's name, so a typo cannot silently replace one.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Callable

from skyrl_stepwise.envs.base import EnvRegistry
from skyrl_stepwise.envs.openenv import is_openenv_spec, openenv_factory

BUILTIN_ENVS = ("search", "tool", "keyword", "key_door", "reasoning_gym")
ENTRY_POINT_GROUP = "skyrl_stepwise.envs"
HOW_TO_ADD = ("add one with `+environment.env_classes.NAME=my_pkg.module:MyEnv` (or `environment.env_classes: "
              "{NAME: my_pkg.module:MyEnv}` in a recipe; the module must be importable, e.g. on PYTHONPATH), or "
              f"from an installed package through the entry-point group {ENTRY_POINT_GROUP!r}")


class EnvPluginError(ValueError):
    """An env class that cannot be used: the message names it, where it came from and how to fix it."""


def import_object(path: str, where: str) -> Callable:
    """`pkg.module:Name` or `pkg.module.Name` -> the object, failing with what could not be imported."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise EnvPluginError(f"{where}: {path!r} is not 'pkg.module:Class' (or 'pkg.module.Class')")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise EnvPluginError(f"{where}: cannot import module {module_name!r} for {path!r}: {e}") from None
    obj = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise EnvPluginError(f"{where}: module {module_name!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise EnvPluginError(f"{where}: {path!r} is a {type(obj).__name__}, not an env class or factory")
    return obj


def plugin_envs(env_classes: dict[str, str] | None) -> dict[str, tuple[str, Callable]]:
    """name -> (where it came from, factory) for the config's env_classes and the installed entry points; every
    one imported now, so a broken plugin fails at start-up naming itself."""
    found: dict[str, tuple[str, Callable]] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        found[ep.name] = (f"entry point {ep.name} = {ep.value}", import_object(ep.value, f"entry point {ep.name!r}"))
    for name, path in (env_classes or {}).items():  # the run's config wins over an installed package's name
        key = f"environment.env_classes.{name}"
        if is_openenv_spec(str(path)):  # an OpenEnv server: openenv[-mcp]:http://host:port (envs/openenv.py)
            try:
                found[name] = (key, openenv_factory(str(path), key))
            except ValueError as e:
                raise EnvPluginError(str(e)) from None
            continue
        found[name] = (key, import_object(str(path), key))
    clash = sorted(set(found) & set(BUILTIN_ENVS))
    if clash:
        raise EnvPluginError(f"{found[clash[0]][0]}: {clash[0]!r} is a built-in env class; pick another name "
                             f"(built-ins: {list(BUILTIN_ENVS)})")
    return found


def known_env_classes(environment) -> list[str]:
    """Every env class a run with this `environment` config can use, without building any (no tools, no
    connections): what the data is checked against at start-up."""
    return sorted([*BUILTIN_ENVS, *plugin_envs(getattr(environment, "env_classes", None))])


def check_env_classes(used: list[str], environment, where: str = "data") -> None:
    """Fail at start-up, not at the first rollout, on a row whose env_class nobody registered: the message names
    the unknown classes, what is registered and how to add one."""
    known = set(known_env_classes(environment))
    unknown = sorted({name for name in used if name not in known})
    if unknown:
        raise EnvPluginError(f"{where}: unknown env_class {', '.join(map(repr, unknown))}; registered: "
                             f"{sorted(known)}; {HOW_TO_ADD}")


def build_env_registry(environment) -> EnvRegistry:
    """The built-ins (one shared retrieval client / tool set each) and every plugin env of the run."""
    from skyrl_stepwise.envs.key_door import KeyDoorEnv
    from skyrl_stepwise.envs.reasoning_gym import ReasoningGymEnv
    from skyrl_stepwise.envs.search import register_search_env
    from skyrl_stepwise.envs.tool import register_tool_env
    from skyrl_stepwise.envs.toy import KeywordEnv
    from skyrl_stepwise.sandbox.backends import configure_sandbox

    # the sandbox backend of every sandboxed env/tool built below or per trajectory (a container backend is checked
    # here, at start-up: SandboxUnavailable naming environment.sandbox.backend and why)
    configure_sandbox(getattr(environment, "sandbox", None))
    registry = EnvRegistry()
    register_search_env(registry, environment.search)
    register_tool_env(registry, environment.tool, environment.search.search_url)
    registry.register("keyword", KeywordEnv)
    registry.register("key_door", KeyDoorEnv)
    registry.register("reasoning_gym", ReasoningGymEnv)
    for name, (_, factory) in plugin_envs(getattr(environment, "env_classes", None)).items():
        registry.register(name, factory)
    return registry
