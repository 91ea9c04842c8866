"""The trajectory viewer's data: every token's role comes from the recorded loss mask and merge spans (never from
text), the trainer's logprobs and advantages land on the tokens they were computed for, and the page is one
self-contained file. The browser test (test_view_browser.py) checks the same roles on the drawn page."""

from __future__ import annotations

import json
import re

import pytest
from test_rollout_samples import _tool_output

from skyrl_stepwise.generator.output import GeneratorOutput, TrajectoryID
from skyrl_stepwise.loop.rollout_samples import RolloutLog, batch_rows, load_token_records
from skyrl_stepwise.policy.batching import TrainBatch
from skyrl_stepwise.view.page import page_data, render, runs, write_page


class Renderer:
    """Decodes token i as `<i>`; parses no tool call (a parse error: the sample keeps its text, no calls)."""

    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)

    def parse(self, *args):
        raise ValueError("no parser here")


def output() -> GeneratorOutput:
    """Group g: trajectory g_0 has two step-wise turns (the first ends on an appended EOS, masked), the second a
    context edit (its prompt does not extend the previous sequence); g_1 one turn cut by length."""
    return GeneratorOutput(
        prompt_token_ids=[[1, 2], [1, 2, 3, 4, 9, 5, 6], [1, 7, 8], [1, 2]],
        response_ids=[[3, 4, 9], [10, 11], [12, 13], [20, 21, 22]],
        rewards=[0.0, 0.0, 1.0, 0.0], loss_masks=[[1, 1, 0], [1, 1], [1, 1], [1, 1, 1]],
        stop_reasons=["stop", "stop", "stop", "length"],
        rollout_logprobs=[[-0.5, -0.25, 0.0], [-1.0, -2.0], [-0.1, -0.2], [-3.0, -3.0, -3.0]],
        trajectory_ids=[TrajectoryID("g", 0)] * 3 + [TrajectoryID("g", 1)],
        is_last_step=[False, False, True, True],
        context_events=[{"trajectory": "g_0", "before_step": 2, "policy": "truncate", "kind": "truncate",
                         "tokens_dropped": 4, "note": "kept the first message"}])


def recorded_run(tmp_path, out: GeneratorOutput | None = None):
    """A run dir with one step recorded the way the trainer records it (RolloutLog), trainer logprobs offset by
    +0.01 from the engine's, and advantages 1 per token of g_0 and -1 of g_1."""
    out = out or output()
    batch = TrainBatch.from_output(out, [[1.0] * len(r) if t.repetition_id == 0 else [-1.0] * len(r)
                                         for r, t in zip(out.response_ids, out.trajectory_ids)])
    log = RolloutLog(tmp_path, Renderer(), num_samples=4, view_samples=4)
    log.record(out, 1, "train")
    where = batch_rows(out, batch)
    rows = [r for traj in log.view_rows(out) for r in traj]
    trainer = {r: [lp + 0.01 for lp in out.rollout_logprobs[r]] for r in rows}
    log.record_tokens(out, 1, "train", trainer, {r: batch.advantages[where[r]] for r in rows})
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5, "timing/step_s": 2.0}) + "\n")
    return out


def test_token_roles_are_the_recorded_masks(tmp_path):
    out = recorded_run(tmp_path)
    data = page_data(tmp_path)
    by_key = {t["key"]: t for t in data["trajectories"]}
    g0 = by_key["g_0"]["samples"]
    assert [s["response_roles"] for s in g0] == ["ttm", "tt", "tt"]  # the appended EOS: masked, not trained
    assert [s["prompt_roles"] for s in g0] == ["pp", "oo", "ee"]  # observations, then the edited context
    assert [s["prefix"] for s in g0] == [0, 5, 1]  # only token 1 survives the edit
    for traj in data["trajectories"]:  # trained tokens are exactly the loss mask's ones, sample by sample
        rows = [i for i, t in enumerate(out.trajectory_ids) if t.key() == traj["key"]]
        assert [[int(r == "t") for r in s["response_roles"]] for s in traj["samples"]] == \
               [out.loss_masks[i] for i in rows]
    assert by_key["g_0"]["flags"] == "E" and by_key["g_1"]["flags"] == "T"
    assert by_key["g_0"]["advantage"] == 1.0 and by_key["g_1"]["advantage"] == -1.0
    assert data["texts"]["9"] == "<9>" and data["steps"] == [{"step": 1, "reward/mean": 0.5, "timing/step_s": 2.0}]


