"""A session is one trajectory: the calls sampled for it (each with the ids and messages it continues from), the
step samples they became, and how it ended. Closing it gives the generator's own TrajectoryResult."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from skyrl_stepwise.chat import Message, ParsedTurn
from skyrl_stepwise.gateway.matching import Key
from skyrl_stepwise.generator.agent_loop import StepSample, TrajectoryResult, TrajectoryStats
from skyrl_stepwise.generator.output import TrajectoryID


@dataclass
class SampledCall:
    """One call as the matcher needs it: what the client sent (keys), what we replied (the turn it will echo), and
    the exact ids and rendered messages a continuation extends."""

    request_keys: list[Key]
    reply: Message  # the assistant message returned to the client
    tools_key: Key
    prompt_ids: list[int]  # exactly the engine input
    response_ids: list[int]  # the sampled ids (+ a masked close where the model did not close the turn)
    history: list[Message]  # the messages `prompt_ids` renders, in the renderer's shape (never the client's echo)
    parsed: ParsedTurn


@dataclass
class Session:
    """The state of one trajectory on the endpoint; calls are serialised by `lock` (one chain at a time)."""

    id: str
    trajectory_id: TrajectoryID
    calls: list[SampledCall] = field(default_factory=list)
    steps: list[StepSample] = field(default_factory=list)
    stats: TrajectoryStats = field(default_factory=TrajectoryStats)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    reward: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    failure: str | None = None
    failure_message: str = ""
    closed: bool = False
    # `context_exhausted` while the latest request was refused as longer than generator.max_input_length: a
    # trajectory ending so stopped at a limit (its last step says so, as in the agent loop)
    limit_stop: str | None = None

    def fail(self, cause: str, message: str) -> None:
        """The first failure wins: it is the cause the trajectory is counted under (and it is not trained)."""
        if self.failure is None:
            self.failure, self.failure_message = cause, message

    def result(self, stop_ids: set[int], close_id: int) -> TrajectoryResult:
        """The trajectory as the generator emits it: the reward on the last step, a turn the model left open closed
        by a masked token (never a training target); failed or empty sessions give no samples."""
        # a call to the model is not a tool call: mini-swe-agent answers a reply without one by a format error,
        # and calls again, so calls alone read like a working agent
        self.stats.tool_call_turns = sum(1 for c in self.calls if c.reply.get("tool_calls"))
        if self.failure is None and not self.steps:
            self.fail("agent_no_calls", "the agent program never called the model")
        if self.failure is None and self.reward is None:
            self.fail("agent_no_reward", "the agent program returned no reward and none was posted")
        if self.failure is not None:
            return TrajectoryResult(self.trajectory_id, [], self.stats, self.failure, self.failure_message,
                                    partial_steps=list(self.steps))
        last = self.steps[-1]
        if self.limit_stop is not None:
            last.stop_reason = self.limit_stop
        if not last.response_ids or last.response_ids[-1] not in stop_ids:
            last.response_ids.append(close_id)
            last.loss_mask.append(0)
            if last.logprobs is not None:
                last.logprobs.append(0.0)
        last.reward = float(self.reward)
        for k, v in self.metrics.items():
            self.stats.env_metrics[k] = self.stats.env_metrics.get(k, 0.0) + float(v)
        return TrajectoryResult(self.trajectory_id, list(self.steps), self.stats)
