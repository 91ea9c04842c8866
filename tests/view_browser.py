"""The viewer page of a real run, checked in a real browser: Debian's Chromium driven by Playwright (no browser
download; `make install` installs the package). Used by the main job's e2e test (test_train_e2e.py), which owns
the run; kept here so the checks read as one list.

What is checked, against the run's own files rather than the page's data:
- three trajectories with per-token records: the tokens drawn as trained are exactly the loss mask's ones, sample
  by sample (view_tokens.jsonl);
- hovering a trained token of a training step shows the engine's and the trainer's logprob;
- each filter shows exactly the trajectories the run recorded as failed / truncated (rollouts.jsonl);
- no console error; a screenshot lands in the test's output dir;
- the step's worst engine-vs-trainer tokens are one click away, and a click on one opens its trajectory at it;
- the tamper-suspected and context-edited filters show exactly the trajectories the run's files say.
`check_merged_page` checks a merged run's page (tests/test_view.py): each merged sample's gen-only column holds
exactly the step-wise samples the generator made, tool calls show the parser's verdict and the answer, and a
paired eval prompt's link opens the eval trajectory that answered it.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run"]
PACKAGE = "Debian's `chromium` package (apt-get install -y chromium; `make install` does it)"


def chromium() -> str:
    """The system Chromium's path and an importable Playwright; without either the test skips, naming the
    package, except on CI (the CI variable set), where a missing browser is a broken setup and fails."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    missing = None if path else PACKAGE
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing = missing or "the Python package `playwright` (pip install -e '.[dev]')"
    if missing:
        message = f"the viewer's browser test needs {missing}"
        if os.environ.get("CI"):
            pytest.fail(message + " (on CI it must be installed)")
        pytest.skip(message)
    return path


def _recorded(run_dir: Path) -> tuple[dict, dict]:
    """(step, stage, trajectory) -> its view_tokens.jsonl record, and -> its rollouts.jsonl sample."""
    def lines(name: str) -> list[dict]:
        return [json.loads(line) for line in (run_dir / name).read_text().splitlines() if line.strip()]

    key = lambda r: (r["step"], r["stage"], r["trajectory"])  # noqa: E731
    return {key(r): r for r in lines("view_tokens.jsonl")}, {key(r): r for r in lines("rollouts.jsonl")}


def _trained_positions(page) -> list[list[int]]:
    return page.evaluate("""() => [...document.querySelectorAll('#detail .sample')].map((s) =>
        [...s.querySelectorAll('.tok.r-t[data-part="r"]')].map((t) => Number(t.dataset.pos)))""")


def _open(page, step: int, stage: str, trajectory: str) -> None:
    page.select_option("#stage", f"{step}|{stage}")
    page.locator(f'#list .row[data-key="{trajectory}"]').click()


def check_page(run_dir: Path, out_dir: Path, browser_path: str) -> dict[str, float]:
    """Build the page with the CLI, open it, run the checks above; returns the page's size and load time."""
    from playwright.sync_api import sync_playwright

    from skyrl_stepwise.cli.view import main

    assert main([str(run_dir)]) == 0
    path = run_dir / "view" / "index.html"
    tokens, texts = _recorded(run_dir)
    assert len(tokens) >= 3, f"the run recorded {len(tokens)} trajectories per token (logging.view_samples)"
    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=browser_path, args=FLAGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        start = time.perf_counter()
        page.goto(path.as_uri())
        page.wait_for_selector("#list .row")
        load_s = time.perf_counter() - start

        trains = [k for k in tokens if k[1] == "train"]
        chosen = (trains[:2] + [k for k in tokens if k not in trains[:2]])[:3]
        for step, stage, trajectory in chosen:
            _open(page, step, stage, trajectory)
            masks = [s["loss_mask"] for s in tokens[(step, stage, trajectory)]["samples"]]
            assert _trained_positions(page) == [[i for i, m in enumerate(mask) if m] for mask in masks], trajectory

        _open(page, *trains[0])
        page.hover("#detail .tok.r-t >> nth=0")
        tip = page.inner_text("#tip")
        assert "engine lp  -" in tip and "trainer lp -" in tip and "advantage" in tip, tip

        _check_filters(page, tokens, texts)
        _check_timeline_and_sort(page, run_dir, texts)

        _check_worst(page, trains[0], tokens)
        _open(page, *trains[0])
        page.hover("#detail .tok.r-t >> nth=0")
        page.screenshot(path=str(out_dir / "viewer.png"), full_page=True)
        browser.close()
    assert not errors, errors
    return {"bytes": float(path.stat().st_size), "load_s": load_s}


