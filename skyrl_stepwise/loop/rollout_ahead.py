"""Async rollouts with bounded staleness: the engines generate the rollouts of the next steps while the trainer
updates on this one (`trainer.max_staleness > 0`).

One producer task generates step after step, each with the weights the engines hold when it starts. A step's
rollouts may start only once the engines hold the weights of at least `step - max_staleness` updates, so the
batch a step trains on was sampled at most `max_staleness` updates ago; its tokens are off-policy by that much,
which the loss corrects with truncated importance sampling against the rollout logprobs (the trainer's own
logprobs are the PPO anchor). A weight sync waits for the rollouts in progress to finish: every trajectory is
sampled by one set of weights, so its rollout logprobs are the behaviour policy's, exactly.

In the spirit of verl's one-step-off-policy trainer and prime-rl's `async_level`: generation and the update
overlap, and the engines never wait for the trainer by more than the bound.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Awaitable, Callable


@dataclass
class Rollout:
    """One step's rollouts and the weights version (updates synced to the engines) they were sampled with."""

    step: int
    weights_version: int
    seconds: float  # generation time of this batch alone (the trainer may have waited less, or not at all)
    result: Any  # what RLTrainer.sample returns: (output, batch, signal metrics, prompts)


class RolloutAhead:
    """Generates the rollouts of steps `first_step..total_steps-1` ahead of the trainer, never more than
    `max_staleness` weight updates behind it. `weights_version` starts at `first_step` (a resumed run's weights
    are those of its step)."""

    def __init__(self, sample: Callable[[int], Awaitable[Any]], first_step: int, total_steps: int,
                 max_staleness: int, ready: list[Rollout] | None = None) -> None:
        """`ready`: rollouts of steps first_step, first_step+1, ... already generated (a resumed run's, from its
        checkpoint: sampled by weights older than the checkpoint's); generation continues after them."""
        if max_staleness < 1:
            raise ValueError(f"trainer.max_staleness must be >= 1 for rollouts ahead, got {max_staleness}")
        self.sample, self.max_staleness = sample, max_staleness
        self.first_step, self.total_steps = first_step, total_steps
        self.weights_version = first_step
        self._engine_weights = asyncio.Lock()  # held by one batch's generation, or by one weight sync
        self._version_changed = asyncio.Condition()
        self._ready: asyncio.Queue[Rollout] = asyncio.Queue()
        ready = list(ready or [])
        if [r.step for r in ready] != list(range(first_step, first_step + len(ready))):
            raise ValueError(f"rollouts ahead of steps {[r.step for r in ready]} do not continue step {first_step}")
        for rollout in ready:
            self._ready.put_nowait(rollout)
        self._next_to_generate = first_step + len(ready)
        self._task = asyncio.create_task(self._produce(), name="rollout-ahead")

    async def _produce(self) -> None:
        for step in range(self._next_to_generate, self.total_steps):
            async with self._version_changed:
                await self._version_changed.wait_for(lambda: step - self.weights_version <= self.max_staleness)
            async with self._engine_weights:
                version, start = self.weights_version, time.perf_counter()
                result = await self.sample(step)
            await self._ready.put(Rollout(step, version, time.perf_counter() - start, result))

    async def next(self) -> Rollout:
        """The next step's rollouts, in step order; waits only if the engines are behind. The producer's error,
        if generation failed, is raised here rather than lost in a background task."""
        get = asyncio.ensure_future(self._ready.get())
        await asyncio.wait({get, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if get.done():
            return get.result()
        get.cancel()
        self._task.result()  # raises the producer's exception
        raise RuntimeError(f"no rollouts left: the producer stopped after step {self.total_steps - 1}")

    @asynccontextmanager
    async def weights_update(self):
        """Hold the engines' weights for one sync: rollouts in progress finish first (no trajectory is half old
        weights, half new) and none starts until the new version is in place."""
        async with self._engine_weights:
            yield
            async with self._version_changed:
                self.weights_version += 1
                self._version_changed.notify_all()

    def pending(self) -> list[Rollout]:
        """The rollouts generated and not yet trained on, oldest first (for a checkpoint). Right after a weight
        sync every one sampled by older weights is among them: a sync waits for the generation in progress."""
        return list(self._ready._queue)  # noqa: SLF001 - a snapshot; asyncio.Queue has no public peek

    async def close(self) -> None:
        """Stop generating (the run ended or failed); rollouts of steps never trained are dropped."""
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)  # its error, if any, was raised by next()
