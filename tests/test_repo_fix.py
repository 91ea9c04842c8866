"""The repo-fixing task set (data/repo_fix.py), its env (envs/repo_fix.py) and tools (tools/repo.py), with the real
bubblewrap sandbox: generated tasks are deterministic and sound (visible and hidden tests fail on the buggy package
and pass after the demonstration's fix), the tools stay in the working dir, the reward is the hidden tests, and a
demonstration replayed by the scripted engine through the generator earns 1 while a wrong fix does not."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import pytest

from sandbox_helpers import fake_calls, require_sandbox, use_fake_docker_backend
from skyrl_stepwise.chat.base import ParsedTurn, ToolCallRequest
from skyrl_stepwise.data import repo_fix as gen
from skyrl_stepwise.envs.grading import GRADE_COMMAND, grade_cases, task_sources
from skyrl_stepwise.envs.repo_fix import RepoFixEnv, RepoFixError, group_verdicts, parse_cases, reward_of
from skyrl_stepwise.sandbox import BwrapSandbox
from skyrl_stepwise.tools.repo import REPO_TOOLS

require_sandbox()
ROOT = Path(__file__).resolve().parents[1]


def _apply(sandbox: BwrapSandbox, edits: list[dict[str, str]]) -> None:
    for e in edits:
        text = sandbox.read_file(e["path"])
        assert text.count(e["old"]) == 1, e
        sandbox.write_file(e["path"], text.replace(e["old"], e["new"]))


def _task_sandbox(task: gen.Task) -> BwrapSandbox:
    sandbox = BwrapSandbox()
    for path, content in task.files.items():
        sandbox.write_file(path, content)
    return sandbox


def test_generation_is_deterministic_graded_and_splits_hold_out_bug_sites():
    a = [t.row() for t in gen.repo_fix_tasks("train", 12, seed=3)]
    assert a == [t.row() for t in gen.repo_fix_tasks("train", 12, seed=3)]
    assert a != [t.row() for t in gen.repo_fix_tasks("train", 12, seed=4)]
    train, val = gen.repo_fix_tasks("train", 60), gen.repo_fix_tasks("validation", 30)
    assert [t.difficulty for t in train[:6]] == [1, 2, 3, 1, 2, 3]
    assert all(len(t.sites) == (2 if t.difficulty == 3 else 1) for t in train + val)
    for t in train:
        assert not {s.id for s in t.sites} & gen.HELD_OUT_SITES
        assert 2 <= sum(p.endswith(".py") and "/" in p and not p.endswith("__init__.py") for p in t.files) <= 4
    for t in val:
        assert {s.id for s in t.sites} & gen.HELD_OUT_SITES
    level2 = [t for t in train if t.difficulty == 2]
    for t in level2:  # the failing test never names the buggy helper: it is one call away
        assert f"def test_{t.sites[0].function}(" not in t.files[t.test_file]
    for t in train + val:
        row = t.row()
        shown = json.dumps(row["prompt"]) + "".join(t.files.values())
        assert "hidden_" not in shown and row["reward_spec"]["cases"] == t.cases
        assert {c["group"] for c in t.cases} == {f"bug{k}" for k in range(len(t.sites))} | {"regression"}
    with pytest.raises(ValueError, match="split"):
        gen.repo_fix_tasks("test", 1)


def _state(sandbox: BwrapSandbox, task: gen.Task) -> tuple[str, dict[str, bool]]:
    """The visible test's output and the hidden verdict per group, graded as the env grades (a fresh sandbox
    holding the package's sources, the expected values on the host)."""
    result = sandbox.run(f"python3 {task.test_file} 2>&1; echo \"[exit $?]\"")
    cases = parse_cases(task.cases, task.instance_id)
    files, stray = task_sources(sandbox, [task.package])
    assert not stray
    return result.stdout.rstrip("\n"), group_verdicts(cases, grade_cases(files, cases))


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_every_task_fails_buggy_and_passes_after_the_fix():
    """Visible test and hidden tests, in the sandbox, for both splits and every difficulty (the generator itself
    refuses, in-process, any task whose bug no visible or hidden case notices: see _check_caught). The tasks run
    four at a time in threads, each in its own sandbox, as rollouts do."""
    from concurrent.futures import ThreadPoolExecutor

    tasks = gen.repo_fix_tasks("train", 3) + gen.repo_fix_tasks("validation", 3)
    with ThreadPoolExecutor(4) as pool:
        assert len(list(pool.map(_fails_buggy_and_passes_after_the_fix, tasks))) == len(tasks) > 0


