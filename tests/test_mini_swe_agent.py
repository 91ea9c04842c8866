"""mini-swe-agent, unchanged, on a repo_fix task through the agent endpoint (examples/mini_swe_agent/agent.py): its
own DefaultAgent and LitellmModel call the endpoint over HTTP (a scripted engine samples the model's turns), its
commands run in the trajectory's bubblewrap sandbox on a copy of the task's package, the hidden tests give the
reward, and every call is an exact step sample."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from family_tokenizers import FAMILIES, family_tokenizer
from sandbox_helpers import require_sandbox
from test_gateway import _assert_exact
from test_tool_call_formats import unrendered_calls

pytest.importorskip("minisweagent")
require_sandbox()
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # the rows name `examples.mini_swe_agent.agent:run`, imported from the repo root
    sys.path.insert(0, str(REPO))

from examples.mini_swe_agent.agent import SUBMIT, SandboxEnvironment  # noqa: E402
from examples.mini_swe_agent.teacher import edit_command as _edit_command  # noqa: E402
from minisweagent.exceptions import Submitted  # noqa: E402

from skyrl_stepwise.chat.template import TemplateRenderer  # noqa: E402
from skyrl_stepwise.data.repo_fix import repo_fix_tasks  # noqa: E402
from skyrl_stepwise.gateway import Gateway, GatewayConfig  # noqa: E402
from skyrl_stepwise.generator import GeneratorConfig  # noqa: E402
from skyrl_stepwise.generator.output import TrajectoryID  # noqa: E402
from skyrl_stepwise.inference.scripted import ScriptedEngine  # noqa: E402
from skyrl_stepwise.sandbox import BwrapSandbox  # noqa: E402

sys.path.insert(0, str(REPO / "examples" / "mini_swe_agent"))
# by its file, under its own name: examples/agent_program has a make_data.py too (tests/test_gateway_train.py)
_spec = importlib.util.spec_from_file_location("mini_swe_agent_make_data",
                                               REPO / "examples" / "mini_swe_agent" / "make_data.py")
make_data = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_data)

sys.path.pop(0)




async def _run_agent(task, turns: list[tuple[str, str | None]], max_input_length: int = 16384, **agent_cfg):
    """mini-swe-agent on `task` through the endpoint over a scripted SmolLM2 engine that samples `turns` (text, and
    the bash command it calls, or None for no call). (result, the requests the agent sent, engine, chat, output)."""
    from skyrl_stepwise.gateway.rollout import AgentProgramGenerator, AgentServer

    tok = family_tokenizer("smollm2")
    chat = TemplateRenderer(tok, dict(FAMILIES["smollm2"].render_kwargs), "all")
    sampled = []
    for text, command in turns:
        call = unrendered_calls(chat.tool_parser.name, [("bash", {"command": command})]) if command else ""
        sampled.append(tok(text + ("\n" + call if call else ""), add_special_tokens=False)["input_ids"]
                       + [chat.close_id])
    engine = ScriptedEngine(lambda prompt, session, i: sampled[min(i, len(sampled) - 1)], tok)
    gateway = Gateway(tok, engine, GeneratorConfig(thinking_retention="all", max_input_length=max_input_length), GatewayConfig(),
                      renderer=chat)
    requests, results = [], []
    complete, close = gateway.complete, gateway.close_session

    async def recording_complete(session_id, body):
        requests.append(json.loads(json.dumps(body)))
        return await complete(session_id, body)

    def recording_close(session_id):
        results.append(close(session_id))
        return results[-1]

    gateway.complete, gateway.close_session = recording_complete, recording_close
    row = make_data.agent_row(task, **agent_cfg)
    extras = {k: row[k] for k in ("reward_spec", "extra_info", "instance_id")}
    async with AgentServer(gateway) as url:
        out = await AgentProgramGenerator(gateway, url).generate([row["prompt"]], [row["env_class"]], [extras],
                                                                 [TrajectoryID(task.instance_id, 0)])
    [result] = results
    return result, requests, engine, chat, out


def _observations(requests: list[dict]) -> list[str]:
    """The tool results mini-swe-agent sent back, in order (each the next request's new tool message)."""
    return [m["content"] for m in requests[-1]["messages"] if m["role"] == "tool"]


@pytest.mark.integration  # litellm's import alone takes ~8 s on the 2-core box
async def test_mini_swe_agent_fixes_a_repo_fix_task_in_the_sandbox_through_the_endpoint(tmp_path):
    task = repo_fix_tasks("train", 1)[0]
    [fix] = task.fix()
    outside = tmp_path / "outside.txt"  # a host path: the agent's write there must not reach the host
    turns = [("I run the failing test.", f"python3 {task.test_file}"),
             ("Maybe a package helps.", "pip install requests"),
             ("I fix the bug.", _edit_command(fix["path"], fix["old"], fix["new"])),
             ("Can I write outside?", f"echo pwned > {outside} && echo wrote"),
             ("I check where I am.", f"pwd && grep -c {json.dumps(fix['new'][:30])} {fix['path']}"),
             ("The test again.", f"python3 {task.test_file}"),
             ("Done.", f"echo {SUBMIT}")]
    result, requests, engine, chat, out = await _run_agent(task, turns)

    assert result.failure is None, result.failure_message
    assert result.steps[-1].reward == sum(out.trajectory_rewards()) == 1.0  # the hidden tests, on the edited dir
    metrics = result.stats.env_metrics
    observations = [json.loads(o) for o in _observations(requests)]
    assert len(observations) == 6 and len(requests) == 7
    first_test, pip, edit, write, where, second_test = observations
    assert first_test["returncode"] != 0 and "AssertionError" in first_test["output"]
    assert pip["returncode"] == -1 and "forbidden pattern" in pip["exception_info"]  # refused, never run
    assert edit["returncode"] == 0
    assert write["returncode"] != 0 and not outside.exists()  # the sandbox's own /tmp: nothing on the host
    assert where["output"].splitlines()[0] == "/work" and where["output"].splitlines()[1] == "1"
    assert second_test["returncode"] == 0
    # the agent edited the sandbox's copy: the row it was given still holds the bug
    [row_file] = [f for f in make_data.agent_row(task)["reward_spec"]["files"] if f["path"] == fix["path"]]
    assert fix["old"] in row_file["content"] and row_file["content"] == task.files[fix["path"]]
    # mini-swe-agent's own prompt and its one bash tool, not our loop's bash/view/edit
    assert [t["function"]["name"] for t in requests[0]["tools"]] == ["bash"]
    assert requests[0]["messages"][0]["content"].startswith("You are a helpful assistant")
    assert "has a bug" in requests[0]["messages"][1]["content"]
    # every call an exact step sample: the first prompt is the renderer's rendering of what the agent sent, each
    # later one extends the previous prompt + sampled ids (no chain break), trained ids = sampled ids
    assert len(result.steps) == len(engine.calls) == 7
    assert engine.calls[0][1] == chat.prompt_ids(requests[0]["messages"], requests[0]["tools"])
    for k in range(1, 7):
        chain = engine.calls[k - 1][1] + engine.sampled[k - 1]
        assert engine.calls[k][1][:len(chain)] == chain, k
    _assert_exact(result, engine)
    assert out.rollout_metrics.get("gateway/chain_breaks", 0) == 0, out.rollout_metrics
    assert out.rollout_metrics["gateway/extended"] == 6  # every call after the first continued the chain
    assert metrics["repo_fix/solved"] == 1.0 and metrics["mini_swe_agent/submitted"] == 1.0, metrics
    assert metrics["mini_swe_agent/calls"] == 7 and metrics["mini_swe_agent/refused_commands"] == 1
    assert metrics["mini_swe_agent/commands"] == 6 and metrics["mini_swe_agent/format_errors"] == 0


@pytest.mark.integration
async def test_a_wrong_fix_earns_less_and_a_format_error_is_the_agents_own_business():
    task = repo_fix_tasks("train", 1)[0]
    [fix] = task.fix()
    turns = [("I will just look around.", None),  # no tool call: mini-swe-agent answers its own format error
             ("I fix something else.", f"echo '# touched' >> {fix['path']}"),
             ("Done.", f"echo {SUBMIT}")]
    result, requests, engine, chat, out = await _run_agent(task, turns)
    assert result.failure is None, result.failure_message
    assert result.steps[-1].reward == sum(out.trajectory_rewards()) == 0.0  # the bug is still there
    assert len(requests) == 3 and len(result.steps) == 3
    format_error = requests[1]["messages"][-1]
    assert format_error["role"] == "user" and "tool" in format_error["content"].lower()
    _assert_exact(result, engine)
    # mini-swe-agent keeps a format error's reply out of its history (the FormatError carries only its message),
    # so the next request drops a sampled turn: one counted chain break, the new chain the renderer's rendering of
    # exactly what the agent sent; the call after it extends that chain again
    gateway_metrics = {k: v for k, v in out.rollout_metrics.items() if k.startswith("gateway/chain_breaks")}
    assert gateway_metrics.get("gateway/chain_breaks") == 1, out.rollout_metrics
    assert engine.calls[1][1] == chat.prompt_ids(requests[1]["messages"], requests[1]["tools"])
    chain = engine.calls[1][1] + engine.sampled[1]
    assert engine.calls[2][1][:len(chain)] == chain
    metrics = result.stats.env_metrics
    assert metrics["mini_swe_agent/format_errors"] == 1 and metrics["mini_swe_agent/submitted"] == 1.0
    assert metrics["repo_fix/reward"] == 0.0


@pytest.mark.integration
async def test_a_prompt_past_the_context_limit_ends_the_trajectory_graded_not_failed():
    """The endpoint refuses a prompt longer than generator.max_input_length (400, context_length_exceeded), which
    litellm raises as ContextWindowExceededError and mini-swe-agent does not catch: the trajectory stopped at the
    context limit, so the agent program grades the working dir as it is and returns that reward (the run's
    mask_limit_stops then decides whether it trains), instead of failing the trajectory as an agent error."""
    task = repo_fix_tasks("train", 1)[0]
    [fix] = task.fix()
    turns = [("I fix the bug.", _edit_command(fix["path"], fix["old"], fix["new"])),
             ("And print a lot.", "python3 -c \"print('x ' * 1500)\""),
             ("Done.", f"echo {SUBMIT}")]
    first = (await _run_agent(task, turns[:1]))[2].calls[0][1]  # the first prompt's length, to set the limit by
    result, requests, engine, chat, out = await _run_agent(task, turns, max_input_length=len(first) + 400)
    assert result.failure is None, result.failure_message
    assert len(result.steps) == 2 and len(requests) == 3  # the third request was refused, never sampled
    assert result.steps[-1].stop_reason == "context_exhausted"
    assert result.steps[-1].reward == 1.0  # the edit made before the limit is graded
    assert result.stats.env_metrics["mini_swe_agent/context_exhausted"] == 1.0
    assert out.rollout_metrics["gateway/refused/context_length_exceeded"] == 1


def test_the_environment_runs_in_the_sandbox_refuses_by_policy_and_submits():
    """mini-swe-agent's environment protocol over our sandbox (fast: no model, no litellm)."""
    with BwrapSandbox() as sandbox:
        sandbox.write_file("pkg/a.py", "x = 1\n")
        env = SandboxEnvironment(sandbox, env={"PAGER": "cat"})
        out = env.execute({"command": "pwd; cat pkg/a.py; echo $PAGER; echo err >&2; exit 3"})
        assert out == {"output": "/work\nx = 1\ncat\nerr\n", "returncode": 3, "exception_info": ""}
        out = env.execute({"command": "sed -i 's/1/2/' a.py"}, cwd="pkg")
        assert out["returncode"] == 0 and sandbox.read_file("pkg/a.py") == "x = 2\n"
        refused = env.execute({"command": "curl http://example.com"})
        assert refused["returncode"] == -1 and "forbidden pattern" in refused["exception_info"]
        slow = SandboxEnvironment(sandbox, bash={"wall_s": 0.5}).execute({"command": "sleep 5"})
        assert slow["returncode"] == -1 and "timeout" in slow["exception_info"]
        assert env.execute({"command": f"echo {SUBMIT}; exit 1"})["returncode"] == 1  # not exited 0: not submitted
        with pytest.raises(Submitted) as submitted:
            env.execute({"command": f"echo {SUBMIT}; echo summary"})
        assert submitted.value.messages[0]["extra"] == {"exit_status": "Submitted", "submission": "summary\n"}
        assert (env.runs, env.refused) == (4, 1)
        assert {"system", "release", "machine"} <= set(env.get_template_vars())
        assert "PATH" not in env.get_template_vars()  # not the trainer's environment
        with pytest.raises(ValueError, match="environment.timeout: .* bash.wall_s"):
            SandboxEnvironment(sandbox, timeout=30)


def test_rows_name_the_agent_and_keep_the_task():
    task = repo_fix_tasks("validation", 1)[0]
    row = make_data.agent_row(task, step_limit=5)
    assert row["extra_info"]["agent"] == make_data.AGENT == "examples.mini_swe_agent.agent:run"
    assert row["extra_info"]["mini_swe_agent"] == {"agent": {"step_limit": 5}}
    assert row["reward_spec"] == task.row()["reward_spec"] and row["prompt"] == task.row()["prompt"]
    assert "fix" not in row["extra_info"]  # the demonstration's answer is not in the agent's row


@pytest.mark.integration  # imports the agent (litellm: ~8 s) through the start-up check
def test_the_recipe_accepts_make_datas_rows(tmp_path):
    """experiment=repo_fix_mini_swe_agent_tiny reads make_data.py's default folder, and its start-up checks (env
    class registered, every row naming an importable agent under gateway.enabled) accept the rows."""
    from skyrl_stepwise.run.app_config import load_config
    from skyrl_stepwise.run.setup import _datasets, check_envs_and_tools

    cfg = load_config(["experiment=repo_fix_mini_swe_agent_tiny"])
    assert cfg.gateway.enabled and not cfg.sft.enabled
    assert cfg.data.train_path == "repo_fix_mini_swe_agent/train.parquet"
    assert cfg.data.val_path == "repo_fix_mini_swe_agent/validation.parquet"
    assert cfg.generator.max_input_length < cfg.engine.max_model_len
    paths = make_data.main(["--out", str(tmp_path), "--train", "3", "--validation", "2"])
    cfg = load_config(["experiment=repo_fix_mini_swe_agent_tiny", f"data.train_path={paths['train']}",
                       f"data.val_path={paths['validation']}"])
    train, val = _datasets(cfg)
    assert (len(train), len(val)) == (3, 2)
    check_envs_and_tools(cfg, train + val)  # raises naming the row if an agent cannot be imported


@pytest.mark.integration  # litellm's import, and mini-swe-agent run on 3 tasks in the sandbox
def test_the_teachers_demonstrations_are_recorded_through_the_endpoint_and_sft_trains_exactly_them():
    """The warm start of experiment=repo_fix_mini_swe_agent_warm_tiny: mini-swe-agent, unchanged, runs one task of
    each difficulty against the teacher (examples/mini_swe_agent/teacher.py) through the endpoint; every trajectory
    earns reward 1 from the hidden tests in 5 calls (7 for two bugs); the SFT path replays each kept conversation to
    exactly the ids the endpoint sampled (record_agent_demos refuses otherwise), tool outputs never trained.

    SmolLM2's hermes parser hands the agent the content before `<tool_call>` with its newline, which the turn's
    rendering adds again: the conversation keeps the teacher's own text, the one that made the ids."""
    from examples.mini_swe_agent.teacher import plan, teach

    from skyrl_stepwise.data.dataset import PromptRow
    from skyrl_stepwise.generator import GeneratorSamplingConfig
    from skyrl_stepwise.loop.agent_demos import record_agent_demos, sft_samples
    from skyrl_stepwise.loop.sft import conversation_samples

    tok = family_tokenizer("smollm2")
    tasks = repo_fix_tasks("train", 3)
    assert [t.difficulty for t in tasks] == [1, 2, 3]
    rows = []
    for task in tasks:
        row = make_data.agent_row(task)
        rows.append(PromptRow(row["prompt"], row["env_class"], row["reward_spec"], row["data_source"],
                              row["extra_info"], row["instance_id"]))
    assert [len(plan(make_data.agent_row(t))) for t in tasks] == [5, 5, 7]
    cfg = GeneratorConfig(max_input_length=3584, sampling=GeneratorSamplingConfig(max_generate_length=192))
    demos = record_agent_demos(tok, rows, teach, cfg, log=lambda line: None)
    assert [(d.reward, d.calls, d.dropped) for d in demos.demos] == [(1.0, 5, None), (1.0, 5, None), (1.0, 7, None)]
    output = conversation_samples(tok, demos.conversations(), cfg, None, demos.tools())
    for i, demo in enumerate(demos.kept):
        assert sft_samples(output, i) == demo.endpoint, demo.trajectory
        assert [t["function"]["name"] for t in demo.tools] == ["bash"]  # mini-swe-agent's one tool
        assert demo.messages[0]["content"].startswith("You are a helpful assistant")  # its own prompts
        [(prompt, response, mask)] = demo.endpoint  # one chain: the agent never broke it
        trained = tok.decode([t for t, k in zip(response, mask) if k])
        assert trained.count("<tool_call>") == demo.calls and SUBMIT in trained
        assert "AssertionError" not in trained and '"returncode"' not in trained  # the sandbox's outputs: not trained
        assistant = [m for m in demo.messages if m["role"] == "assistant"]
        assert all(not m["content"].endswith("\n") for m in assistant)  # the teacher's text, not the parser's


def test_the_warm_recipe_records_its_demonstrations_with_the_teacher():
    from examples.mini_swe_agent.teacher import teach

    from skyrl_stepwise.loop.agent_demos import load_teacher
    from skyrl_stepwise.run.app_config import load_config

    cfg = load_config(["experiment=repo_fix_mini_swe_agent_warm_tiny"])
    assert cfg.gateway.enabled and cfg.sft.enabled and cfg.sft.data == "agent_demos"
    assert cfg.data.train_path == "repo_fix_mini_swe_agent/train.parquet"  # make_data.py's rows, as the cold recipe
    assert load_teacher(cfg.sft.agent_demos.teacher) is teach
    assert cfg.sft.agent_demos.min_reward == 1.0  # only trajectories the hidden tests pass become demonstrations
