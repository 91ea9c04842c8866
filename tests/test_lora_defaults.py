"""LoRA at its one-line default (issue 59): the adapter's lr is 10x the full-weight lr unless set (RL and the SFT
warm start apart), a misspelled target module is refused from the model's config before any engine starts, a SFT
that left the eval at 0 says so naming the likely key, and the console, step line and report.md say what trains
and which adapter version the engines serve."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from skyrl_stepwise.loop.evaluation import EvalResult, save_evals
from skyrl_stepwise.policy.config import LORA_LR_SCALE, LoRAConfig
from skyrl_stepwise.run.config import RunConfig, check_lora_targets


def _run_cfg(tmp_path, **lora) -> RunConfig:
    cfg = RunConfig()
    cfg.total_steps, cfg.trainer.ckpt_dir = 6, str(tmp_path / "ckpts")
    cfg.trainer.lora = LoRAConfig(**lora)
    return cfg


# ----------------------------------------------------------------------------------------- 3. the adapter's lr

def test_the_adapter_lr_is_ten_times_the_full_weight_lr_unless_set():
    assert LORA_LR_SCALE == 10.0
    assert LoRAConfig(enabled=True).optimizer_lr(1e-5) == pytest.approx(1e-4)
    assert LoRAConfig(enabled=True, lr=3e-4).optimizer_lr(1e-5) == 3e-4
    assert "lr 0.0001 (10 x trainer.optim.lr=1e-05; trainer.lora.lr sets it)" in \
        LoRAConfig(enabled=True).describe_lr(1e-5)
    with pytest.raises(ValueError, match=r"trainer.lora.lr must be > 0"):
        LoRAConfig(enabled=True, lr=0.0).validate()


def test_the_sft_adapter_has_its_own_lr_key_and_the_full_sft_cache_ignores_it(tmp_path):
    from skyrl_stepwise.loop.warm_start import cache_key, sft_lora_config

    cfg = _run_cfg(tmp_path, enabled=True, lr=7e-4)
    assert not sft_lora_config(cfg).enabled  # LoRA RL warm-starts from a full SFT unless sft.lora=true
    cfg.sft.lora = True
    assert sft_lora_config(cfg).lr is None  # RL's explicit lr never reaches SFT: 10 x SFT's own lr
    cfg.sft.lora_lr = 2e-4
    assert sft_lora_config(cfg).lr == 2e-4
    memo = tmp_path / "memo.json"
    keyed = cache_key(cfg, "data", memo_path=memo)
    assert cache_key(replace(cfg, sft=replace(cfg.sft, lora_lr=None)), "data", memo_path=memo) != keyed
    full = replace(cfg, sft=replace(cfg.sft, lora=False))
    assert cache_key(full, "data", memo_path=memo) == \
        cache_key(replace(full, sft=replace(full.sft, lora_lr=None)), "data", memo_path=memo)
    with pytest.raises(ValueError, match=r"sft.lora_lr must be > 0"):
        replace(cfg.sft, lora_lr=-1.0).validate()


@pytest.mark.integration  # a PolicyWorker: > 2 s on a loaded 2-core box
def test_the_policy_s_adamw_runs_the_adapter_at_ten_times_optim_lr(tiny_model_dir, tmp_path):
    from skyrl_stepwise.policy.config import TrainerConfig
    from skyrl_stepwise.policy.fsdp_worker import PolicyWorker

    cfg = TrainerConfig(model_path=str(tiny_model_dir), micro_batch_tokens=64, ckpt_dir=str(tmp_path / "c"))
    cfg.fsdp.mixed_precision, cfg.optim.lr = False, 2e-5
    for lora, expected in ((LoRAConfig(enabled=True), 2e-4), (LoRAConfig(enabled=True, lr=5e-3), 5e-3),
                           (LoRAConfig(), 2e-5)):
        worker = PolicyWorker(replace(cfg, lora=lora))
        assert [g["lr"] for g in worker.optimizer.param_groups] == [pytest.approx(expected)], lora
    worker.set_optim(replace(cfg.optim, lr=1e-6))  # SFT's chosen lr goes through the same rule
    assert worker.optimizer.param_groups[0]["lr"] == pytest.approx(1e-6)  # (the last worker: full weights)


# ----------------------------------------------------------------------------------------- 4. target modules early

@pytest.mark.integration  # builds the model class on the meta device: imports transformers' Llama (> 2 s loaded)
def test_a_misspelled_target_module_is_refused_from_the_config_naming_the_valid_names(tiny_model_dir):
    check_lora_targets(str(tiny_model_dir), ["q_proj", "v_proj"])
    check_lora_targets("no/such-model-anywhere", ["q_prj"])  # no config readable here: left to the policy's check
    with pytest.raises(ValueError, match=r"trainer.lora.target_modules: 'q_prj' names no linear module .* its linear "
                                         r"modules are \['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj', "
                                         r"'up_proj', 'v_proj'\]"):
        check_lora_targets(str(tiny_model_dir), ["q_prj"])


@pytest.mark.integration  # Hydra composes the config: a few seconds on a loaded box
def test_cfg_job_refuses_a_misspelled_target_module_before_any_engine(tiny_model_dir, capsys, monkeypatch, tmp_path):
    from skyrl_stepwise.cli import train

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(train, "run", lambda cfg: pytest.fail("--cfg job must not run"))
    with pytest.raises(SystemExit) as exit_:
        train.main([f"model_path={tiny_model_dir}", "trainer.lora.enabled=true",
                    "trainer.lora.target_modules=[q_proj,v_prj]", "--cfg", "job"])
    assert exit_.value.code not in (0, None)
    err = capsys.readouterr().err
    assert "trainer.lora.target_modules: 'v_prj' names no linear module" in err and "'v_proj'" in err


# ----------------------------------------------------------------------------------------- 2. SFT left the eval at 0

def _eval(stage: str, scores: list[float]) -> EvalResult:
    return EvalResult(stage, scores, sum(scores) / len(scores), 0.0, 0.0)


def test_a_sft_that_left_the_eval_at_zero_says_so_naming_the_likely_key(tmp_path):
    from skyrl_stepwise.loop.warm_start import sft_left_no_signal

    cfg = _run_cfg(tmp_path, enabled=True)
    cfg.sft.enabled = cfg.sft.lora = True
    evals = [_eval("before SFT", [0.0, 1.0, 0.0, 0.0]), _eval("after SFT", [0.0] * 4)]
    history = [{"step": 1, "sft/loss": 1.763}, {"step": 6, "sft/loss": 1.682}]
    text = sft_left_no_signal(cfg, evals, history)
    assert text.startswith("SFT LEFT THE EVAL AT 0: the eval after SFT scored 0 on all 4 prompts, 0.250 before it "
                           "(SFT loss 1.763 -> 1.682)")
    assert "`sft.lora=true` trained the SFT warm start as a LoRA adapter at lr 0.0005 (10 x sft.lr=5e-05" \
        in text and "Likely key: sft.lora_lr" in text and "sft.lora=false" in text
    cfg.sft.lora = False
    assert "Likely keys: sft.lr, sft.epochs" in sft_left_no_signal(cfg, evals)
    assert sft_left_no_signal(cfg, [evals[0], _eval("after SFT", [0.0, 0.0, 1.0, 0.0])]) is None
    assert sft_left_no_signal(cfg, evals[:1]) is None  # no SFT stage, no claim


def test_a_sft_that_left_the_eval_near_zero_says_so_with_the_signal_a_step_can_expect(tmp_path):
    """1 of 128 right after an adapter warm start (0.008) gave RL step 1 `signal_groups=0`, yet "exactly 0"
    stayed silent: the bar is the groups a step expects with signal at the after-SFT rate."""
    from skyrl_stepwise.loop.warm_start import expected_signal_groups, sft_left_no_signal

    cfg = _run_cfg(tmp_path, enabled=True)
    cfg.sft.enabled, cfg.generator.n_samples_per_prompt, cfg.data.train_batch_size = True, 4, 4
    near = _eval("after SFT", [1.0] + [0.0] * 127)
    text = sft_left_no_signal(cfg, [near])
    groups = expected_signal_groups(1 / 128, 4, 4)
    assert 0.1 < groups < 0.2 and f"expects {groups:.2f} groups with signal" in text
    assert text.startswith("SFT LEFT THE EVAL NEAR 0: the eval after SFT scored 0.008 (1 of 128 prompts)")
    assert "Likely keys: sft.lr, sft.epochs" in text
    assert sft_left_no_signal(cfg, [_eval("after SFT", [1.0] * 37 + [0.0] * 91)]) is None  # 0.289: 5.9 groups
    cfg.data.train_batch_size = 64  # the same 0.008 with 64 prompts a step: 2 groups expected, RL has signal
    assert sft_left_no_signal(cfg, [near]) is None
    cfg.data.train_batch_size, cfg.generator.n_samples_per_prompt = 4, 1  # no groups: only exactly 0 is claimed
    assert sft_left_no_signal(cfg, [near]) is None
    assert sft_left_no_signal(cfg, [_eval("after SFT", [0.0] * 128)]).startswith("SFT LEFT THE EVAL AT 0")


def test_the_report_carries_the_sft_zero_warning(tmp_path):
    from skyrl_stepwise.run.report import write_run_report

    cfg = _run_cfg(tmp_path, enabled=True)
    cfg.sft.enabled = True
    save_evals(tmp_path, [_eval("before SFT", [0.0, 1.0]), _eval("after SFT", [0.0, 0.0])])
    assert "**SFT LEFT THE EVAL AT 0" in write_run_report(cfg, tmp_path).read_text()


# ----------------------------------------------------------------------------------------- 5. what the engines serve

def test_the_step_line_names_the_adapter_version_the_engines_serve():
    from skyrl_stepwise.loop.tracking import adapter_note

    assert adapter_note({"reward/mean": 0.5}) is None  # merged sync or full weights: nothing to name
    assert adapter_note({"sync/adapter_version": 3.0}) == "engines serve adapter v3"
    decided = {"sync/adapter_version": 3.0, "sync/adapter_decided": 1.0, "sync/adapter_margin": 12.34,
               "sync/adapter_separation": 30.0}
    assert adapter_note(decided) == "engines serve adapter v3 (probe: applied, margin +12.3 standard errors)"
    undecided = {**decided, "sync/adapter_decided": 0.0, "sync/adapter_separation": 2.5}
    assert adapter_note(undecided).startswith("engines serve adapter v3 (probe undecided: the adapter moves the "
                                              "probe 2.5 x the engine's noise")


def test_the_step_line_on_the_console_carries_the_adapter_version(tmp_path, caplog):
    from skyrl_stepwise.loop.tracking import Tracker

    tracker = Tracker(tmp_path, "p", "r", "disabled", {})
    with caplog.at_level("INFO", logger="skyrl_stepwise"):
        tracker.log({"reward/mean": 0.5, "sync/adapter_version": 2.0}, 2)
    tracker.finish()
    assert any("step 2: reward=0.5" in r.message and "| engines serve adapter v2" in r.message
               for r in caplog.records)


def test_the_report_config_reflects_lora(tmp_path):
    from skyrl_stepwise.run.report import config_summary, describe_lora

    cfg = _run_cfg(tmp_path, enabled=True, rank=16, alpha=32.0, target_modules=["q_proj", "v_proj"], sync="adapter")
    text = "\n".join(config_summary(cfg))
    assert ("- trains: LoRA rank 16, alpha 32, targets ['q_proj', 'v_proj'], adapter lr 1e-05 (10 x "
            "trainer.optim.lr=1e-06; trainer.lora.lr sets it); the engines serve the LoRA adapter alone, loaded by "
            "version (trainer.lora.sync=adapter") in text
    assert ", lr 1e-05, mini-batch" in text  # the lr the adapter trains at, not the full-weight lr
    cfg.sft.enabled = True
    assert describe_lora(cfg).endswith("; SFT warm start: every weight (sft.lora=false)")  # the default
    cfg.sft.lora = True
    assert "; SFT warm start: an adapter at lr 0.0005 (10 x sft.lr=5e-05; sft.lora_lr sets it)" in describe_lora(cfg)
    cfg.sft.lora = False
    assert describe_lora(cfg).endswith("; SFT warm start: every weight (sft.lora=false)")
    assert describe_lora(_run_cfg(tmp_path)) == "full fine-tuning (trainer.lora.enabled=false), lr 1e-06"


def test_a_run_stopped_by_the_probe_after_step_1_s_update_does_not_say_nothing_was_trained(tmp_path):
    from skyrl_stepwise.loop.loop import updated_before_failure
    from skyrl_stepwise.policy.weight_sync import AdapterNotApplied
    from skyrl_stepwise.run.report import write_run_report

    cfg = _run_cfg(tmp_path, enabled=True, sync="adapter")
    try:
        with updated_before_failure(1):
            raise AdapterNotApplied("weight sync to policy version 1: the engine does not score with adapter v1")
    except AdapterNotApplied as e:
        failure = e
    assert failure.updated_step == 1
    text = write_run_report(cfg, tmp_path, [], failure=failure).read_text()
    assert "nothing was trained" not in text
    assert "in step 1 of 6, after its update ran (the weights were trained; the step's metrics were not logged)" \
        in text
    assert "nothing was trained" in write_run_report(cfg, tmp_path, [], failure=ValueError("x")).read_text()