def _fails_buggy_and_passes_after_the_fix(task) -> None:
    with _task_sandbox(task) as sandbox:
        visible, verdict = _state(sandbox, task)
        assert visible.endswith("[exit 1]") and "Error" in visible, (task.instance_id, visible)
        assert reward_of(verdict)[0] == 0.0 and verdict["regression"], (task.instance_id, verdict)
        assert not any(v for k, v in verdict.items() if k.startswith("bug"))
        if task.difficulty == 3:  # one of two bugs fixed: the test still fails, half the reward
            _apply(sandbox, task.fix()[:1])
            visible, verdict = _state(sandbox, task)
            assert visible.endswith("[exit 1]") and reward_of(verdict)[0] == 0.5, (task.instance_id, verdict)
        _apply(sandbox, task.fix()[1:] if task.difficulty == 3 else task.fix())
        visible, verdict = _state(sandbox, task)
        assert visible == "all tests passed\n[exit 0]", (task.instance_id, visible)
        assert reward_of(verdict) == (1.0, len(task.sites), len(task.sites)), (task.instance_id, verdict)


def test_every_bug_site_is_noticed_by_visible_and_hidden_cases():
    """In-process (our own templates): each site's bug changes a visible case of its function and of each caller,
    and a hidden case of its group; a bug nothing notices is refused."""
    for site in gen.all_sites():
        module = gen.MODULES_BY_NAME[site.module]
        gen._check_caught(site, gen._namespace(module.source), gen._namespace(gen.inject(module, [site])))
    assert len(gen.all_sites()) == 19 and len({s.bug.kind for s in gen.all_sites()}) == 5
    site = gen.all_sites()[0]
    source = gen.MODULES_BY_NAME[site.module].source
    with pytest.raises(ValueError, match=f"bug site {site.id}: no visible case"):
        gen._check_caught(site, gen._namespace(source), gen._namespace(source))


def test_the_tools_yaml_shows_the_envs_schemas():
    from skyrl_stepwise.tools.config import configured_tool_schemas

    assert configured_tool_schemas(ROOT / "conf" / "tools" / "repo_fix.yaml") == RepoFixEnv().tool_schemas
    assert [s["function"]["name"] for s in RepoFixEnv().tool_schemas] == list(REPO_TOOLS)


async def _episode(task: gen.Task, calls: list[tuple[str, dict]], answer: str = "done"):
    env = RepoFixEnv()
    row = task.row()
    outputs = []
    try:
        await env.reset(row["prompt"], {**row, "max_turns": 20})
        for k, (name, arguments) in enumerate(calls):
            step = await env.step_turn(ParsedTurn("", tool_calls=[ToolCallRequest(name, arguments, id=str(k))]))
            assert not step.done
            outputs.append(step.observations[0]["content"])
        final = await env.step_turn(ParsedTurn(answer))
        assert final.done
        return final, outputs, env
    finally:
        await env.aclose()
        assert env.sandbox is None or not env.sandbox.workdir.exists()


async def test_edit_outside_the_working_dir_is_refused_and_never_executed(tmp_path):
    task = gen.repo_fix_tasks("train", 1)[0]
    outside = tmp_path / "host.txt"
    outside.write_text("secret old text\n")
    calls = [("edit", {"path": str(outside), "old": "old", "new": "new"}),
             ("edit", {"path": "../../../../../" + str(outside), "old": "old", "new": "new"}),
             ("bash", {"command": f"ln -s {outside} link.txt"}),
             ("edit", {"path": "link.txt", "old": "old", "new": "new"}),
             ("view", {"path": "/etc/passwd"}),
             ("edit", {"path": task.fix()[0]["path"], "old": "no such text", "new": "x"}),
             ("bash", {"command": "pip install requests"}),
             ("bash", {"command": "yes | head -c 100000"})]
    final, outputs, env = await _episode(task, calls)
    assert outside.read_text() == "secret old text\n"
    for text in (outputs[0], outputs[1], outputs[3], outputs[4]):
        assert "outside the working directory" in text or "leaves the working directory" in text, text
    assert "does not occur" in outputs[5]
    assert "refused" in outputs[6] and "forbidden pattern" in outputs[6]
    assert outputs[7].endswith("[output truncated at 4096 bytes]") and len(outputs[7]) < 4096 + 200
    assert final.reward == 0.0 and final.metrics["sandbox/path_refusals"] == 4.0


