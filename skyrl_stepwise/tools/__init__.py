"""OpenAI function-schema tools for tool-calling agents: YAML specs (verl's format), builtin tools, and an
executor that answers every parsed call of a turn, concurrently, without ever raising.

    specs = load_tools_yaml("conf/tools/search_calculator.yaml")
    executor = ToolExecutor(build_tools(specs), timeout_s=30, max_calls_per_turn=8)
    results = await executor.execute(parsed_turn.tool_calls)
    history += to_messages(results)
"""

from skyrl_stepwise.tools.base import (BUILTIN_TOOLS, FailedCall, Tool, ToolLike, ToolUnavailable, build_tool,
                                       build_tools, close_tools, is_retrieval_tool, resolve_tool_class, tool_schemas)
from skyrl_stepwise.tools.config import ToolConfigError, ToolSpecConfig, load_tools, load_tools_yaml, parse_tool_specs
from skyrl_stepwise.tools.executor import ToolExecutor, ToolResult, to_messages

__all__ = ["BUILTIN_TOOLS", "FailedCall", "Tool", "ToolConfigError", "ToolExecutor", "ToolLike", "ToolResult",
           "ToolSpecConfig", "ToolUnavailable", "build_tool", "build_tools", "close_tools", "is_retrieval_tool",
           "load_tools", "load_tools_yaml", "parse_tool_specs", "resolve_tool_class", "to_messages", "tool_schemas"]