def _check_filters(page, tokens: dict, texts: dict) -> None:
    """Per step and stage, each filter shows exactly the trajectories the run's files flag (rollouts.jsonl,
    view_tokens.jsonl), and with no filter on the list holds every recorded one."""
    from skyrl_stepwise.generator.agent_loop import LIMIT_STOPS

    for step, stage in sorted({(k[0], k[1]) for k in texts}):
        page.select_option("#stage", f"{step}|{stage}")
        stage_samples = [s for k, s in texts.items() if k[:2] == (step, stage)]
        expected = {"F": {s["trajectory"] for s in stage_samples if s.get("pick") == "failed"},
                    "T": {s["trajectory"] for s in stage_samples
                          if s.get("stop_reason") == "length" or s.get("stop_reason") in LIMIT_STOPS}}
        expected.update(_expected_flags(tokens, stage_samples, step, stage))
        for flag, want in expected.items():
            box = page.locator(f'input[data-flag="{flag}"]')
            box.check()
            shown = set(page.eval_on_selector_all("#list .row", "rows => rows.map((r) => r.dataset.key)"))
            assert shown == want, (stage, flag, shown, want)
            box.uncheck()
        assert page.locator("#list .row").count() == len(stage_samples)


def _check_timeline_and_sort(page, run_dir: Path, texts: dict) -> None:
    """Every step of metrics.jsonl is a point on the timeline (a click on it selects the step); sorting by reward
    orders a step's rows by the rewards rollouts.jsonl recorded."""
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    for step in steps:
        assert page.locator(f'#timeline circle[data-step="{step}"]').count() >= 1, step
    step = steps[-1]
    page.locator(f'#timeline circle[data-step="{step}"] >> nth=0').dispatch_event("click")
    assert page.input_value("#stage") == f"{step}|train"
    page.select_option("#sort", "reward-desc")
    keys = page.eval_on_selector_all("#list .row", "rows => rows.map((r) => r.dataset.key)")
    rewards = [texts[(step, "train", k)]["reward"] for k in keys]
    assert rewards == sorted(rewards, key=lambda r: -r if r is not None else float("inf")), (keys, rewards)
    page.select_option("#sort", "group")


def _expected_flags(tokens: dict, stage_samples: list[dict], step: int, stage: str) -> dict[str, set[str]]:
    """X: rollouts.jsonl's tamper_suspected; E: a recorded context event, or a per-token sample whose prompt does not
    extend the sequence before it (view_tokens.jsonl's prefix)."""
    def rewritten(record: dict | None) -> bool:
        context = 0
        for s in (record or {}).get("samples", []):
            if context and s["prefix"] != context:
                return True
            context = s["prefix"] + len(s["prompt_ids"]) + len(s["response_ids"])
        return False

    return {"X": {s["trajectory"] for s in stage_samples if s.get("tamper_suspected")},
            "E": {s["trajectory"] for s in stage_samples
                  if s.get("context_events") or rewritten(tokens.get((step, stage, s["trajectory"])))}}


