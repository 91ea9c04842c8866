"""The trajectory viewer's page: its size and how long Chromium takes to open it, at 1,000 trajectories.

A synthetic run dir is recorded the way a run records it (RolloutLog.record / record_tokens: the same files, the
same per-token fields): STEPS steps of GROUPS prompt groups x N samples, each trajectory TURNS step-wise turns of
RESPONSE sampled tokens (the last one an appended, masked EOS) and OBSERVATION observation tokens after each,
on a first prompt of PROMPT tokens, every trajectory recorded per token. Then `write_page` builds the page and
Chromium (Debian's, headless, through Playwright) opens it from disk:

    load       navigation start -> the trajectory list drawn (the page's own work: JSON parse, timeline, list)
    open       a click on the longest trajectory -> its tokens drawn (one frame later)
    hover      a hover on one of its tokens -> the tooltip filled

    python benchmarks/view_page.py            # 1,000 trajectories; prints a markdown table
    python benchmarks/view_page.py --run DIR  # also the page of a real run dir (its size and load time)

The budget (docs/viewer.md): 1,000 trajectories open in under 2 s; the main job's page under 10 MB.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from view_browser import FLAGS, chromium  # noqa: E402

from skyrl_stepwise.generator.output import GeneratorOutput, TrajectoryID  # noqa: E402
from skyrl_stepwise.loop.rollout_samples import RolloutLog  # noqa: E402
from skyrl_stepwise.view.page import write_page  # noqa: E402

STEPS, GROUPS, N, TURNS = 10, 50, 2, 3  # 10 x 50 x 2 = 1,000 trajectories (a group's best and worst are recorded)
PROMPT, RESPONSE, OBSERVATION, VOCAB = 120, 60, 30, 5000
WORDS = ["the", " answer", " is", " search", "(", ")", " query", ":", "\n", " 42", " tool", "<think>", " I", " will"]


class Renderer:
    """Decodes token i as a word-like string (what a BPE vocabulary looks like on the page)."""

    def decode(self, ids):
        return "".join(WORDS[i % len(WORDS)] + ("" if i < len(WORDS) else str(i % 97)) for i in ids)

    def parse(self, *args):
        raise ValueError("no tool parser in the benchmark")


def trajectory(rng: random.Random, tid: TrajectoryID) -> dict[str, list]:
    """One step-wise trajectory's samples: each turn's prompt is the previous sequence plus an observation."""
    out = {k: [] for k in ("prompts", "responses", "masks", "logprobs", "rewards", "stops", "ids", "last")}
    context = [rng.randrange(VOCAB) for _ in range(PROMPT)]
    for turn in range(TURNS):
        response = [rng.randrange(VOCAB) for _ in range(RESPONSE)]
        out["prompts"].append(list(context))
        out["responses"].append(response)
        out["masks"].append([1] * (RESPONSE - 1) + [0])
        out["logprobs"].append([-rng.expovariate(2.0) for _ in range(RESPONSE - 1)] + [0.0])
        out["rewards"].append(float(tid.repetition_id == 0) if turn == TURNS - 1 else 0.0)  # best and worst differ
        out["stops"].append("stop")
        out["ids"].append(tid)
        out["last"].append(turn == TURNS - 1)
        context = context + response + [rng.randrange(VOCAB) for _ in range(OBSERVATION)]
    return out


def synthetic_run(run_dir: Path, seed: int = 0) -> int:
    """Record STEPS steps into run_dir; returns the trajectories recorded per token."""
    rng = random.Random(seed)
    log = RolloutLog(run_dir, Renderer(), num_samples=GROUPS * N, view_samples=GROUPS * N)
    for step in range(1, STEPS + 1):
        parts = [trajectory(rng, TrajectoryID(f"s{step}g{g}", r)) for g in range(GROUPS) for r in range(N)]
        cat = lambda k: [x for p in parts for x in p[k]]  # noqa: E731
        out = GeneratorOutput(cat("prompts"), cat("responses"), cat("rewards"), cat("masks"), cat("stops"),
                              cat("logprobs"), cat("ids"), cat("last"))
        trainer = {i: [lp + rng.gauss(0, 0.01) if lp else 0.0 for lp in row]
                   for i, row in enumerate(out.rollout_logprobs)}
        advantages = {i: [out.rewards[i] - 0.3] * len(r) for i, r in enumerate(out.response_ids)}
        log.record(out, step, "train")
        log.record_tokens(out, step, "train", trainer, advantages)
    return sum(1 for _ in open(run_dir / "view_tokens.jsonl"))


def measure(page: Path, browser_path: str) -> dict[str, float]:
    """Open the page in Chromium: load, open the longest trajectory, hover one of its tokens (seconds)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=browser_path, args=FLAGS)
        tab = browser.new_page(viewport={"width": 1400, "height": 1000})
        errors = []
        tab.on("pageerror", lambda e: errors.append(str(e)))
        tab.goto(page.as_uri())
        tab.wait_for_selector("#list .row")
        tab.wait_for_function("() => window.viewerReady !== undefined")
        load = tab.evaluate("() => window.viewerReady")  # navigation start -> the page's script has drawn the list
        start = time.perf_counter()
        tab.locator("#list .row").first.click()
        tab.wait_for_selector("#detail .tok")
        opened = time.perf_counter() - start
        start = time.perf_counter()
        tab.hover("#detail .tok.r-t >> nth=0")
        tab.wait_for_selector("#tip:not([hidden])")
        hovered = time.perf_counter() - start
        tokens = tab.locator("#detail .tok").count()
        browser.close()
    if errors:
        raise RuntimeError(f"page errors: {errors}")
    return {"load_s": load / 1000, "open_s": opened, "hover_s": hovered, "tokens": tokens}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, default=None, help="also measure this real run dir's page")
    args = parser.parse_args()
    browser = chromium()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        n = synthetic_run(run_dir)
        start = time.perf_counter()
        page = write_page(run_dir)
        built = time.perf_counter() - start
        tokens_mb = (run_dir / "view_tokens.jsonl").stat().st_size / 1e6
        rows.append((f"synthetic, {n} trajectories x {TURNS} turns", page.stat().st_size / 1e6, built,
                     measure(page, browser), f"view_tokens.jsonl {tokens_mb:.1f} MB"))
    if args.run is not None:
        start = time.perf_counter()
        page = write_page(args.run)
        rows.append((f"run {args.run.name}", page.stat().st_size / 1e6, time.perf_counter() - start,
                     measure(page, browser), ""))
    print("| page | size MB | build s | load s | open a trajectory s (tokens) | hover s | note |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name, size, build, m, note in rows:
        print(f"| {name} | {size:.2f} | {build:.2f} | {m['load_s']:.2f} | {m['open_s']:.3f} ({m['tokens']:.0f}) | "
              f"{m['hover_s']:.3f} | {note} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
