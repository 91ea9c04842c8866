"""The generator's output: parallel lists, one entry per training sample (a step or a trajectory)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass(frozen=True)
class TrajectoryID:
    """Which prompt (instance) and which of its n samples a step belongs to."""

    instance_id: str
    repetition_id: int

    def key(self) -> str:
        return f"{self.instance_id}_{self.repetition_id}"


@dataclass
class GeneratorOutput:
    """Samples ready for the trainer; steps of one trajectory are contiguous, last step flagged."""

    prompt_token_ids: list[list[int]]
    response_ids: list[list[int]]
    rewards: list[list[float]] | list[float]
    loss_masks: list[list[int]]
    stop_reasons: list[str] | None = None
    rollout_logprobs: list[list[float]] | None = None
    trajectory_ids: list[TrajectoryID] | None = None
    is_last_step: list[bool] | None = None
    # Per response token, the turn (0-based, within its trajectory) whose step it belongs to; observation tokens a
    # merge puts between two steps belong to the step before them (the step whose action they answer). Credit
    # assignment finds each step's reward, return and observation history through it, however samples were cut.
    turn_indices: list[list[int]] | None = None
    rollout_metrics: dict = field(default_factory=dict)
    # Trajectories whose infrastructure failed: no samples here, but their groups lost a member, which the
    # advantage baseline must know (a group left with one trajectory has nothing to compare against).
    failed_trajectory_ids: list[TrajectoryID] = field(default_factory=list)
    # What each failed trajectory did before it failed, for reading only (rollouts.jsonl, `show`), never trained:
    # {"trajectory": key, "cause", "message", "samples": [[prompt_ids, response_ids, loss_mask], ...]}
    failed_trajectories: list[dict] = field(default_factory=list)
    # Where a context policy edited a trajectory's context and what it dropped or summarised (generator/context.py):
    # {"trajectory": key, "before_step": i, "policy", "kind", "tokens_dropped", "note"}; for `show` and rollouts.jsonl.
    context_events: list[dict] = field(default_factory=list)
    # Merged samples only (generator/merge.py): per sample, the [start, end) of each observation delta the merge put
    # into the response between two steps (untrained, never sampled; empty when the next step's prompt was exactly
    # the sequence so far); each `end` is where the next step's sampled tokens begin. None: the samples were not
    # merged. Read by the trajectory viewer to tell an observation from a sampled-but-masked token (both have
    # loss_mask 0) and to show the step-wise samples a merged one was made of.
    observation_spans: list[list[list[int]]] | None = None
    # The trajectories (keys) whose env reported `reward/tamper_suspected` > 0 (envs/grading.py): the metric is the
    # batch's fraction; this says which ones, so rollouts.jsonl, `show` and the viewer can flag and filter them.
    tamper_suspected: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.prompt_token_ids)

    def validate(self) -> None:
        """Fail early, naming the field, when the parallel lists disagree."""
        n = len(self.prompt_token_ids)
        for name in ("response_ids", "rewards", "loss_masks", "stop_reasons", "rollout_logprobs",
                     "trajectory_ids", "is_last_step", "turn_indices", "observation_spans"):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(f"GeneratorOutput.{name} has {len(value)} entries, prompt_token_ids has {n}")
        for i, (resp, mask) in enumerate(zip(self.response_ids, self.loss_masks)):
            if len(resp) != len(mask):
                raise ValueError(f"sample {i}: {len(resp)} response ids but {len(mask)} loss_mask entries")
            if self.rollout_logprobs is not None and len(self.rollout_logprobs[i]) != len(resp):
                raise ValueError(f"sample {i}: {len(resp)} response ids but "
                                 f"{len(self.rollout_logprobs[i])} rollout_logprobs")
            if self.rewards and isinstance(self.rewards[i], list) and len(self.rewards[i]) != len(resp):
                raise ValueError(f"sample {i}: {len(resp)} response ids but {len(self.rewards[i])} rewards")
            if self.observation_spans is not None and any(
                    not 0 <= a <= b <= len(resp) for a, b in self.observation_spans[i]):
                raise ValueError(f"sample {i}: observation_spans {self.observation_spans[i]} fall outside its "
                                 f"{len(resp)} response ids")
            if self.turn_indices is not None:
                turns = self.turn_indices[i]
                if len(turns) != len(resp):
                    raise ValueError(f"sample {i}: {len(resp)} response ids but {len(turns)} turn_indices")
                if any(b < a for a, b in zip(turns, turns[1:])) or (turns and turns[0] < 0):
                    raise ValueError(f"sample {i}: turn_indices must be >= 0 and non-decreasing, got {turns}")

    @classmethod
    def concat(cls, outputs: list[GeneratorOutput]) -> GeneratorOutput:
        """The samples of several generate() calls as one output (e.g. the draws of a dynamically sampled step).

        Per-sample fields are concatenated (an optional one is kept only if every output has it); rollout
        metrics become the mean over the outputs that report them, so counts read as "per generate() call".
        """
        if not outputs:
            raise ValueError("GeneratorOutput.concat needs at least one output")
        merged = {}
        for f in fields(cls):
            if f.name == "rollout_metrics":
                continue
            values = [getattr(o, f.name) for o in outputs]
            merged[f.name] = None if any(v is None for v in values) else [x for v in values for x in v]
        sums: dict[str, list[float]] = {}
        for o in outputs:
            for k, v in o.rollout_metrics.items():
                if isinstance(v, (int, float)):
                    sums.setdefault(k, []).append(float(v))
        merged["rollout_metrics"] = {k: sum(v) / len(v) for k, v in sums.items()}
        return cls(**merged)

    def trajectory_rewards(self) -> list[float]:
        """Total reward of each sample (sum of per-token rewards)."""
        return [sum(r) if isinstance(r, list) else float(r) for r in self.rewards]
