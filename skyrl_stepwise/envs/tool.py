"""A generic tool-calling environment (env class "tool"): the model calls OpenAI function-schema tools until it
answers without a call; the answer is graded against the row's reward_spec.

The env never sees text it has to parse: the generator hands it the turn as the model's renderer parsed it from
the sampled ids (`step_turn`), so the calls executed are exactly the calls sampled. Every call of a turn runs
concurrently; malformed ones are answered with an error the model can read (see tools/executor.py) and counted.
Tools come from a YAML file (verl's format) or the built-in search + calculator; a row can narrow them with
`extra_info.tools: [names]`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from skyrl_stepwise.chat.base import ParsedTurn
from skyrl_stepwise.envs.base import EnvRegistry, Message, StepResult
from skyrl_stepwise.envs.rewards import exact_match_score, last_answer, subem_check
from skyrl_stepwise.envs.search import ground_truth_targets, intermediate_retrieval_reward
from skyrl_stepwise.tools import ToolExecutor, ToolResult, build_tools, load_tools_yaml, to_messages
from skyrl_stepwise.tools.base import ToolLike, is_retrieval_tool
from skyrl_stepwise.tools.builtin import CalculatorTool, SearchTool
from skyrl_stepwise.tools.executor import run_turn_calls


@dataclass
class ToolEnvConfig:
    """Which tools, how long each call may take, and the system prompt that tells the model it has tools."""

    tools_path: str | None = None  # a verl-style tools YAML; None: the built-in search + calculator
    timeout_s: float = 30.0  # seconds one tool call may take; past it the model reads a timeout error
    max_calls_per_turn: int = 8  # calls run per turn; the model reads an error for each one past it
    # Replaces the row's system message (or is added): e.g. how to answer; None keeps the row's prompt.
    system_prompt: str | None = None
    # Replaces the row's first user message's instructions by just the question (extra_info.question), for rows
    # written for tag-based agents (Search-R1's `<search>` instructions contradict function calling).
    question_only: bool = False
    max_turns: int = 4  # used only when the generator does not pass extras["max_turns"]
    # Per-step credit: a turn whose successful retrieval-tool results (e.g. search; never error messages or other
    # tools' output) contain a golden answer (normalised substring) earns this reward on its own step, once per
    # episode. 0 = off. environment/answer_retrieved is logged per tool turn either way.
    intermediate_reward: float = 0.0


def final_answer(content: str) -> str:
    """The answer in a turn without tool calls: its last `<answer>` if it wrote one, else the whole text."""
    answer = last_answer(content)
    return (answer if answer is not None else content).strip()


class ToolEnv:
    """One episode; tools (and their connection pools) are shared by every episode of the registry."""

    def __init__(self, tools: dict[str, ToolLike], cfg: ToolEnvConfig) -> None:
        self.all_tools, self.cfg = tools, cfg
        self.tool_schemas: list[dict] = []
        self.executor: ToolExecutor | None = None
        self.targets: list[str] = []
        self.turns, self.max_turns = 0, cfg.max_turns
        self.rewarded_retrieval = False

    async def reset(self, prompt_messages: list[Message], extras: dict[str, Any]) -> list[Message]:
        """Pick this row's tools, keep its golden answers, and adapt the prompt to function calling."""
        names = (extras.get("extra_info") or {}).get("tools") or list(self.all_tools)
        unknown = [n for n in names if n not in self.all_tools]
        if unknown:
            raise KeyError(f"extra_info.tools names {unknown}, not among the configured tools {sorted(self.all_tools)}")
        tools = {n: self.all_tools[n] for n in names}
        self.executor = ToolExecutor(tools, self.cfg.timeout_s, self.cfg.max_calls_per_turn)
        self.tool_schemas = [t.schema for t in tools.values()]
        self.targets = ground_truth_targets(extras)
        self.max_turns = int(extras.get("max_turns", self.cfg.max_turns))
        self.turns, self.rewarded_retrieval = 0, False
        return self._prompt(list(prompt_messages), extras)

    def _prompt(self, messages: list[Message], extras: dict[str, Any]) -> list[Message]:
        if self.cfg.question_only:
            question = (extras.get("extra_info") or {}).get("question")
            if not question:
                raise KeyError("tool env question_only=true needs extra_info.question in the row")
            messages = [m for m in messages if m["role"] != "user"] + [{"role": "user", "content": question}]
        if self.cfg.system_prompt is not None:
            messages = [m for m in messages if m["role"] != "system"]
            messages.insert(0, {"role": "system", "content": self.cfg.system_prompt})
        return messages

    async def step(self, action_text: str) -> StepResult:
        """Only reachable when nothing parsed the turn; the generator always calls step_turn."""
        return await self.step_turn(ParsedTurn(action_text))

    async def step_turn(self, turn: ParsedTurn) -> StepResult:
        """Tool calls -> their results as `tool` messages; no call -> the answer is graded and the episode ends."""
        self.turns += 1
        calls = turn.tool_calls
        if calls and self.turns < self.max_turns:
            results, metrics = await run_turn_calls(self.executor, calls)
            reward = intermediate_retrieval_reward(self._retrieved_text(results), self.targets,
                                                   self.cfg.intermediate_reward, self, metrics)
            return StepResult(to_messages(results), reward, False, metrics)
        answer = final_answer(turn.content) if not calls else None
        reward = exact_match_score(answer, self.targets)
        return StepResult([], reward, True, {"em": reward, "answered": float(answer is not None),
                                             "subem": float(answer is not None and subem_check(answer, self.targets)),
                                             "tool_calls": float(len(calls))})


    def _retrieved_text(self, results: list[ToolResult]) -> str:
        """The successful results of retrieval tools only: an error message (malformed call, unknown tool, a failing
        calculator) or a computed result quotes the model's own text, so a golden answer in it was not retrieved."""
        return "\n".join(r.content for r in results if r.ok and is_retrieval_tool(self.executor.tools.get(r.name)))


def build_env_tools(cfg: ToolEnvConfig, search_url: str | None = None) -> dict[str, ToolLike]:
    """The configured tools, built once; a local retriever's URL replaces the search tool's configured one."""
    if cfg.tools_path is None:
        search_cfg = {"search_url": search_url} if search_url else {}
        tools = [SearchTool(search_cfg), CalculatorTool()]
        return {t.name: t for t in tools}
    specs = load_tools_yaml(cfg.tools_path)
    if search_url:
        for spec in specs:
            if spec.class_name == "search":
                spec.config = {**spec.config, "search_url": search_url}
    return build_tools(specs)


def register_tool_env(registry: EnvRegistry, cfg: ToolEnvConfig | None = None, search_url: str | None = None,
                      name: str = "tool") -> None:
    """Register "tool"; the tools are built here, once, and shared by all its episodes."""
    cfg = cfg or ToolEnvConfig()
    tools = build_env_tools(cfg, search_url)
    registry.register(name, lambda: ToolEnv(tools, cfg))