def test_logprobs_and_advantages_land_on_their_tokens_and_worst_agreement_is_ranked(tmp_path):
    recorded_run(tmp_path)
    data = page_data(tmp_path)
    g1 = next(t for t in data["trajectories"] if t["key"] == "g_1")["samples"][0]
    assert g1["engine_logprobs"] == [-3.0] * 3 and g1["trainer_logprobs"] == [-2.99] * 3
    assert g1["advantages"] == [-1.0] * 3
    worst = data["worst"]["1|train"]
    assert len(worst) == 9 and all(w[3] == 0.01 for w in worst)  # the appended EOS (engine 0.0) is never listed


def test_merged_samples_mark_observations_inside_the_response(tmp_path):
    from skyrl_stepwise.generator.merge import merge_stepwise_output

    out = output()
    out.prompt_token_ids[2] = [1, 2, 3, 4, 9, 5, 6, 10, 11, 7]  # the third turn extends the chain: one merged sample
    merged = merge_stepwise_output(out)
    recorded_run(tmp_path, merged)
    g0 = next(t for t in page_data(tmp_path)["trajectories"] if t["key"] == "g_0")["samples"]
    assert len(g0) == 1 and g0[0]["prompt_roles"] == "pp"
    assert g0[0]["response_roles"] == "ttm" + "oo" + "tt" + "o" + "tt"  # EOS masked; observations from the spans
    assert g0[0]["boundaries"] == [5, 8]  # where the merged-in steps start
    assert [int(r == "t") for r in g0[0]["response_roles"]] == merged.loss_masks[0]


def test_only_view_samples_trajectories_are_recorded_per_token_and_rewind_drops_later_steps(tmp_path):
    out = output()
    log = RolloutLog(tmp_path, Renderer(), num_samples=4, view_samples=1)
    assert log.record_tokens(out, 1, "train") > 0 and log.record_tokens(out, 2, "train") > 0
    assert [(r["step"], r["trajectory"]) for r in load_token_records(tmp_path)] == [(1, "g_0"), (2, "g_0")]
    log.rewind(1)
    assert [r["step"] for r in load_token_records(tmp_path)] == [1]
    assert RolloutLog(tmp_path, Renderer(), 4, view_samples=0).record_tokens(out, 3, "train") == 0


def test_page_is_self_contained_and_text_cannot_close_its_script(tmp_path):
    out = output()
    recorded_run(tmp_path, out)
    for name in ("rollouts.jsonl", "view_tokens.jsonl"):  # a token that decodes to a closing script tag
        lines = (tmp_path / name).read_text().replace("<1>", "</script><script>alert(1)</script>")
        (tmp_path / name).write_text(lines)
    html = write_page(tmp_path).read_text()
    assert html.count("</script>") == 2  # the data's and the code's: the trajectory's text stays data
    assert not re.search(r"(src|href)=\"?https?:", html)  # nothing from the network
    blob = json.loads(html.split('id="data">', 1)[1].split("</script>", 1)[0])
    assert blob["texts"]["1"] == "</script><script>alert(1)</script>"
    samples = json.loads(blob["trajectories"][1]["samples"])  # g_1, in its wire form: advantages as runs
    assert samples[0]["advantages"] == [[-1.0, 3]] and samples[0]["response_ids"] == [20, 21, 22]
    assert "/*CSS*/" not in render(page_data(tmp_path)) and "/*JS*/" not in html


def test_runs_store_an_advantage_once_per_turn():
    assert runs([1.0, 1.0, 0.5, 1.0]) == [[1.0, 2], [0.5, 1], [1.0, 1]]
    assert runs([]) == [] and runs(None) is None


def test_batch_rows_follow_a_dynamic_sampling_selection():
    out = output()
    batch = TrainBatch.from_output(out).select([3, 0])
    assert batch_rows(out, batch) == {3: 0, 0: 1}


@pytest.mark.parametrize("merge", [False, True])
async def test_a_real_generators_tool_turns_get_their_roles_from_its_masks(tokenizer, tmp_path, merge):
    gen, out = await _tool_output(tokenizer, merge)
    log = RolloutLog(tmp_path, gen.loop.renderer, num_samples=4, view_samples=4)
    log.record(out, 1, "train")
    log.record_tokens(out, 1, "train")
    best = next(t for t in page_data(tmp_path)["trajectories"] if t["key"] == "q_0")
    rows = [i for i, t in enumerate(out.trajectory_ids) if t.key() == "q_0"]
    assert [[int(r == "t") for r in s["response_roles"]] for s in best["samples"]] == [out.loss_masks[i] for i in rows]
    roles = "".join(s["prompt_roles"] + s["response_roles"] for s in best["samples"])
    assert "o" in roles and "t" in roles  # the calculator's answer is an observation, merged or not
    assert "calculator" in json.dumps(best["segments"])  # the parsed tool call rides along from rollouts.jsonl


