"""Generator CPU time per trajectory vs number of turns, `history: exact` vs `retokenize`.

The engine is scripted and instant, so the time measured is the generator's own work (templates,
tokenization, bookkeeping). Exact history should grow linearly in turns; re-tokenizing the whole
chat every turn grows quadratically.
"""

from __future__ import annotations

import asyncio
import time

from skyrl_stepwise.envs.base import EnvRegistry, StepResult
from skyrl_stepwise.generator import GeneratorConfig, GeneratorSamplingConfig, StepwiseGenerator, TrajectoryID
from skyrl_stepwise.inference.scripted import ScriptedEngine
from skyrl_stepwise.models.prepare import prepare_model

OBSERVATION = ("<information>Doc 1(Title: \"Leonardo da Vinci\") Leonardo di ser Piero da Vinci was an Italian "
               "polymath of the High Renaissance who was active as a painter, draughtsman, engineer.</information>")
ACTION = "<think>I need more facts about this painting.</think>\n<search> who painted the Mona Lisa </search>"
TRAJECTORIES = 8


class FixedTurnsEnv:
    def __init__(self, turns: int) -> None:
        self.turns, self.n = turns, 0

    async def reset(self, prompt_messages, extras):
        return list(prompt_messages)

    async def step(self, action_text):
        self.n += 1
        done = self.n >= self.turns
        return StepResult([] if done else [{"role": "user", "content": OBSERVATION}], float(done), done)


def seconds_per_trajectory(tokenizer, turns: int, history: str) -> float:
    action_ids = tokenizer(ACTION, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    registry = EnvRegistry()
    registry.register("fixed", lambda: FixedTurnsEnv(turns))
    cfg = GeneratorConfig(max_turns=turns, max_input_length=1_000_000, history=history, show_progress=False,
                          sampling=GeneratorSamplingConfig(max_generate_length=256))
    gen = StepwiseGenerator(tokenizer, ScriptedEngine(lambda p, s, i: action_ids, tokenizer), registry, cfg)
    prompt = [{"role": "user", "content": "Who painted the Mona Lisa?"}]
    ids = [TrajectoryID(f"q{i}", 0) for i in range(TRAJECTORIES)]
    start = time.process_time()
    asyncio.run(gen.generate([prompt] * TRAJECTORIES, ["fixed"] * TRAJECTORIES, [{}] * TRAJECTORIES, ids))
    return (time.process_time() - start) / TRAJECTORIES


def main() -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(prepare_model())
    seconds_per_trajectory(tokenizer, 2, "exact")  # warm-up: template compilation, caches
    print(f"generator CPU time per trajectory (ms), SmolLM2 tokenizer, {TRAJECTORIES} trajectories, instant engine\n")
    print("| turns | exact | retokenize | retokenize / exact | exact ms per turn |")
    print("|---:|---:|---:|---:|---:|")
    for turns in (2, 4, 8, 16):
        exact = seconds_per_trajectory(tokenizer, turns, "exact")
        retok = seconds_per_trajectory(tokenizer, turns, "retokenize")
        print(f"| {turns} | {exact * 1e3:.2f} | {retok * 1e3:.2f} | {retok / exact:.2f} | {exact * 1e3 / turns:.3f} |")


if __name__ == "__main__":
    main()
