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
