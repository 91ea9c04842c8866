"""The python-tool task: generated problems are deterministic with disjoint splits, the env pays exactly the solved
answer (graded on the host, the expected value never in the sandbox), and every demonstration earns 1 through it."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from sandbox_helpers import require_sandbox
from skyrl_stepwise.chat.base import ParsedTurn, ToolCallRequest
from skyrl_stepwise.data import python_tool as data
from skyrl_stepwise.data.python_tool import TaskSpec, parse_spec, problems, split_of, task_rows
from skyrl_stepwise.envs.python_tool import PythonToolEnv, answer_matches, from_output


# ---------------------------------------------------------------------------------------------- data (no sandbox)

def test_rows_are_deterministic_from_the_seed_and_differ_across_seeds():
    spec = TaskSpec("train", 64, 3)
    assert task_rows(spec) == task_rows(spec)
    assert [r["extra_info"]["question"] for r in task_rows(spec)] != \
        [r["extra_info"]["question"] for r in task_rows(TaskSpec("train", 64, 4))]


def test_splits_are_disjoint_whatever_their_seeds_and_the_answer_stays_out_of_the_prompt():
    train = {p.question for seed in (0, 1) for p in problems(TaskSpec("train", 300, seed))}
    validation = {p.question for seed in (0, 1) for p in problems(TaskSpec("validation", 150, seed))}
    demos = {p.question for p in problems(TaskSpec("demos", 100, 0))}
    assert not train & validation and not demos & validation
    assert {split_of(q) for q in validation} == {"validation"} and {split_of(q) for q in train | demos} == {"train"}
    for row in task_rows(TaskSpec("validation", 40, 0)):
        answer = row["reward_spec"]["answer"]
        assert row["env_class"] == "python_tool" and answer
        assert all(answer not in m["content"] for m in row["prompt"] if row["reward_spec"]["kind"] != "count")


def test_train_is_sampled_easy_to_hard_and_validation_mixes_the_levels_evenly():
    levels = [p.level for p in problems(TaskSpec("train", 240, 0))]
    first, last = levels[:80], levels[-80:]
    assert first.count(1) > 3 * max(first.count(3), 1) and last.count(3) > 3 * max(last.count(1), 1)
    val = [p.level for p in problems(TaskSpec("validation", 120, 0))]
    assert val.count(1) == val.count(2) == val.count(3) == 40
    assert {p.kind for p in problems(TaskSpec("validation", 8, 0))} == set(data.KINDS)


def test_each_problem_s_program_computes_its_answer():
    """The demonstration programs print the expected value (run here on the host: our own generated code)."""
    import contextlib
    import io

    for p in problems(TaskSpec("validation", 24, 5)):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(p.code, {})  # noqa: S102 - our own one-line program
        assert out.getvalue().strip() == p.answer, p


def test_spec_parsing_names_the_key_and_the_form():
    assert parse_spec("python_tool:validation:128:2", "data.val_path") == TaskSpec("validation", 128, 2)
    assert parse_spec("python_tool:train", "k") == TaskSpec("train", 256, 0)
    for bad, match in (("python_tool:test:1:1", "SPLIT one of"), ("python_tool:train:x", "integers"),
                       ("python_tool:train:0", "positive")):
        with pytest.raises(ValueError, match=match):
            parse_spec(bad, "data.train_path")
    with pytest.raises(ValueError, match="sft.data"):
        data.cached_task_file(TaskSpec("demos", 4, 0))


def test_grading_is_exact_and_answer_from_output_reads_lines():
    """Attacks on the comparison: near misses, hedged lists, a sign, a prefix, an empty or missing answer, case."""
    assert answer_matches(" 'cba' ", "cba") and answer_matches("10695", "10695")
    for wrong in ("10694", "10695 or 10696", "10695, 10696", "-10695", "1069", "", None, "CBA"):
        assert not answer_matches(wrong, "10695" if wrong != "CBA" else "cba"), wrong
    assert from_output("7", ["3\n7\n"]) and from_output("a b", ["a b"]) and not from_output("7", ["17"])
    assert not from_output("", ["", "x"]) and not from_output(None, ["7"])


def test_the_recipe_composes_with_the_generated_data(tmp_path, monkeypatch):
    from skyrl_stepwise.run.app_config import load_config
    from skyrl_stepwise.run.setup import _datasets

    monkeypatch.setenv("SKYRL_STEPWISE_CACHE", str(tmp_path))
    cfg = load_config(["experiment=python_tool_tiny", "data.train_path=python_tool:train:12:0",
                       "data.val_path=python_tool:validation:6:0"])
    assert cfg.environment.env_classes == {"python_tool": "skyrl_stepwise.envs.python_tool:PythonToolEnv"}
    assert cfg.sft.enabled and cfg.sft.data.startswith("python_tool:demos:") and not cfg.data.shuffle
    # float32 on every host: in bfloat16 its RL did not move the greedy policy (docs/python-tool.md)
    assert cfg.engine.dtype == "float32" and not cfg.trainer.fsdp.mixed_precision
    train, val = _datasets(cfg)
    assert (len(train), len(val)) == (12, 6) and not {r.instance_id for r in train} & {r.instance_id for r in val}
    assert train[0].reward_spec["answer"] == task_rows(TaskSpec("train", 12, 0))[0]["reward_spec"]["answer"]


# ------------------------------------------------------------------------------------------- the env (sandbox)

async def _episode(row, codes: list[str], final: str) -> tuple[float, dict, list]:
    env = PythonToolEnv()
    observations = []
    try:
        await env.reset(row["prompt"], row)
        for i, code in enumerate(codes):
            step = await env.step_turn(ParsedTurn("", tool_calls=[ToolCallRequest("python", {"code": code},
                                                                                  id=str(i))]))
            assert not step.done
            observations += [o["content"] for o in step.observations]
        last = await env.step_turn(ParsedTurn(final))
        assert last.done
        return last.reward, last.metrics, observations
    finally:
        await env.aclose()


@pytest.fixture(scope="module")
def row():
    require_sandbox()
    return task_rows(TaskSpec("validation", 9, 0))[8]  # level 3 arithmetic: a 6-7 digit answer


def test_the_solved_answer_pays_1_and_counts_as_from_output(row):
    code = problems(TaskSpec("validation", 9, 0))[8].code
    reward, metrics, outs = asyncio.run(_episode(row, [code], ""))  # ran it, but gave no answer
    assert reward == 0.0 and metrics["answered"] == 0.0
    reward, metrics, outs = asyncio.run(_episode(row, [code], f"<answer>{row['reward_spec']['answer']}</answer>"))
    assert outs == [row["reward_spec"]["answer"]]
    assert reward == 1.0 and metrics["answer_from_output"] == 1.0 and metrics["python_tool/solved"] == 1.0


def test_attacks_earn_nothing_and_a_guess_without_a_run_is_not_from_output(row):
    expected = int(row["reward_spec"]["answer"])
    # a near miss that a run printed: from the output, but not the answer (the other attacks: the grading test above)
    reward, metrics, _ = asyncio.run(_episode(row, [f"print({expected + 1})"], f"<answer>{expected + 1}</answer>"))
    assert reward == 0.0 and metrics["answer_from_output"] == 1.0
    # the right value typed without running it is paid (it IS the answer), and shows as not read from a run
    reward, metrics, _ = asyncio.run(_episode(row, [], f"<answer>{expected}</answer>"))
    assert reward == 1.0 and metrics["answer_from_output"] == 0.0


def test_the_expected_answer_never_enters_the_sandbox(row):
    """What the model's code can read (its files, environment, arguments, /proc of its whole PID namespace, /tmp)
    does not hold the expected value: only the comparison on the host knows it."""
    snoop = ("import os\nopen('planted.txt', 'w').write('PLANTED' + 'MARK')\nout = [repr(dict(os.environ))]\n"
             "for top in ('.', '/tmp', '/proc'):\n"
             "    for root, dirs, files in os.walk(top):\n"
             "        if root.startswith('/proc/') and not root.split('/')[2].isdigit(): dirs[:] = []; continue\n"
             "        for f in files:\n"
             "            p = os.path.join(root, f)\n"
             "            if root.startswith('/proc') and f not in ('cmdline', 'environ'): continue\n"
             "            try: out.append(open(p, 'rb').read(1 << 16).decode('latin-1'))\n"
             "            except Exception: pass\n"
             f"print(sum(s.count({row['reward_spec']['answer']!r}) for s in out), len(out),\n"
             "      sum(s.count('PLANTEDMARK') for s in out))\n")
    _, _, outs = asyncio.run(_episode(row, [snoop], "<answer>0</answer>"))
    found, read, planted = outs[0].split()
    assert found == "0" and int(read) > 3 and planted == "1", outs  # the walk does read the sandbox's own files


def test_every_demonstration_earns_1_through_the_env_and_is_cached(tmp_path):
    require_sandbox()
    from skyrl_stepwise.data.demonstrations import load_conversations
    from skyrl_stepwise.data.python_tool_demos import cached_demos_file

    spec = TaskSpec("demos", 2, 0)
    path = cached_demos_file(spec, tmp_path)
    assert cached_demos_file(spec, tmp_path) == path and "-2-0-" in path.name
    conversations = load_conversations(path)
    assert len(conversations) == 2
    for conv, p in zip(conversations, problems(spec)):
        call = json.loads(conv[2]["tool_calls"][0]["function"]["arguments"])
        assert call == {"code": p.code} and conv[3] == {"role": "tool", "tool_call_id": "call_0", "name": "python",
                                                         "content": p.answer}
        assert conv[4] == {"role": "assistant", "content": f"<answer>{p.answer}</answer>"}
    import pyarrow.parquet as pq
    assert pq.read_table(path, columns=["reward"]).column("reward").to_pylist() == [1.0] * 2


@pytest.mark.integration  # the tokenizer and the generator: > 2 s on a loaded 2-core box (~4 s here)
def test_a_demonstration_replayed_by_the_scripted_engine_earns_1(tokenizer, row):
    """SFT's rendering of a demonstration, sampled back through the real generator and env: the calls parse from
    the ids, the tool runs in the sandbox, the answer is paid 1 and counted as read from the run."""
    from skyrl_stepwise.data.python_tool_demos import play_demo
    from skyrl_stepwise.envs.base import EnvRegistry
    from skyrl_stepwise.generator import StepwiseGenerator, TrajectoryID
    from skyrl_stepwise.inference.scripted import ScriptedEngine
    from skyrl_stepwise.loop.sft import assistant_turn_ids, sft_renderer
    from skyrl_stepwise.run.app_config import load_config

    cfg = load_config(["experiment=python_tool_tiny"]).generator
    demo = asyncio.run(play_demo(row, problems(TaskSpec("validation", 9, 0))[8].code))
    conversation = demo["messages"]
    chat = sft_renderer(tokenizer, cfg)
    tools = PythonToolEnv().tool_schemas
    turns = [assistant_turn_ids(chat, conversation, j, tools) for j, m in enumerate(conversation)
             if m["role"] == "assistant"]
    engine = ScriptedEngine(lambda prompt, session, index: turns[index], tokenizer)
    registry = EnvRegistry()
    registry.register("python_tool", PythonToolEnv)
    generator = StepwiseGenerator(tokenizer, engine, registry,
                                  dataclasses.replace(cfg, n_samples_per_prompt=1, show_progress=False))
    extras = {k: row[k] for k in ("reward_spec", "extra_info", "data_source", "instance_id")}
    out = asyncio.run(generator.generate([row["prompt"]], ["python_tool"], [extras], [TrajectoryID("0", 0)]))
    assert not out.failed_trajectory_ids
    final = out.rewards[-1]
    assert (final[-1] if isinstance(final, list) else final) == 1.0
    assert out.rollout_metrics["environment/answer_from_output"] == 1.0
    assert out.rollout_metrics["environment/tool_calls"] == 1.0
