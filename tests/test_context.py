"""Context policies (generator/context.py) on the real SmolLM2 tokenizer and template with a scripted engine:
config refused at start-up, what each policy keeps, limits with stop reasons of their own and the env hook, a
plugin error contained to its trajectory, merging across an edit, and a trajectory's weight however it was cut."""

from __future__ import annotations

import pytest

from skyrl_stepwise.envs.base import EnvRegistry, StepResult
from skyrl_stepwise.generator import GeneratorConfig, GeneratorSamplingConfig, StepwiseGenerator, TrajectoryID
from skyrl_stepwise.generator.config import ContextConfig
from skyrl_stepwise.generator.merge import merge_stepwise_output
from skyrl_stepwise.inference.scripted import ScriptedEngine

PROMPT = [{"role": "system", "content": "You are a search agent."},
          {"role": "user", "content": "Find the answer."}]


class LongEnv:
    """Each observation is ~240 tokens and unique (OBS-n); done after `turns` actions. Records hook calls."""

    def __init__(self, turns: int = 6, boom: bool = False, terminal: float | None = None):
        self.turns, self.n, self.boom, self.terminal, self.told = turns, 0, boom, terminal, []

    async def reset(self, prompt, extras):
        return list(prompt)

    async def step(self, action_text):
        self.n += 1
        done = self.n >= self.turns
        content = f"OBS-{self.n} " + ("BOOM " if self.boom else "") + "lorem ipsum dolor " * 33
        return StepResult([] if done else [{"role": "user", "content": content}], 1.0 if done else 0.0, done)

    def on_context_exhausted(self, reason):
        self.told.append(reason)
        return self.terminal


class BoomPolicy:
    """A plugin that raises on a trajectory whose observations say BOOM."""

    name = "boom"

    def __init__(self, cfg):
        self.cfg = cfg

    def between_turns(self, view):
        if any("BOOM" in m["content"] for t in view.turns for m in t.observations):
            raise RuntimeError("boom")
        return None


def make(tokenizer, context: ContextConfig, envs=None, turns=6, max_input_length=4096, **kw):
    cfg = GeneratorConfig(max_turns=turns, max_input_length=max_input_length, show_progress=False,
                          thinking_retention="all", context=context,
                          sampling=GeneratorSamplingConfig(max_generate_length=32), **kw)
    envs = [] if envs is None else envs
    registry = EnvRegistry()
    registry.register("long", lambda: envs.append(LongEnv(turns)) or envs[-1])
    registry.register("boom", lambda: envs.append(LongEnv(turns, boom=True)) or envs[-1])
    eos = tokenizer.eos_token_id
    engine = ScriptedEngine(lambda p, s, i: tokenizer(f"Answer {i}: noted.", add_special_tokens=False)["input_ids"]
                            + [eos], tokenizer)
    return StepwiseGenerator(tokenizer, engine, registry, cfg), engine, envs


async def run(gen, classes=("long",)):
    ids = [TrajectoryID("q", i) for i in range(len(classes))]
    return await gen.generate([PROMPT] * len(classes), list(classes), [{}] * len(classes), ids)


def test_bad_context_config_is_refused_naming_the_key():
    for context, key in ((ContextConfig(policy="windowed"), "generator.context.policy"),
                         (ContextConfig(policy="summarize", summarize_threshold=5000), "summarize_threshold"),
                         (ContextConfig(policy="no_such_module_xyz:Policy"), "generator.context.policy"),
                         (ContextConfig(policy="test_context:LongEnv"), "between_turns"),
                         (ContextConfig(policy="truncate", max_observation_tokens=0), "max_observation_tokens")):
        with pytest.raises(ValueError, match=key):
            GeneratorConfig(max_input_length=4096, context=context).validate()
    with pytest.raises(ValueError, match="use_conversation_multi_turn"):
        GeneratorConfig(use_conversation_multi_turn=False, context=ContextConfig(policy="truncate")).validate()
    GeneratorConfig(context=ContextConfig(policy="test_context:BoomPolicy")).validate()  # a real plugin loads


