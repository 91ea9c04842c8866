"""The environments a run can name in its rows' `env_class`, registered from the run's config."""

from __future__ import annotations

from skyrl_stepwise.envs.base import EnvRegistry
from skyrl_stepwise.envs.key_door import KeyDoorEnv
from skyrl_stepwise.envs.search import register_search_env
from skyrl_stepwise.envs.tool import register_tool_env
from skyrl_stepwise.envs.toy import KeywordEnv


def build_env_registry(environment) -> EnvRegistry:
    """search (Search-R1 tags), tool (function calling), keyword and key_door (toys); one shared client/tool set
    each."""
    registry = EnvRegistry()
    register_search_env(registry, environment.search)
    register_tool_env(registry, environment.tool, environment.search.search_url)
    registry.register("keyword", KeywordEnv)
    registry.register("key_door", KeyDoorEnv)
    return registry
