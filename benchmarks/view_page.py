"""The trajectory viewer's page: its size and how long Chromium takes to open it, at 1,000 trajectories.

A synthetic run dir is recorded the way a run records it (RolloutLog.record / record_tokens: the same files, the
same per-token fields) in a Shape: steps x prompt groups x n samples, each trajectory `turns` step-wise turns of
`response` sampled tokens (the last one an appended, masked EOS) and `observation` observation tokens after each,
on a first prompt of `prompt` tokens, every trajectory recorded per token (merged first with --merge). Then `write_page` builds the page and
Chromium (Debian's, headless, through Playwright) opens it from disk:

    load       navigation start -> the trajectory list drawn (the page's own work: JSON parse, timeline, list)
    open       a click on the longest trajectory -> its tokens drawn (one frame later)
    hover      a hover on one of its tokens -> the tooltip filled

    python benchmarks/view_page.py            # 1,000 trajectories; prints a markdown table
    python benchmarks/view_page.py --merge    # the same, each trajectory merged (the main job's samples)
    python benchmarks/view_page.py --shape main_job --merge  # the main job's page at its configured bounds
    python benchmarks/view_page.py --run DIR  # also the page of a real run dir (its size and load time)

`--shape main_job` is experiment=search_r1_tiny at its limits: 6 steps and 3 eval stages, 4 trajectories each
recorded per token (logging.view_samples, and num_rollout_samples decoded), every trajectory 3 turns of the full
128 sampled tokens with a first prompt and observations that fill generator.max_input_length (1,536) by the last
turn: no real run of it records more per token.

The budget (docs/viewer.md): 1,000 trajectories open in under 2 s; the main job's page under 10 MB.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout's package, not whichever one the venv installed

from view_browser import FLAGS, chromium  # noqa: E402

from skyrl_stepwise.generator.merge import merge_stepwise_output  # noqa: E402
from skyrl_stepwise.generator.output import GeneratorOutput, TrajectoryID  # noqa: E402
from skyrl_stepwise.loop.rollout_samples import RolloutLog  # noqa: E402
from skyrl_stepwise.view.page import write_page  # noqa: E402

VOCAB = 5000


@dataclass(frozen=True)
class Shape:
    """What a synthetic run records: steps x groups x n trajectories (a group's best and worst are recorded), each
    `turns` turns of `response` sampled tokens and `observation` tokens after each, on a first prompt of `prompt`."""

    steps: int = 10
    groups: int = 50
    n: int = 2
    turns: int = 3
    prompt: int = 120
    response: int = 60
    observation: int = 30


SHAPES = {"1000": Shape(),  # 10 x 50 x 2 = 1,000 trajectories
          # search_r1_tiny at its bounds: 9 stages (6 steps, 3 evals) x 4 trajectories, 400 + 2 x (128 + 440) = 1,536
          "main_job": Shape(steps=9, groups=2, n=2, turns=3, prompt=400, response=128, observation=440)}
WORDS = ["the", " answer", " is", " search", "(", ")", " query", ":", "\n", " 42", " tool", "<think>", " I", " will"]


class Renderer:
    """Decodes token i as a word-like string (what a BPE vocabulary looks like on the page)."""

    def decode(self, ids):
        return "".join(WORDS[i % len(WORDS)] + ("" if i < len(WORDS) else str(i % 97)) for i in ids)

    def parse(self, *args):
        raise ValueError("no tool parser in the benchmark")


def trajectory(rng: random.Random, tid: TrajectoryID, shape: Shape) -> dict[str, list]:
    """One step-wise trajectory's samples: each turn's prompt is the previous sequence plus an observation."""
    out = {k: [] for k in ("prompts", "responses", "masks", "logprobs", "rewards", "stops", "ids", "last")}
    context = [rng.randrange(VOCAB) for _ in range(shape.prompt)]
    for turn in range(shape.turns):
        response = [rng.randrange(VOCAB) for _ in range(shape.response)]
        out["prompts"].append(list(context))
        out["responses"].append(response)
        out["masks"].append([1] * (shape.response - 1) + [0])
        out["logprobs"].append([-rng.expovariate(2.0) for _ in range(shape.response - 1)] + [0.0])
        last = turn == shape.turns - 1
        out["rewards"].append(float(tid.repetition_id == 0) if last else 0.0)  # best and worst differ
        out["stops"].append("stop")
        out["ids"].append(tid)
        out["last"].append(last)
        context = context + response + [rng.randrange(VOCAB) for _ in range(shape.observation)]
    return out


def synthetic_run(run_dir: Path, shape: Shape = Shape(), merge: bool = False, seed: int = 0) -> int:
    """Record shape.steps steps into run_dir (each merged first with `merge`, as the main job's generator does);
    returns the trajectories recorded per token."""
    rng = random.Random(seed)
    per_step = shape.groups * shape.n
    log = RolloutLog(run_dir, Renderer(), num_samples=per_step, view_samples=per_step)
    for step in range(1, shape.steps + 1):
        parts = [trajectory(rng, TrajectoryID(f"s{step}g{g}", r), shape) for g in range(shape.groups)
                 for r in range(shape.n)]
        cat = lambda k: [x for p in parts for x in p[k]]  # noqa: E731
        out = GeneratorOutput(cat("prompts"), cat("responses"), cat("rewards"), cat("masks"), cat("stops"),
                              cat("logprobs"), cat("ids"), cat("last"))
        if merge:
            out = merge_stepwise_output(out)
        trainer = {i: [lp + rng.gauss(0, 0.01) if lp else 0.0 for lp in row]
                   for i, row in enumerate(out.rollout_logprobs)}
        advantages = {i: [sum(out.rewards[i]) - 0.3] * len(r) if merge else [out.rewards[i] - 0.3] * len(r)
                      for i, r in enumerate(out.response_ids)}
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
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1000", help="the synthetic run's shape")
    parser.add_argument("--merge", action="store_true", help="merge each trajectory's steps (the main job's mode)")
    args = parser.parse_args()
    browser = chromium()
    shape, rows = SHAPES[args.shape], []
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        n = synthetic_run(run_dir, shape, args.merge)
        start = time.perf_counter()
        page = write_page(run_dir)
        built = time.perf_counter() - start
        tokens_mb = (run_dir / "view_tokens.jsonl").stat().st_size / 1e6
        name = f"synthetic {args.shape}, {n} trajectories x {shape.turns} turns{', merged' if args.merge else ''}"
        rows.append((name, page.stat().st_size / 1e6, built, measure(page, browser),
                     f"view_tokens.jsonl {tokens_mb:.1f} MB"))
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
