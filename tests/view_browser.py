"""The viewer page of a real run, checked in a real browser: Debian's Chromium driven by Playwright (no browser
download; `make install` installs the package). Used by the main job's e2e test (test_train_e2e.py), which owns
the run; kept here so the checks read as one list.

What is checked, against the run's own files rather than the page's data:
- three trajectories with per-token records: the tokens drawn as trained are exactly the loss mask's ones, sample
  by sample (view_tokens.jsonl);
- hovering a trained token of a training step shows the engine's and the trainer's logprob;
- each filter shows exactly the trajectories the run recorded as failed / truncated (rollouts.jsonl);
- no console error; a screenshot lands in the test's output dir.
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
    from skyrl_stepwise.generator.agent_loop import LIMIT_STOPS

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

        for step, stage in sorted({(k[0], k[1]) for k in texts}):
            page.select_option("#stage", f"{step}|{stage}")
            stage_samples = [s for k, s in texts.items() if k[:2] == (step, stage)]
            expected = {"F": {s["trajectory"] for s in stage_samples if s.get("pick") == "failed"},
                        "T": {s["trajectory"] for s in stage_samples
                              if s.get("stop_reason") == "length" or s.get("stop_reason") in LIMIT_STOPS}}
            for flag, want in expected.items():
                box = page.locator(f'input[data-flag="{flag}"]')
                box.check()
                shown = set(page.eval_on_selector_all("#list .row", "rows => rows.map((r) => r.dataset.key)"))
                assert shown == want, (stage, flag, shown, want)
                box.uncheck()
            assert page.locator("#list .row").count() == len(stage_samples)

        _open(page, *trains[0])
        page.hover("#detail .tok.r-t >> nth=0")
        page.screenshot(path=str(out_dir / "viewer.png"), full_page=True)
        browser.close()
    assert not errors, errors
    return {"bytes": float(path.stat().st_size), "load_s": load_s}