async def test_reward_is_the_hidden_tests_demo_fix_1_wrong_fix_0():
    task = gen.repo_fix_tasks("train", 3)[0]
    [edit] = task.fix()
    final, outputs, _ = await _episode(task, [("edit", edit), ("bash", {"command": f"python3 {task.test_file}"})])
    assert outputs[1] == "all tests passed" and final.reward == 1.0 and final.metrics["repo_fix/solved"] == 1.0
    # a "fix" that makes the visible test pass by editing the test file earns nothing
    cheat = {"path": task.test_file, "old": 'if __name__ == "__main__":', "new": 'if False:'}
    final, _, _ = await _episode(task, [("edit", cheat)])
    assert final.reward == 0.0
    # a fix that breaks another function: the regression group fails, reward 0
    site = task.sites[0]
    spare = next(f.name for f in gen.MODULES_BY_NAME[site.module].functions
                 if f.name not in gen.affected(site.module, site))
    breaker = {"path": edit["path"], "old": f"def {spare}(",
               "new": f"def {spare}(*args, **kwargs):\n    return None\n\n\ndef _old_{spare}("}
    final, outputs, _ = await _episode(task, [("edit", edit), ("edit", breaker)])
    assert outputs[1].startswith("edited") and final.reward == 0.0 and final.metrics["repo_fix/bugs_fixed"] == 1.0
    # a package that exits at import: no verdict, reward 0
    exits = {"path": f"{task.package}/__init__.py", "old": f'"""{task.package}:',
             "new": f'import os\nos._exit(0)\n"""{task.package}:'}
    final, outputs, _ = await _episode(task, [("edit", edit), ("edit", exits)])
    assert outputs[1].startswith("edited") and final.reward == 0.0
    # nothing done at all
    final, _, _ = await _episode(task, [])
    assert final.reward == 0.0 and final.metrics["repo_fix/bugs_fixed"] == 0.0


async def test_the_episode_runs_on_the_configured_backend(tmp_path, monkeypatch):
    """environment.sandbox.backend: docker (a FAKE docker CLI: our plumbing, not container isolation): the task's
    files are written to the container's working dir, the bash tool and the grading go through `docker exec`, and
    an edit outside the working dir is refused as with bwrap; the grading (its own container, the package's
    sources copied in, the working dir put on the path by the grading program itself) pays the fix."""
    state = use_fake_docker_backend(tmp_path, monkeypatch)
    task = gen.repo_fix_tasks("train", 3)[0]
    [edit] = task.fix()
    final, outputs, _ = await _episode(task, [("edit", edit), ("bash", {"command": f"python3 {task.test_file}"}),
                                              ("view", {"path": "/etc/passwd"})])
    assert outputs[0].startswith("edited") and outputs[1] == "all tests passed"
    assert "outside the working directory" in outputs[2] and final.metrics["sandbox/path_refusals"] == 1.0
    assert final.reward == 1.0 and final.metrics["reward/tamper_suspected"] == 0.0
    execs = fake_calls(state, "exec")
    assert any(c[-1] == f"python3 {task.test_file}" for c in execs) and any(c[-1] == GRADE_COMMAND for c in execs)
    assert len(fake_calls(state, "rm")) == len(fake_calls(state, "run"))


def test_the_sandbox_backend_key_composes_and_a_wrong_one_fails_naming_it():
    from skyrl_stepwise.run.app_config import load_config

    cfg = load_config(["experiment=repo_fix_tiny", "environment.sandbox.backend=podman",
                       "environment.sandbox.image=python:3.12-slim"])
    assert (cfg.environment.sandbox.backend, cfg.environment.sandbox.image) == ("podman", "python:3.12-slim")
    assert load_config(["experiment=repo_fix_tiny"]).environment.sandbox.backend == "bwrap"  # the default
    with pytest.raises(ValueError, match=r"environment\.sandbox\.backend: 'dockr'"):
        load_config(["experiment=repo_fix_tiny", "environment.sandbox.backend=dockr"])


async def test_a_row_without_tests_is_refused_naming_the_row():
    env = RepoFixEnv()
    row = gen.repo_fix_tasks("train", 1)[0].row()
    spec = {k: v for k, v in row["reward_spec"].items() if k != "cases"}
    with pytest.raises(RepoFixError, match=r"instance 'bad-row'.*has no tests"):
        await env.reset(row["prompt"], {"instance_id": "bad-row", "reward_spec": spec})
    with pytest.raises(RepoFixError, match=r"instance 'no-files'.*reward_spec.files"):
        await env.reset(row["prompt"], {"instance_id": "no-files",
                                        "reward_spec": {"cases": row["reward_spec"]["cases"]}})
    with pytest.raises(RepoFixError, match=r"instance 'old-row'.*has no tests.*older version"):
        await env.reset(row["prompt"], {"instance_id": "old-row", "reward_spec": {
            "files": row["reward_spec"]["files"], "hidden_tests": "def hidden_a(): pass"}})
    assert env.sandbox is None
    bad = {**row["reward_spec"], "files": [{"path": "../escape.py", "content": "x"}]}
    with pytest.raises(RepoFixError, match="leaves the working"):
        await env.reset(row["prompt"], {"instance_id": "escape", "reward_spec": bad})
    await env.aclose()


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_written_files_load_and_demos_earn_1(tmp_path, capsys):
    from skyrl_stepwise.data.dataset import load_prompt_dataset
    from skyrl_stepwise.data.demonstrations import load_conversations

    assert gen.main(["--out", str(tmp_path), "--train", "6", "--validation", "3", "--demos", "3"]) == 0
    assert "3 demonstrations" in capsys.readouterr().out
    rows = load_prompt_dataset(tmp_path / "train.parquet")
    assert [r.instance_id for r in rows] == [f"repo_fix-train-{i:04d}" for i in range(6)]
    assert rows[0].reward_spec["files"] and rows[0].env_class == "repo_fix"
    demos = load_conversations(tmp_path / "demos.parquet")
    assert len(demos) == 3 and demos[0][2]["tool_calls"][0]["function"]["name"] == "bash"
    assert [len([m for m in d if m["role"] == "assistant"]) for d in demos] == [5, 5, 7]
    with pytest.raises(ValueError, match="train tasks only"):
        gen.build_demos(gen.repo_fix_tasks("validation", 1))
    # the recipe's start-up checks accept the files: env class registered, no retriever needed
    from skyrl_stepwise.run.app_config import load_config
    from skyrl_stepwise.run.setup import _datasets, check_envs_and_tools

    cfg = load_config(["experiment=repo_fix_tiny", f"data.train_path={tmp_path}/train.parquet",
                       f"data.val_path={tmp_path}/validation.parquet", f"sft.data={tmp_path}/demos.parquet"])
    train, val = _datasets(cfg)
    assert (len(train), len(val)) == (6, 3) and check_envs_and_tools(cfg, train + val) is False