def test_a_run_that_recorded_nothing_still_gets_a_page(tmp_path):
    data = page_data(tmp_path)
    assert data["trajectories"] == [] and data["steps"] == [] and data["worst"] == {}
    assert write_page(tmp_path).is_file()


def test_cli_writes_the_page_and_serve_rebuilds_it_when_a_step_lands(tmp_path, capsys):
    import threading
    import urllib.request

    from skyrl_stepwise.cli.view import main, serve

    assert main([str(tmp_path / "missing")]) == 1
    recorded_run(tmp_path)
    assert main([str(tmp_path)]) == 0 and "index.html" in capsys.readouterr().out
    server = serve(tmp_path, 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        first = urllib.request.urlopen(f"{url}/stamp").read().decode()
        page = urllib.request.urlopen(f"{url}/").read().decode()
        assert '"live":true' in page and first in page
        with open(tmp_path / "metrics.jsonl", "a") as f:  # the run logs step 2
            f.write(json.dumps({"step": 2, "reward/mean": 1.0}) + "\n")
        second = urllib.request.urlopen(f"{url}/stamp").read().decode()
        assert second != first and '"step":2' in (tmp_path / "view" / "index.html").read_text()
    finally:
        server.shutdown()
        server.server_close()


async def test_a_merged_sample_splits_back_into_exactly_the_step_wise_samples_generated(tokenizer):
    """The gen-only column of a merged sample is the step-wise output the generator made (the same script, merge
    off), id for id, mask for mask: the merge's recorded spans, no re-tokenising."""
    from skyrl_stepwise.view.page import step_ranges

    _, merged = await _tool_output(tokenizer, merge=True)
    _, stepwise = await _tool_output(tokenizer, merge=False)
    for i, tid in enumerate(merged.trajectory_ids):
        rows = [j for j, t in enumerate(stepwise.trajectory_ids) if t == tid]
        prompt, response = merged.prompt_token_ids[i], merged.response_ids[i]
        ranges = step_ranges(merged.observation_spans[i], len(response)) or [[0, len(response)]]
        assert [prompt + response[:a] for a, _ in ranges] == [stepwise.prompt_token_ids[j] for j in rows]
        assert [response[a:b] for a, b in ranges] == [stepwise.response_ids[j] for j in rows]
        assert [merged.loss_masks[i][a:b] for a, b in ranges] == [stepwise.loss_masks[j] for j in rows]
        assert [merged.rollout_logprobs[i][a:b] for a, b in ranges] == [stepwise.rollout_logprobs[j] for j in rows]
    assert len(step_ranges(merged.observation_spans[0], len(merged.response_ids[0]))) == 2  # q_0: call, answer


def test_page_rows_carry_tamper_verdicts_answers_and_paired_eval_links(tmp_path):
    out = output()
    out.tamper_suspected = ["g_1"]
    recorded_run(tmp_path, out)
    rows = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    rows[0]["segments"][1]["tool_calls"] = [{"name": "calc", "arguments": {}, "error": "unknown_tool"}]  # pre-verdict
    evals = []
    for stage, step, scores in (("before SFT", 0, [0.0, 1.0]), ("after RL (step 1)", 1, [1.0, 0.0])):
        evals.append({"stage": stage, "scores": scores, "mean": 0.5, "ci_low": 0.0, "ci_high": 1.0,
                      "sources": ["toy", "toy"]})
        stage_name = "eval before SFT" if step == 0 else "eval step 1"
        rows.append(dict(rows[1], step=step, stage=stage_name, trajectory=f"eval/{stage}/x/0_0"))
    (tmp_path / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "evals.json").write_text(json.dumps(evals))
    data = page_data(tmp_path)
    by_key = {t["key"]: t for t in data["trajectories"]}
    assert by_key["g_1"]["flags"] == "TX" and "X" not in by_key["g_0"]["flags"]
    calling = by_key["g_0"]["segments"][1]
    assert calling["tool_calls"][0]["verdict"] == "unknown tool"  # from the parser's error kind
    assert calling["answer"] == by_key["g_0"]["segments"][2]["text"]  # the env's reply that follows the call
    (change,) = data["paired"]
    assert [q["prompt"] for q in change["fixed"]] == [0] and [q["prompt"] for q in change["broken"]] == [1]
    fixed = change["fixed"][0]
    assert data["trajectories"][fixed["before"]]["stage"] == "eval before SFT" and fixed["source"] == "toy"
    assert data["trajectories"][fixed["after"]]["stage"] == "eval step 1"
    assert change["broken"][0]["before"] is None  # prompt 1's eval trajectory was not recorded


@pytest.mark.integration
def test_a_merged_runs_page_shows_its_steps_as_generated_in_a_real_browser(tokenizer, tmp_path):
    """Chromium on the page of a real generator's merged tool-call step (scripted engine, real tokenizer): the
    gen-only column is the step-wise output, tool verdicts and answers show, paired eval links open (view_browser)."""
    import asyncio
    from dataclasses import replace

    from view_browser import check_merged_page, chromium

    browser = chromium()
    gen, merged = asyncio.run(_tool_output(tokenizer, merge=True))
    _, stepwise = asyncio.run(_tool_output(tokenizer, merge=False))
    merged.tamper_suspected = ["q_1"]
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    log = RolloutLog(tmp_path, gen.loop.renderer, num_samples=4, tools=tools, view_samples=4)
    log.record(merged, 1, "train")
    batch = TrainBatch.from_output(merged, [[0.5] * len(r) for r in merged.response_ids])
    rows = range(len(merged))
    log.record_tokens(merged, 1, "train", {r: [lp - 0.002 * r for lp in merged.rollout_logprobs[r]] for r in rows},
                      {r: batch.advantages[r] for r in rows})
    evals = []
    for stage, label, scores in (("before SFT", "before SFT", [0.0, 1.0]), ("step 1", "after RL (step 1)", [1.0, 0.0])):
        ids = [TrajectoryID(f"eval/{stage}/q/{t.repetition_id}", 0) for t in stepwise.trajectory_ids]
        log.record(replace(stepwise, trajectory_ids=ids, tamper_suspected=[]), 1, f"eval {stage}")
        evals.append({"stage": label, "scores": scores, "mean": 0.5, "ci_low": 0.0, "ci_high": 1.0,
                      "sources": ["toy", "toy"]})
    (tmp_path / "evals.json").write_text(json.dumps(evals))
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5, "agreement/logprob_abs_diff_max":
                                                        0.004, "agreement/logprob_abs_diff_mean": 0.001}) + "\n")
    check_merged_page(tmp_path, tmp_path, browser, stepwise)
    assert (tmp_path / "viewer_merged.png").stat().st_size > 10_000