async def test_truncate_caps_each_observation_without_breaking_the_chain(tokenizer):
    gen, engine, _ = make(tokenizer, ContextConfig(policy="truncate", max_observation_tokens=20))
    out = await run(gen)
    m = out.rollout_metrics
    assert len(out) == 6 and m["generate/chain_breaks"] == 0 and m["context/edits"] == 0
    for i in range(5):
        text = tokenizer.decode(out.prompt_token_ids[i + 1][len(out.prompt_token_ids[i]) + len(out.response_ids[i]):])
        assert f"OBS-{i + 1}" in text and "tokens cut" in text  # head kept, the marker says how much went
        assert len(tokenizer(text)["input_ids"]) < 60  # ~240-token observation capped at 20 + marker + template
    assert m["context/fires_per_trajectory"] == 5 and m["context/tokens_dropped"] > 5 * 70
    assert [e["kind"] for e in out.context_events] == ["truncate"] * 5


async def test_sliding_window_keeps_the_last_observations_exactly(tokenizer):
    gen, engine, _ = make(tokenizer, ContextConfig(policy="sliding_window", window=2))
    out = await run(gen)
    m = out.rollout_metrics
    assert len(out) == 6 and m["generate/failed_trajectories"] == 0
    for i, (prompt, (_, sent)) in enumerate(zip(out.prompt_token_ids, engine.calls)):
        assert prompt == sent  # every prompt is exactly the engine's input
        trained = [t for t, k in zip(out.response_ids[i], out.loss_masks[i]) if k]
        assert trained == engine.sampled[i]
        text = tokenizer.decode(prompt)
        kept = {f"OBS-{j}" for j in range(max(i - 1, 1), i + 1)}  # the last 2 turns' observations
        assert all(k in text for k in kept) and not any(f"OBS-{j} " in text for j in range(1, max(i - 1, 1)))
        assert text.count("[older observation removed:") == max(i - 2, 0)
        for j in range(i):  # every sampled turn stays in the context exactly as sampled
            assert _contains(prompt, out.response_ids[j])
    assert m["context/edits"] == 3 and m["context/rerenders"] == 0 and m["generate/bridge_fallbacks"] == 0
    merged = merge_stepwise_output(out)
    assert len(merged) == 1 + 3  # a new chain at each edit, nothing merged across one
    assert [t for r, k in zip(merged.response_ids, merged.loss_masks) for t, b in zip(r, k) if b] == \
        [t for s in engine.sampled for t in s]


def _contains(seq, sub):
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


@pytest.mark.parametrize("train_summaries", [True, False])
async def test_summarize_restarts_from_task_and_the_summary_as_sampled(tokenizer, train_summaries):
    first = len(tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True))
    ctx = ContextConfig(policy="summarize", summarize_threshold=first + 250, train_summaries=train_summaries)
    gen, engine, _ = make(tokenizer, ctx)
    out = await run(gen)
    m = out.rollout_metrics
    kinds = ["summary" if "Summarise" in tokenizer.decode(p[-60:]) else "action" for p in out.prompt_token_ids]
    assert m["context/summaries"] == kinds.count("summary") >= 2 and len(out) == 6 + kinds.count("summary")
    for i, kind in enumerate(kinds):
        assert out.prompt_token_ids[i] == engine.calls[i][1]
        assert len(out.prompt_token_ids[i]) <= 4096
        trained = [t for t, k in zip(out.response_ids[i], out.loss_masks[i]) if k]
        assert trained == (engine.sampled[i] if train_summaries or kind == "action" else [])
        if kind == "summary":  # the next prompt: first messages + the summary exactly as sampled + resume
            nxt = out.prompt_token_ids[i + 1]
            assert nxt[:first] == out.prompt_token_ids[0][:first] and _contains(nxt, engine.sampled[i])
            assert "OBS-" not in tokenizer.decode(nxt) and "Continue the task" in tokenizer.decode(nxt)
    merged = merge_stepwise_output(out)
    assert len(merged) == 1 + kinds.count("summary")  # each restart starts a new chain
    assert [e["kind"] for e in out.context_events] == ["summary"] * kinds.count("summary")


