"""The per-step trainer/engine agreement alarm.

Every step trains on tokens the engine sampled, with the engine's logprobs in the batch. The trainer scores the
same tokens before its update; the gap between the two (`agreement/logprob_abs_diff_mean` and `_max`, on
loss-masked tokens, computed in losses.policy_loss) is float noise while the engine samples from the trainer's
weights, and jumps when it does not: a weight sync that silently never happened or corrupted the engine (TRL #5312:
0.015 -> 0.201, unnoticed; SkyRL #1680: gibberish after the first sync). The weight-sync probe checks a dozen
tokens once per sync; this checks every trained token, every step, and stops the run instead of training
off-policy silently.
"""

from __future__ import annotations

from dataclasses import dataclass

MEAN_KEY = "agreement/logprob_abs_diff_mean"
MAX_KEY = "agreement/logprob_abs_diff_max"


@dataclass(frozen=True)
class SyncRecord:
    """The weight sync the engines' current weights came from, for the alarm's message."""

    step: int  # the training step after which it ran (0: before any update)
    what: str  # "initial weights", "weight sync", "resume"
    probe_max_diff: float | None = None  # the probe's max |trainer - engine| logprob right after it

    def describe(self) -> str:
        """e.g. "weight sync after step 3 (probe max diff 2.1e-06)"."""
        probe = "" if self.probe_max_diff is None else f" (probe max diff {self.probe_max_diff:.3g})"
        return f"{self.what} after step {self.step}{probe}"


class AgreementAlarm(RuntimeError):
    """The trainer and the engine disagree on the tokens just trained: the run stops rather than train off-policy."""


def check_agreement(metrics: dict[str, float], threshold: float | None, step: int, last_sync: SyncRecord) -> None:
    """Raise AgreementAlarm when this step's mean gap is past `threshold` (None: off; no engine logprobs: nothing
    to check). Called after the step's metrics are logged and before its checkpoint, so the evidence is on disk
    and the latest checkpoint is still one trained on-policy.

    Only steps whose rollouts the current weights sampled are judged: with rollouts k updates old
    (`async/staleness` > 0) the gap is mostly the policy's own drift over those updates (what truncated IS
    corrects; 0.6 after one lr=1e-4 update of SmolLM2), not a disagreement; the probe after every sync covers
    those steps."""
    gap = metrics.get(MEAN_KEY)
    if threshold is None or gap is None or gap <= threshold or metrics.get("async/staleness", 0.0) > 0:
        return
    raise AgreementAlarm(
        f"step {step}: the trainer's and the engine's logprobs on the tokens just trained differ by {gap:.4g} on "
        f"average (max {metrics.get(MAX_KEY, float('nan')):.4g}), past trainer.agreement_alarm_mean_diff="
        f"{threshold:g}. The engine's weights came from the last {last_sync.describe()}: it is not sampling from "
        f"the trainer's policy (a weight sync that did not happen or corrupted the engine, or a dtype/sampling "
        f"mismatch). Stopping instead of training off-policy; the step's metrics are logged and its checkpoint is "
        f"not written. Set trainer.agreement_alarm_mean_diff=null to train anyway.")
