"""The divergence guard: stop SFT or RL when an update blew the model up, instead of training on a wreck.

Seen with Gemma 3 270M and the SFT recipe's lr 5e-5 without warm-up: one step took the entropy from 2.9 to 7.1
nats and the grad norm to 448, the model then sampled `<unused>` tokens, and every later step trained on that
while the run looked normal. The guard compares each step's grad norm, entropy and loss with their start (the
median of the first `baseline_steps` steps, so one odd first batch does not set it) and raises DivergenceError
naming the step, the metric, its start and the threshold key. Each check is judged from the second step on, so a
divergence in the very first update is caught at the next one. A start that is itself wild (Gemma 3 270M base:
grad norm 487 at step 1, when every later norm is compared with that) hides any later blow-up from the relative
check, so the grad norm also has an absolute ceiling (`grad_norm_max`), judged at every step, the first included.
Thresholds only stop a run: they never change what is trained, so they are not part of the SFT cache key
(loop/warm_start.py).
"""

from __future__ import annotations

import math
import statistics

from skyrl_stepwise.policy.config import DivergenceConfig  # noqa: F401  (the `*.divergence` keys)


class DivergenceError(RuntimeError):
    """An update diverged; the message names the step, metric, start value and threshold key."""


class DivergenceGuard:
    """Watches one run's step metrics. `prefix`: where the config lives (`sft.divergence`,
    `trainer.divergence`), named in the message; `loss_key`: the loss metric to judge (None: none);
    `entropy_key`: the token-mean entropy metric."""

    def __init__(self, cfg: DivergenceConfig, prefix: str, loss_key: str | None = None,
                 entropy_key: str = "policy/entropy", grad_norm_key: str = "train/grad_norm",
                 what: str = "step") -> None:
        self.cfg, self.prefix, self.what = cfg, prefix, what
        self.keys = {"grad_norm": grad_norm_key, "entropy": entropy_key, "loss": loss_key}
        self.seen: dict[str, list[float]] = {name: [] for name in self.keys}

    def start(self, name: str) -> float | None:
        """The metric's start value: the median of its first `baseline_steps` finite values (None before any).
        Grad norms of 0 (a batch with nothing to learn from) are no start."""
        values = self.seen[name][: self.cfg.baseline_steps]
        return statistics.median(values) if values else None

    def check(self, step: int, metrics: dict[str, float]) -> None:
        """Judge this step against the starts so far, then let it join them (while they are still forming)."""
        if not self.cfg.enabled:
            return
        for name, key in self.keys.items():
            value = metrics.get(key) if key else None
            if value is None or not math.isfinite(value):  # a non-finite grad norm: the worker skipped the step
                continue
            if name == "grad_norm":
                self._ceiling(step, key, value)
            start = self.start(name)
            if start is not None:
                self._judge(step, name, key, value, start)
            if not (name == "grad_norm" and value <= 0):
                self.seen[name].append(value)

    def _ceiling(self, step: int, key: str, value: float) -> None:
        """The absolute grad-norm bound: judged with or without a start (step 1 included)."""
        limit = self.cfg.grad_norm_max
        if limit is not None and value > limit:
            raise DivergenceError(
                f"{self.what} {step}: {key} = {value:.4g}, past {self.prefix}.grad_norm_max={limit:g} (an absolute "
                f"bound, judged from the first step: the gradient is {value / limit:.1f}x past it before clipping): "
                f"the update diverged or the data is far from anything the model produces. Usual causes: a "
                f"learning rate too high for this model, no warm-up (num_warmup_steps), or a base model trained on "
                f"a chat format it never saw. Stopping instead of training on a broken model; this step's metrics "
                f"are logged. Set {self.prefix}.grad_norm_max=null (or {self.prefix}.enabled=false) to train anyway.")

    def _judge(self, step: int, name: str, key: str, value: float, start: float) -> None:
        c = self.cfg
        if name == "grad_norm" and c.grad_norm_factor is not None and value > c.grad_norm_floor \
                and value > c.grad_norm_factor * start:
            self._stop(step, key, value, start, f"{value / start:.0f}x its start", "grad_norm_factor",
                       c.grad_norm_factor, f" (and above {self.prefix}.grad_norm_floor={c.grad_norm_floor:g})")
        if name == "entropy" and c.entropy_rise_nats is not None and value - start > c.entropy_rise_nats:
            self._stop(step, key, value, start, f"{value - start:+.2f} nats from its start", "entropy_rise_nats",
                       c.entropy_rise_nats)
        if name == "loss" and c.loss_factor is not None and start > 0 and value > c.loss_factor * start:
            self._stop(step, key, value, start, f"{value / start:.1f}x its start", "loss_factor", c.loss_factor)

    def _stop(self, step: int, key: str, value: float, start: float, how: str, threshold: str, limit: float,
              extra: str = "") -> None:
        n = min(len(self.seen[key_name(self.keys, key)]), self.cfg.baseline_steps)
        raise DivergenceError(
            f"{self.what} {step}: {key} = {value:.4g}, {how} ({start:.4g}, the median of the first {n} "
            f"step{'s' if n > 1 else ''}), past {self.prefix}.{threshold}={limit:g}{extra}: the update diverged. "
            f"Usual causes: a learning rate too high for this model, or no warm-up (num_warmup_steps). Stopping "
            f"instead of training on a broken model; this step's metrics are logged. Set {self.prefix}.{threshold}"
            f"=null (or {self.prefix}.enabled=false) to train anyway.")


def key_name(keys: dict[str, str | None], key: str) -> str:
    """The check's name (grad_norm, entropy, loss) of a metric key."""
    return next(name for name, k in keys.items() if k == key)