async def test_limits_have_stop_reasons_of_their_own_and_the_env_is_told(tokenizer):
    envs = []
    gen, _, _ = make(tokenizer, ContextConfig(), envs=envs, max_input_length=300)
    envs_terminal = envs
    gen.env_registry = EnvRegistry()
    gen.env_registry.register("long", lambda: envs_terminal.append(LongEnv(6, terminal=-0.5)) or envs_terminal[-1])
    out = await run(gen)
    assert out.stop_reasons[-1] == "context_exhausted" and "length" not in out.stop_reasons
    assert envs[0].told == ["context_exhausted"] and out.trajectory_rewards()[-1] == -0.5
    assert out.rollout_metrics["context/exhausted_trajectories"] == 1
    assert out.response_ids[-1][-1] == tokenizer.eos_token_id  # the model closed it: nothing appended

    envs = []
    gen, _, _ = make(tokenizer, ContextConfig(token_budget=700), envs=envs)
    out = await run(gen)
    assert out.stop_reasons[-1] == "budget_exhausted" and envs[0].told == ["budget_exhausted"]
    assert 2 <= len(out) < 6 and out.rollout_metrics["context/budget_exhausted_trajectories"] == 1

    gen, _, _ = make(tokenizer, ContextConfig(token_budget=700, mask_limit_stops=True))
    out = await run(gen)
    assert all(sum(m) == 0 for m in out.loss_masks)  # SUPO-style: cut by a limit, no gradient
    assert out.rollout_metrics["generate/overlong_filtered_trajectories"] == 1


async def test_plugin_error_fails_only_its_trajectory(tokenizer):
    gen, _, _ = make(tokenizer, ContextConfig(policy="test_context:BoomPolicy"))
    out = await run(gen, ("long", "boom"))
    m = out.rollout_metrics
    assert m["generate/failed_trajectories/context_policy"] == 1 and m["generate/num_trajectories"] == 1
    assert out.failed_trajectory_ids == [TrajectoryID("q", 1)] and len(out) == 6


async def test_a_trajectory_weighs_the_same_however_it_was_cut(tokenizer):
    from skyrl_stepwise.algorithms.advantages import loss_weights
    from skyrl_stepwise.algorithms.credit import compute_advantages
    from skyrl_stepwise.policy.config import AlgorithmConfig

    first = len(tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True))
    cfg = AlgorithmConfig(loss_reduction="trajectory_mean")
    for ctx in (ContextConfig(), ContextConfig(policy="summarize", summarize_threshold=first + 250),
                ContextConfig(policy="sliding_window", window=1)):
        gen, _, _ = make(tokenizer, ctx)
        out = await run(gen, ("long", "long"))
        out.rewards = [[0.0] * (len(r) - 1) + [float(i % 2 == 0 and j == len(out) - 1)]
                       for j, (i, r) in enumerate(zip(range(len(out)), out.response_ids))]
        for merged in (out, merge_stepwise_output(out)):
            weights = loss_weights(merged, cfg)
            for tid in {t for t in merged.trajectory_ids}:
                total = sum(w * k for t, ws, ks in zip(merged.trajectory_ids, weights, merged.loss_masks)
                            if t == tid for w, k in zip(ws, ks))
                assert total == pytest.approx(1.0), (ctx.policy, len(merged))
            advantages = compute_advantages(merged, cfg)
            for tid in set(merged.trajectory_ids):  # every segment carries its trajectory's outcome
                values = {round(a, 6) for t, adv, ks in zip(merged.trajectory_ids, advantages, merged.loss_masks)
                          if t == tid for a, k in zip(adv, ks) if k}
                assert len(values) == 1, (ctx.policy, values)


