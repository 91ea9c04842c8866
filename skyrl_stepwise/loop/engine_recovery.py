"""The trainer's side of an engine restart: current weights in, verified by the probe, before any rollout.

A restarted engine holds the weights it was started from (the run's initial checkpoint), not the trainer's:
sampling from it would train off-policy silently. So after a restart the weights are synced and the probe must
agree (mean |trainer - engine| logprob within trainer.agreement_alarm_mean_diff) before rollouts continue; if it
does not, the run stops naming the restart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Awaitable, Callable

from skyrl_stepwise.inference.recovery import restart_dead_engines
from skyrl_stepwise.policy.weight_sync import ProbeResult


class EngineRecoveryError(RuntimeError):
    """A restarted engine did not take the trainer's weights (its probe disagrees)."""


@dataclass
class EngineRecovery:
    """What a recovery did, for the step's metrics and the agreement alarm's 'last sync'."""

    restarted: list[int]
    probe: ProbeResult


async def recover_engines(engine, weight_sync, probe: Callable[[], Awaitable[ProbeResult]],
                          max_mean_diff: float) -> EngineRecovery | None:
    """Restart dead engines, sync the current weights into them and verify with the probe; None if all are alive."""
    restarted = await restart_dead_engines(engine)
    if not restarted:
        return None
    forget = getattr(weight_sync, "engines_restarted", None)
    if forget is not None:  # a broadcast group that held the dead engine is formed again
        forget()
    await weight_sync.sync()
    result = await probe()
    if result.num_tokens == 0 or not result.mean_abs_diff <= max_mean_diff:
        raise EngineRecoveryError(
            f"engine(s) {restarted} restarted, but the first weight sync after the restart did not take: the probe's "
            f"mean |trainer - engine| logprob is {result.mean_abs_diff:.4g} over {result.num_tokens} tokens (allowed "
            f"{max_mean_diff:g}); stopping rather than sample from weights that are not the trainer's")
    return EngineRecovery(restarted, result)
