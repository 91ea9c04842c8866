"""The Search-R1 environment (env class "search"): `<search>` calls a retriever, `<answer>` ends with EM.

Turn semantics follow SkyRL, not Search-R1: `max_turns` counts LLM turns (actions) in total, and the
episode is done at the `max_turns`-th action even without an answer (so at most max_turns - 1 searches
are executed; a `<search>` in the last turn is not run). Search-R1's `max_turns=N` instead means N
search rounds plus one forced final generation, i.e. SkyRL/our `max_turns=N+1`.

Each action is parsed like Search-R1 does: the FIRST `<search>...</search>` or `<answer>...</answer>`
(regex `<(search|answer)>(.*?)</\\1>`), body stripped. Observations are Search-R1's text:
`\\n\\n<information>Doc 1(Title: "T") text\\nDoc 2(...)...</information>\\n\\n`, returned as one
`{"role": "user"}` message. In conversation mode the generator appends it as a user turn; in
single-message mode it concatenates the message contents raw after the action, which reproduces
Search-R1's token stream exactly. A retriever that returns garbage or refuses the query never raises: the
observation says the search failed, `search_failures` counts it, and the episode goes on. One that stays down
through every retry (with backoff) fails this trajectory only (`retriever_down=fail`, the default: it is dropped
and counted, never trained on an observation no working retriever would give); `retriever_down=observe` shows
the model the failure instead.

The reward is exact match (SR1 normalization) of the answer the model gave in its actions; the
prompt's own `<answer> Beijing </answer>` example is never seen here, so one match is enough.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

import httpx

from skyrl_stepwise.envs.base import EnvRegistry, Message, StepResult
from skyrl_stepwise.envs.rewards import exact_match_score, last_answer, subem_check, words_contain
from skyrl_stepwise.retrieval.client import (RetrievalClient, RetrievalError, RetrievalUnavailable,
                                             RetrieverEndpointConfig)
from skyrl_stepwise.retrieval.index import format_documents  # noqa: F401  (the demonstrations read it here)

ACTION_RE = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
# Search-R1's message, verbatim (search_r1/llm_agent/generation.py).
INVALID_ACTION = ("\nMy previous action is invalid. If I want to search, I should put the query between "
                  "<search> and </search>. If I want to give the final answer, I should put the answer "
                  "between <answer> and </answer>. Let me try again.\n")


@dataclass
class SearchEnvConfig(RetrieverEndpointConfig):
    """Retriever endpoint, retry policy and observation text; defaults reproduce Search-R1's format."""

    max_turns: int = 4  # used only when the generator does not pass extras["max_turns"]
    observation_template: str = "\n\n<information>{results}</information>\n\n"  # a search's observation
    doc_template: str = "Doc {index}(Title: {title}) {text}\n"  # each document in {results}
    # each document's text cut to its first N words, " ..." marking the cut (0 = whole passages, as Search-R1)
    max_doc_words: int = 0
    # the observation when a search fails (retriever_down=observe, or an error the retries do not cover)
    failure_template: str = "\n\n<information>Search failed: {error}</information>\n\n"
    # the observation for a turn with neither <search> nor <answer>
    invalid_action_message: str = INVALID_ACTION
    # Per-step credit: a search whose documents contain a golden answer (normalised substring) earns this reward on
    # its own step, once per episode (repeating the search earns nothing more). 0 = off, the Search-R1 recipe.
    # Whether the answer was retrieved is logged per step either way (environment/answer_retrieved).
    intermediate_reward: float = 0.0

    def __post_init__(self) -> None:
        """Fail at config time, not mid-rollout, on a template that uses unknown fields."""
        super().__post_init__()
        checks = (("observation_template", self.observation_template, {"results": ""}),
                  ("doc_template", self.doc_template, {"index": 1, "title": "", "text": ""}),
                  ("failure_template", self.failure_template, {"error": ""}))
        for name, template, fields in checks:
            try:
                template.format(**fields)
            except (KeyError, IndexError, ValueError) as e:
                raise ValueError(f"SearchEnvConfig.{name} {template!r} must only use the fields "
                                 f"{sorted(fields)}: {e!r}") from None
        if self.max_doc_words < 0:
            raise ValueError(f"SearchEnvConfig.max_doc_words must be >= 0 (0 = whole passages), got {self.max_doc_words}")
        if self.topk < 1:
            raise ValueError(f"SearchEnvConfig.topk must be >= 1, got {self.topk}")
        if self.intermediate_reward < 0:
            raise ValueError(f"SearchEnvConfig.intermediate_reward must be >= 0 (0 = off), got {self.intermediate_reward}")


def parse_action(text: str) -> tuple[str, str] | None:
    """("search" | "answer", stripped body) of the first tag pair in the action, or None if invalid."""
    m = ACTION_RE.search(text)
    return (m.group(1), m.group(2).strip()) if m else None


