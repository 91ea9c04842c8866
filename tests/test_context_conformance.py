"""Context policies on the real chat templates of every family in tests/templates (offline tokenizers), with a tool
call in the family's own format, under both thinking_retention values: trained ids = sampled ids, every prompt =
the engine's input, every kept observation (or its placeholder, or the summary) in the next prompt, and with
`all` every sampled turn that stays in the context exactly as sampled."""

from __future__ import annotations

import pytest
from family_tokenizers import FAMILIES, family_tokenizer
from test_conformance import CALL_IDS, TOOL_CALLS, TOOLS, _script

from skyrl_stepwise.chat import create_renderer
from skyrl_stepwise.chat.base import rendered_forms
from skyrl_stepwise.envs.base import EnvRegistry, StepResult
from skyrl_stepwise.generator import GeneratorConfig, GeneratorSamplingConfig, StepwiseGenerator, TrajectoryID
from skyrl_stepwise.generator.config import ContextConfig
from skyrl_stepwise.inference.scripted import ScriptedEngine

PROMPT = [{"role": "system", "content": "You are a careful assistant."},
          {"role": "user", "content": "What is 2+3, and who painted the Mona Lisa?"}]
TURNS = 5
FILLER = "lorem ipsum dolor " * 12


class LongToolEnv:
    """A tool result after the tool call, long user observations after; done after TURNS actions."""

    tool_schemas = TOOLS

    def __init__(self, family: str) -> None:
        self.family, self.n = family, 0

    async def reset(self, prompt, extras):
        return list(prompt)

    async def step(self, action_text):
        self.n += 1
        if self.n >= TURNS:
            return StepResult([], 1.0, True)
        if "calculator" in action_text:
            return StepResult([{"role": "tool", "content": f"RES-{self.n} 5 {FILLER}", "name": "calculator",
                                "tool_call_id": CALL_IDS.get(self.family, "call_0")}], 0.0, False)
        return StepResult([{"role": "user", "content": f"OBS-{self.n} {FILLER}"}], 0.0, False)


POLICIES = {"truncate": dict(max_observation_tokens=12), "sliding_window": dict(window=1),
            "summarize": dict(summarize_threshold=1)}  # fires whenever it can (the threshold is on the prompt)


def _in(text: str, needle: str) -> bool:
    return any(form in text for form in rendered_forms(needle))


def _head(family: str, n: int) -> str:
    return f"{'RES' if n == 1 and family in TOOL_CALLS else 'OBS'}-{n}"


def _contains(seq, sub):
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("retention", ["template", "all"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
async def test_context_policy_conformance(family, retention, policy):
    spec, tok = FAMILIES[family], family_tokenizer(family)
    kwargs = dict(spec.render_kwargs)
    chat = create_renderer(tok, "auto", kwargs, retention)
    turns = _script(family, tok, chat.close_id)
    # a tool call (or a plain turn) first, then closed plain turns (summary turns included)
    engine = ScriptedEngine(lambda prompt, session, index: turns(prompt, session, 0 if index == 0 else 3), tok)
    registry = EnvRegistry()
    registry.register("long", lambda: LongToolEnv(family))
    cfg = GeneratorConfig(max_turns=TURNS, max_input_length=8192, show_progress=False, thinking_retention=retention,
                          chat_template_kwargs=kwargs, context=ContextConfig(policy=policy, max_summaries=2,
                                                                             **POLICIES[policy]),
                          sampling=GeneratorSamplingConfig(max_generate_length=48))
    gen = StepwiseGenerator(tokenizer=tok, engine=engine, env_registry=registry, cfg=cfg)
    out = await gen.generate([PROMPT], ["long"], [{}], [TrajectoryID("q", 0)])
    m = out.rollout_metrics
    assert m["generate/failed_trajectories"] == 0, m
    assert m["context/fires_per_trajectory"] > 0, (family, policy, m)
    summaries = m["context/summaries"]
    assert len(out) == TURNS + summaries
    summary_steps = {e["before_step"] - 1 for e in out.context_events if e["kind"] == "summary"}
    assert len(summary_steps) == summaries == (2 if policy == "summarize" else 0)
    obs_index = 0
    for i in range(len(out)):
        assert out.prompt_token_ids[i] == engine.calls[i][1], f"{family} step {i}: prompt is not the engine input"
        trained = [t for t, k in zip(out.response_ids[i], out.loss_masks[i]) if k]
        assert trained == engine.sampled[i], f"{family} step {i}: trained ids differ from sampled ids"
        if i == len(out) - 1:
            break
        text = chat.decode(out.prompt_token_ids[i + 1])
        if i in summary_steps:  # restarted: the summary, not the observations, and the task
            assert "Mona Lisa" in text and "OBS-" not in text and "RES-" not in text, (family, text[-300:])
            if retention == "all":
                assert _contains(out.prompt_token_ids[i + 1], out.response_ids[i][:len(engine.sampled[i])])
            continue
        obs_index += 1
        head = _head(family, obs_index)
        assert _in(text, head), f"{family} {policy}: observation {obs_index} lost"
        if policy == "truncate":
            assert _in(text, "tokens cut ...]")
        if policy == "sliding_window" and obs_index > 1:
            assert "older observation removed" in text and not _in(text, _head(family, obs_index - 1) + " ")
        if retention == "all":  # every sampled turn in the context stays exactly as sampled
            start = max((s for s in summary_steps if s < i), default=-1) + 1
            for j in range(start, i + 1):
                assert _contains(out.prompt_token_ids[i + 1], engine.sampled[j]), (family, policy, i, j)
    if retention == "all":
        assert m["generate/bridge_fallbacks"] == 0 and m["context/rerenders"] == 0, (family, m)