def test_the_recipe_composes():
    from skyrl_stepwise.run.app_config import load_config

    cfg = load_config(["experiment=repo_fix_tiny"])
    assert cfg.environment.env_classes == {"repo_fix": "skyrl_stepwise.envs.repo_fix:RepoFixEnv"}
    assert cfg.sft.enabled and cfg.sft.data == "repo_fix/demos.parquet" and cfg.data.val_path
    assert cfg.generator.max_turns >= 7 and cfg.environment.tool.tools_path == "conf/tools/repo_fix.yaml"


def _replay(tokenizer, task: gen.Task, conversation: list[dict], cfg):
    """One trajectory of `task` through the real generator, the scripted engine sampling the ids a model writing
    `conversation`'s assistant turns samples (SFT's own rendering)."""
    from skyrl_stepwise.envs.base import EnvRegistry
    from skyrl_stepwise.generator import StepwiseGenerator, TrajectoryID
    from skyrl_stepwise.inference.scripted import ScriptedEngine
    from skyrl_stepwise.loop.sft import assistant_turn_ids, sft_renderer

    chat = sft_renderer(tokenizer, cfg)
    tools = RepoFixEnv().tool_schemas
    turns = [assistant_turn_ids(chat, conversation, j, tools) for j, m in enumerate(conversation)
             if m["role"] == "assistant"]
    engine = ScriptedEngine(lambda prompt, session, index: turns[index], tokenizer)
    registry = EnvRegistry()
    registry.register("repo_fix", RepoFixEnv)
    generator = StepwiseGenerator(tokenizer, engine, registry, dataclasses.replace(cfg, n_samples_per_prompt=1,
                                                                                   show_progress=False))
    row = task.row()
    extras = {k: row[k] for k in ("reward_spec", "extra_info", "data_source", "instance_id")}
    return asyncio.run(generator.generate([row["prompt"]], ["repo_fix"], [extras], [TrajectoryID("0", 0)]))


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_a_demonstration_replayed_by_the_scripted_engine_earns_1_and_a_wrong_fix_less(tokenizer):
    from skyrl_stepwise.run.app_config import load_config

    cfg = load_config(["experiment=repo_fix_tiny"]).generator
    task = gen.repo_fix_tasks("train", 3)[2]  # level 3: two bugs, 7 turns
    conversation = asyncio.run(gen.play_demo(task))["messages"]
    out = _replay(tokenizer, task, conversation, cfg)
    assert not out.failed_trajectory_ids
    final = out.rewards[-1]
    assert (final[-1] if isinstance(final, list) else final) == 1.0
    assert max(len(p) + len(r) for p, r in zip(out.prompt_token_ids, out.response_ids)) <= cfg.max_input_length
    # the same episode with the second edit fixing the wrong text: half the bugs fixed, reward 0.5
    wrong = json.loads(json.dumps(conversation))
    edits = [m for m in wrong if m.get("tool_calls") and m["tool_calls"][0]["function"]["name"] == "edit"]
    arguments = json.loads(edits[1]["tool_calls"][0]["function"]["arguments"])
    arguments["new"] = arguments["old"]  # "edits" the bug into itself
    edits[1]["tool_calls"][0]["function"]["arguments"] = json.dumps(arguments)
    out = _replay(tokenizer, task, wrong, cfg)
    final = out.rewards[-1]
    assert (final[-1] if isinstance(final, list) else final) == 0.5