def ground_truth_targets(extras: dict[str, Any]) -> list[str]:
    """The golden answers from `extras["reward_spec"]["ground_truth"]["target"]`, as a list of strings."""
    try:
        target = extras["reward_spec"]["ground_truth"]["target"]
    except (KeyError, TypeError):
        raise KeyError("search env needs extras['reward_spec']['ground_truth']['target'] (the golden answers); "
                       f"got extras keys {sorted(extras)}") from None
    targets = [target] if isinstance(target, str) else [str(t) for t in target]
    if not targets:
        raise ValueError("extras['reward_spec']['ground_truth']['target'] is empty")
    return targets


class SearchEnv:
    """One Search-R1 episode; a fresh instance per trajectory, the retrieval client shared."""

    def __init__(self, cfg: SearchEnvConfig | None = None, client: RetrievalClient | None = None) -> None:
        self.cfg = cfg or SearchEnvConfig()
        self.client = client or RetrievalClient(self.cfg.client_config())
        self.targets: list[str] = []
        self.max_turns = self.cfg.max_turns
        self.turns = 0
        self.actions: list[str] = []
        self.rewarded_retrieval = False

    async def reset(self, prompt_messages: list[Message], extras: dict[str, Any]) -> list[Message]:
        """Keep the golden answers and the generator's max_turns; the prompt passes through unchanged."""
        self.targets = ground_truth_targets(extras)
        self.max_turns = int(extras.get("max_turns", self.cfg.max_turns))
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        self.turns, self.actions, self.rewarded_retrieval = 0, [], False
        return list(prompt_messages)

    async def step(self, action_text: str) -> StepResult:
        """Answer -> graded and done; search -> retrieved docs (or a failure note); else SR1's invalid message."""
        self.turns += 1
        self.actions.append(action_text)
        action = parse_action(action_text)
        metrics = {"invalid_actions": float(action is None), "search_calls": 0.0, "search_failures": 0.0,
                   "retrieval_seconds": 0.0}

        if (action is not None and action[0] == "answer") or self.turns >= self.max_turns:
            answer = action[1] if action is not None and action[0] == "answer" else last_answer("".join(self.actions))
            reward = exact_match_score(answer, self.targets)
            metrics.update(em=reward, answered=float(answer is not None),
                           subem=float(answer is not None and subem_check(answer, self.targets)))
            return StepResult(observations=[], reward=reward, done=True, metrics=metrics)

        reward = 0.0
        if action is None:
            text = self.cfg.invalid_action_message
        else:
            metrics["search_calls"] = 1.0
            t0 = time.perf_counter()
            try:
                docs = (await self.client.search([action[1]], self.cfg.topk))[0]
                documents = format_documents(docs, self.cfg.doc_template, self.cfg.max_doc_words).strip()
                text = self.cfg.observation_template.format(results=documents)
                # the passages as the model reads them, without the template's own words ("Doc 2" is no answer 2)
                passages = format_documents(docs, "{title}\n{text}\n", self.cfg.max_doc_words)
                reward = intermediate_retrieval_reward(passages, self.targets, self.cfg.intermediate_reward, self,
                                                       metrics)
            except (RetrievalError, httpx.HTTPError) as e:  # a broken answer must not end the episode
                if isinstance(e, RetrievalUnavailable) and self.cfg.retriever_down == "fail":
                    raise  # the retriever is down: this trajectory fails (dropped, counted), the batch goes on
                metrics["search_failures"] = 1.0
                text = self.cfg.failure_template.format(error=(str(e) or type(e).__name__)[:300])
            metrics["retrieval_seconds"] = time.perf_counter() - t0
        return StepResult(observations=[{"role": "user", "content": text}], reward=reward, done=False, metrics=metrics)


def intermediate_retrieval_reward(text: str, targets: list[str], bonus: float, episode, metrics: dict[str, float]
                                  ) -> float:
    """Shared by the search and tool envs: pay `bonus` once per episode (`episode.rewarded_retrieval`) when a golden
    answer appears in retrieved text, so a policy cannot farm it by repeating a search; metrics say what happened.
    The answer must appear as whole words (normalised): a plain substring paid "us" for "business" and "Ana" for
    "banana", whatever was retrieved."""
    hit = words_contain(text, targets)
    paid = bonus if hit and bonus > 0 and not episode.rewarded_retrieval else 0.0
    episode.rewarded_retrieval = episode.rewarded_retrieval or paid > 0
    metrics["answer_retrieved"] = float(hit)
    metrics["intermediate_reward"] = paid
    return paid


def register_search_env(registry: EnvRegistry, cfg: SearchEnvConfig | None = None, name: str = "search") -> None:
    """Register "search" with one retrieval client (one connection pool) shared by all its episodes."""
    cfg = cfg or SearchEnvConfig()
    client = RetrievalClient(cfg.client_config())
    registry.register(name, lambda: SearchEnv(cfg, client))