def _check_worst(page, key: tuple, tokens: dict) -> None:
    """One click lists the step's worst tokens, the largest |trainer - engine| first, each equal to the recorded
    logprobs' difference; a click on a row opens its trajectory with that token marked."""
    step, stage, _ = key
    page.select_option("#stage", f"{step}|{stage}")
    page.click("#worst-button")
    rows = page.eval_on_selector_all("table.worst tr", "rows => rows.slice(1).map((r) => "
                                     "[...r.cells].map((c) => c.textContent))")
    recorded = [abs(t - e) for k, r in tokens.items() if k[:2] == (step, stage) for s in r["samples"]
                if s.get("engine_logprobs") and s.get("trainer_logprobs")
                for e, t, m in zip(s["engine_logprobs"], s["trainer_logprobs"], s["loss_mask"]) if e != 0.0]
    assert bool(rows) == bool(recorded), (rows, len(recorded))
    if not rows:
        return
    diffs = [float(r[0]) for r in rows]
    assert diffs == sorted(diffs, reverse=True) and abs(diffs[0] - max(recorded)) < 1e-3, (diffs, max(recorded))
    page.click("table.worst tr >> nth=1")
    assert page.locator("#detail .sample .tok.hit").count() == 1


def check_merged_page(run_dir: Path, out_dir: Path, browser_path: str, stepwise) -> None:
    """A merged run's page: per trajectory, the gen-only column's trained tokens, step by step, are the loss masks of
    `stepwise` (the GeneratorOutput the generator made with merging off); tool calls carry a verdict and an answer;
    the first paired eval prompt's link opens its eval trajectory; no console error."""
    from playwright.sync_api import sync_playwright

    from skyrl_stepwise.cli.view import main

    assert main([str(run_dir)]) == 0
    tokens, texts = _recorded(run_dir)
    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=browser_path, args=FLAGS)
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto((run_dir / "view" / "index.html").as_uri())
        page.wait_for_selector("#list .row")
        merged_seen = 0
        for step, stage, trajectory in [k for k in tokens if k[1] == "train"]:
            _open(page, step, stage, trajectory)
            steps = page.evaluate("""() => [...document.querySelectorAll('#detail .gen-step')].map((g) =>
                [...g.querySelectorAll('.tok[data-part="r"]')].filter((t) => t.classList.contains('r-t')).length)""")
            rows = [i for i, t in enumerate(stepwise.trajectory_ids) if t.key() == trajectory]
            if len(rows) > 1:
                assert steps == [sum(stepwise.loss_masks[i]) for i in rows], (trajectory, steps)
                merged_seen += 1
            calls = [c for seg in texts[(step, stage, trajectory)]["segments"] for c in seg["tool_calls"]]
            shown = page.eval_on_selector_all("#detail .call", "cs => cs.map((c) => c.dataset.verdict)")
            assert shown == [c["verdict"] for c in calls], (shown, calls)
            if calls:
                assert page.locator("#detail .answer").count() >= 1
        assert merged_seen, "no trajectory of the run was merged from more than one step"
        _open(page, *next(k for k in tokens if k[1] == "train"))
        page.hover("#detail .gen-step .tok.r-t >> nth=0")
        page.screenshot(path=str(out_dir / "viewer_merged.png"), full_page=True)
        _check_filters(page, tokens, texts)
        train = next(k for k in tokens if k[1] == "train")
        _check_worst(page, train, tokens)
        page.click("#worst-button")  # beside the listed tokens: the loss's agreement over all the step's tokens
        assert "max 0.00400" in page.inner_text("#agreement"), page.inner_text("#agreement")
        first = page.locator("#eval-pairs .paired >> nth=0")  # the first fixed prompt, at the stage before
        assert first.count(), "no paired eval prompt listed"
        prompt = first.get_attribute("data-prompt")
        first.locator("a.open-before").click()
        opened = page.get_attribute("#list .row.open", "data-key")
        assert page.input_value("#stage").split("|")[1] == "eval before SFT" and opened.endswith(f"/{prompt}_0"), opened
        browser.close()
    assert not errors, errors
