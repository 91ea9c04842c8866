"""The per-step agreement alarm: the trainer/engine logprob gap on the tokens just trained is logged every step, and
a jump past trainer.agreement_alarm_mean_diff stops the run naming the step and the last weight sync."""

from __future__ import annotations

import json

import pytest

from skyrl_stepwise.loop.agreement import AgreementAlarm, SyncRecord, check_agreement
from skyrl_stepwise.loop.loop import combine_train_metrics


def test_check_agreement_stops_past_the_threshold_only():
    sync = SyncRecord(3, "weight sync", 2e-6)
    check_agreement({"agreement/logprob_abs_diff_mean": 0.02}, 0.1, 4, sync)  # bf16 noise: fine
    check_agreement({}, 0.1, 4, sync)  # no engine logprobs: nothing to check
    check_agreement({"agreement/logprob_abs_diff_mean": 5.0}, None, 4, sync)  # off
    # rollouts one update old: the gap is the policy's own drift (what TIS corrects), logged but not judged
    check_agreement({"agreement/logprob_abs_diff_mean": 0.6, "async/staleness": 1.0}, 0.1, 4, sync)
    with pytest.raises(AgreementAlarm, match=r"step 4: .* 0\.201 .*weight sync after step 3 \(probe max diff 2e-06\)"):
        check_agreement({"agreement/logprob_abs_diff_mean": 0.201, "agreement/logprob_abs_diff_max": 3.0}, 0.1, 4,
                        sync)


def test_a_maximum_stays_a_maximum_over_mini_batches():
    out = combine_train_metrics([{"agreement/logprob_abs_diff_max": 0.5, "agreement/logprob_abs_diff_mean": 0.1},
                                 {"agreement/logprob_abs_diff_max": 0.2, "agreement/logprob_abs_diff_mean": 0.3}])
    assert out["agreement/logprob_abs_diff_max"] == 0.5 and out["agreement/logprob_abs_diff_mean"] == pytest.approx(0.2)


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
async def test_a_broken_sync_stops_the_run_after_logging_the_step_and_before_its_checkpoint(tokenizer, tmp_path):
    """Step 1 trains on-policy; the sync after it 'corrupts' the engine, so step 2's gap jumps: the run stops
    with step 2 logged, naming the sync after step 1, and step 2 is not checkpointed."""
    from test_rollout_ahead import SlowPolicy, _trainer

    class Policy(SlowPolicy):
        gaps = [1e-6, 0.2, 1e-6]

        def call(self, method, *args):
            out = super().call(method, *args)
            if method == "train_step":
                gap = self.gaps[len(self.trained_steps) - 1]
                out.update({"agreement/logprob_abs_diff_mean": gap, "agreement/logprob_abs_diff_max": 10 * gap})
            return out

    trainer, _, policy = _trainer(tokenizer, tmp_path, max_staleness=0)
    trainer.policy = Policy()
    trainer.cfg.trainer.ckpt_interval = 1
    with pytest.raises(AgreementAlarm) as info:
        await trainer.fit()
    assert "step 2: " in str(info.value) and "weight sync after step 1" in str(info.value)
    trainer.tracker.finish()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert [r["agreement/logprob_abs_diff_mean"] for r in records] == [1e-6, 0.2]
    assert trainer.policy.saved_steps == [1]  # the off-policy step's checkpoint was never written


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_the_worker_reports_the_gap_of_the_whole_mini_batch(tiny_model_dir):
    """A real (1-rank) PolicyWorker over 4 micro-batches: the engine's logprobs are the trainer's own shifted by
    0.05 on every token, and by 0.7 on one token of the last sample: the mean is the token mean over all
    micro-batches, the max is the one token (summing maxima over micro-batches would report 0.7 + 3 x 0.05)."""
    from test_fsdp_worker import _fsdp_batch, _tiny_worker

    worker = _tiny_worker(tiny_model_dir)
    batch = _fsdp_batch(128)
    trainer = worker.compute_logprobs(batch)
    batch.rollout_logprobs = [[lp - 0.05 for lp in row] for row in trainer]
    batch.rollout_logprobs[-1][3] = trainer[-1][3] - 0.7
    n = sum(len(r) for r in trainer)
    m = worker.train_step(batch)
    assert m["agreement/logprob_abs_diff_max"] == pytest.approx(0.7, abs=1e-4)
    assert m["agreement/logprob_abs_diff_mean"] == pytest.approx(((n - 1) * 0.05 + 0.7) / n, abs=1e-4)