async def test_show_and_rollouts_mark_where_the_context_was_edited(tokenizer):
    from skyrl_stepwise.chat import create_renderer
    from skyrl_stepwise.loop.rollout_samples import format_sample, rollout_samples

    gen, _, _ = make(tokenizer, ContextConfig(policy="sliding_window", window=2))
    out = await run(gen)
    samples = rollout_samples(out, create_renderer(tokenizer, "auto", {}, "all"), step=1, stage="train", n=1)
    events = samples[0].context_events
    assert [e["before_step"] for e in events] == [3, 4, 5] and all(e["tokens_dropped"] > 100 for e in events)
    text = format_sample(__import__("dataclasses").asdict(samples[0]))
    assert "[context edit by sliding_window before model turn 4:" in text and "placeholders" in text



def _report(ctx: ContextConfig, run_dir, steps: list[dict], max_input_length: int = 4096) -> str:
    """report.md of a run with this context config whose steps logged these rollout metrics."""
    from skyrl_stepwise.run.config import RunConfig
    from skyrl_stepwise.run.report import write_run_report
    from skyrl_stepwise.loop.tracking import Tracker

    cfg = RunConfig()
    cfg.total_steps, cfg.trainer.ckpt_dir = len(steps), str(run_dir / "ckpts")
    cfg.generator.context, cfg.generator.max_input_length = ctx, max_input_length
    tracker = Tracker(run_dir, "p", "r", "disabled", {})
    for step, metrics in enumerate(steps, 1):
        tracker.log(dict(metrics), step)
    tracker.finish()
    return write_run_report(cfg, run_dir).read_text()


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
async def test_a_policy_that_never_fires_says_so_in_the_report(tokenizer, tmp_path):
    """context/fires_per_trajectory = 0 alone goes unnoticed: report.md says in words that the run was policy=none,
    and why (the key whose threshold was never reached); a policy that fired says how often."""
    async def steps(ctx: ContextConfig, n: int = 2, **kw) -> list[dict]:
        out = []
        for _ in range(n):  # one generate per step: real rollout metrics of this policy
            gen, _, _ = make(tokenizer, ctx, **kw)
            out.append((await run(gen)).rollout_metrics)
        return out

    quiet = ContextConfig(policy="truncate", max_observation_tokens=1000)  # ~240-token observations: never cut
    logged = await steps(quiet)
    assert all(m["context/fires_per_trajectory"] == 0 for m in logged)
    text = _report(quiet, tmp_path / "quiet", logged)
    assert "**The context policy `truncate` never fired on this run** (`context/fires_per_trajectory` = 0 on all " \
           "2 steps): no observation was longer than `max_observation_tokens`=1000" in text
    assert "trained exactly as with `generator.context.policy=none`" in text

    first = len(tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True))
    never = ContextConfig(policy="summarize", summarize_threshold=4000)  # 6 turns of ~240 tokens stay below it
    text = _report(never, tmp_path / "never", await steps(never, 1))
    assert "**The context policy `summarize` never fired on this run**" in text and "threshold of 4000" in text

    loud = ContextConfig(policy="summarize", summarize_threshold=first + 250)
    logged = await steps(loud, 1)
    text = _report(loud, tmp_path / "loud", logged)
    assert "never fired" not in text
    assert logged[0]["context/summaries"] >= 2
    assert f"The context policy `summarize` fired on 1 of 1 steps: {logged[0]['context/edits']} edits (each starts " \
           f"a new step chain), {logged[0]['context/summaries']} summaries" in text

    logged = await steps(ContextConfig(), 1, max_input_length=300)  # none: the trajectory runs out of context
    text = _report(ContextConfig(), tmp_path / "none", logged, max_input_length=300)
    assert "1 trajectories ran out of context (`context_exhausted`) over 1 steps with " \
           "`generator.context.policy=none`" in text
    assert "## Context" not in _report(ContextConfig(), tmp_path / "fits", await steps(ContextConfig(), 1))


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _assert_trie_shares_exactly_the_common_prefixes(seqs: list[list[int]]):
    """Under packing=tree two samples share a node iff they share the whole prefix up to it: the first lcp nodes
    are the same nodes, the next ones differ; and a row forwards each distinct prefix once."""
    from skyrl_stepwise.policy.tree import build_trie, unique_tokens

    trie = build_trie(seqs)
    for a in range(len(seqs)):
        for b in range(a + 1, len(seqs)):
            n = _lcp(seqs[a], seqs[b])
            na, nb = trie.sample_nodes[a], trie.sample_nodes[b]
            assert na[:n] == nb[:n], (a, b, n)
            assert n == min(len(na), len(nb)) or na[n] != nb[n], (a, b, n)
    prefixes = {tuple(s[:k + 1]) for s in seqs for k in range(len(s))}
    assert unique_tokens(seqs) == len(trie) == len(prefixes)
    return trie