@pytest.mark.parametrize("mini_batches", [1, 2])
async def test_the_view_takes_its_trainer_logprobs_from_the_update_that_scored_them(tokenizer, tmp_path,
                                                                                   mini_batches):
    """One on-policy mini-batch: the update's own forward is the scoring pass before the update, so the loop asks
    the policy for those logprobs with the step (train_step_scored) instead of a second forward of the view samples;
    with more mini-batches the old-logprob pass scored them already. Either way the view's trainer logprobs are
    the ones of the pass that ran (a fake policy: -0.25 from the update, -0.5 from a scoring pass)."""
    from test_rollout_ahead import _trainer

    trainer, _, _ = _trainer(tokenizer, tmp_path, max_staleness=0)
    calls = []

    class Policy:
        def call(self, method, *args):
            calls.append(method)
            if method == "compute_logprobs":
                return [[-0.5] * len(ids) for ids in args[0].response_ids]
            if method in ("train_step", "train_step_scored"):
                metrics = {"policy/loss": 0.0, "train/real_tokens": 4.0, "train/packed_tokens": 4.0,
                           "train/padded_batch_tokens": 4.0}
                if method == "train_step":
                    return metrics
                return metrics, {i: [-0.25] * len(args[0].response_ids[i]) for i in args[1]}
            return None

    trainer.policy, trainer.cfg.total_steps = Policy(), 1
    trainer.cfg.data.train_batch_size = trainer.loader.batch_size = 2
    trainer.cfg.trainer.policy_mini_batch_size = 2 // mini_batches
    trainer.rollout_log = RolloutLog(tmp_path, trainer.generator.loop.renderer, num_samples=4, view_samples=4)
    await trainer.fit()
    records = load_token_records(tmp_path)
    scores = {lp for r in records for s in r["samples"] for lp in s["trainer_logprobs"]}
    assert records and scores == ({-0.25} if mini_batches == 1 else {-0.5})
    trained = [c for c in calls if c.startswith("train_step")]
    assert trained == (["train_step_scored"] if mini_batches == 1 else ["train_step", "train_step"])
