"""The ablation report states its timing noise and flags batches and steps with no advantage; `ablate --help`
shows the ablation's own keys (fast: no model, no engine)."""

from __future__ import annotations

import pytest

from skyrl_stepwise.ablation.modes import advantages_all_zero
from skyrl_stepwise.ablation.report import flags, timing_summary, write_report


def _row(mode: str, zero: bool, runs: list[float]) -> dict:
    median, spread = timing_summary(runs)
    return {"history": "exact", "mode": mode, "samples": 4, "forward_tokens": 100, "padded_tokens": 120,
            "batch_padded_seq_len": 30, "trained_tokens": 40, "train_step_s": median, "train_step_s_spread": spread,
            "train_step_s_runs": runs, "peak_mem_mib": 10.0, "grad_norm": 0.0 if zero else 1.0,
            "zero_advantages": zero}


def test_timing_summary_is_median_and_max_minus_min():
    assert timing_summary([3.0, 1.0, 2.0]) == (2.0, 2.0)
    assert timing_summary([1.5]) == (1.5, 0.0)


def test_advantages_all_zero_looks_only_at_trained_tokens():
    assert advantages_all_zero([[0.0, 0.0], [0.0]], [[1, 1], [1]])
    assert advantages_all_zero([[0.7, 0.0]], [[0, 1]])  # the advantage sits on an untrained token
    assert not advantages_all_zero([[0.0, -0.5]], [[1, 1]])
    assert advantages_all_zero(None, [[1]])


def test_report_flags_zero_advantage_batches_and_steps_and_states_timing_spread(tmp_path):
    rows = [_row("step_wise", True, [1.0, 1.4, 1.1]), _row("trajectory", False, [2.0, 2.2, 2.1])]
    curves = {"step_wise": [{"step": 1, "advantages/groups_with_signal": 0.0, "reward/mean": 0.0},
                            {"step": 2, "advantages/groups_with_signal": 1.0, "reward/mean": 0.5}]}
    text = write_report(tmp_path, rows, curves, "header").read_text()
    assert "spread (s)" in text and "median of 3 updates" in text
    assert "| exact | step_wise | 4 | 100 | 120 | 30 | 40 | 1.100 | 0.400 |" in text
    assert "**Flagged** (2)" in text
    assert "replay `exact` / `step_wise`: every advantage is 0" in text
    assert "training `step_wise` step 1: no group" in text and "step 2: no group" not in text
    assert "`trajectory`" not in "\n".join(flags(rows, curves))


def test_report_says_when_nothing_is_flagged(tmp_path):
    text = write_report(tmp_path, [_row("step_wise", False, [1.0])], {}, "header").read_text()
    assert "Flagged: none" in text


def test_timing_repeats_is_validated_with_its_key():
    from skyrl_stepwise.run.app_config import load_config

    assert load_config(["experiment=search_r1_tiny"]).ablation.timing_repeats == 3
    with pytest.raises(ValueError, match=r"ablation\.timing_repeats must be >= 1"):
        load_config(["experiment=search_r1_tiny", "ablation.timing_repeats=0"])


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_ablate_help_lists_the_ablation_keys_not_trains(capsys):
    from skyrl_stepwise.cli import ablate

    with pytest.raises(SystemExit) as exit_:
        ablate.main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for key in ("ablation.modes", "ablation.histories", "ablation.num_prompts", "ablation.timing_repeats",
                "ablation.train_steps", "ablation.output_dir", "step_wise_merged", "tree"):
        assert key in text, key
    assert "skyrl-stepwise ablate" in text and "== Recipes" not in text  # train's help lists the recipes