@pytest.mark.parametrize("policy", ["summarize", "sliding_window"])
async def test_edited_segments_share_the_prompt_in_the_tree_and_merging_restarts_at_each_edit(tokenizer, policy):
    """Issue 37 item 4: the segments of an edited trajectory (and of its group) share the trie nodes of the system
    prompt and task under trainer.packing=tree, every pair exactly up to its common prefix; merging starts a new
    chain at each edit (summary restart or window edit) and nowhere else."""
    from skyrl_stepwise.generator.merge import trajectory_ranges

    first = len(tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True))
    ctx = (ContextConfig(policy="summarize", summarize_threshold=first + 250) if policy == "summarize"
           else ContextConfig(policy="sliding_window", window=1))
    gen, _, _ = make(tokenizer, ctx)
    out = await run(gen, ("long", "boom"))  # one group, two trajectories whose observations differ
    seqs = [p + r for p, r in zip(out.prompt_token_ids, out.response_ids)]
    breaks = [e for e in out.context_events if e["kind"] in ("edit", "summary")]
    assert len(breaks) >= 4 and {e["trajectory"] for e in breaks} == {"q_0", "q_1"}

    trie = _assert_trie_shares_exactly_the_common_prefixes(seqs)
    # every segment, before or after an edit, of either trajectory, starts on the same `first` nodes
    assert all(nodes[:first] == trie.sample_nodes[0][:first] for nodes in trie.sample_nodes)
    assert len(trie) <= sum(map(len, seqs)) - (len(seqs) - 1) * first

    merged = merge_stepwise_output(out)
    ranges = dict(zip((out.trajectory_ids[s].key() for s, _ in trajectory_ranges(out)), trajectory_ranges(out)))
    expected_prompts = []
    for key, (start, _) in ranges.items():
        starts = sorted({0} | {e["before_step"] for e in breaks if e["trajectory"] == key})
        expected_prompts += [out.prompt_token_ids[start + s] for s in starts]
    assert len(merged) == len(ranges) + len(breaks) == len(expected_prompts)
    assert merged.prompt_token_ids == expected_prompts  # a chain starts at the first step and at each edit only
    for key in ranges:  # nothing fabricated: each trajectory's trained ids are its steps' trained ids, in order
        def trained(o):
            return [t for tid, r, k in zip(o.trajectory_ids, o.response_ids, o.loss_masks) if tid.key() == key
                    for t, b in zip(r, k) if b]
        assert trained(merged) == trained(out) and len(trained(out)) > 0
    merged_seqs = [p + r for p, r in zip(merged.prompt_token_ids, merged.response_ids)]
    merged_trie = _assert_trie_shares_exactly_the_common_prefixes(merged_seqs)
    assert all(nodes[:first] == merged_trie.sample_nodes[0][:first] for nodes in merged_trie.sample_nodes)
