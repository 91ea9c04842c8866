"""OpenEnv environments as env classes, against a real OpenEnv server (openenv-core's helpers) on 127.0.0.1: a text
env and an MCP env driven by the generator; a wrong URL and a server that dies mid-run end those trajectories only,
counted, never trained as reward 0."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from types import SimpleNamespace
from pathlib import Path

import pytest
from test_generator import canonical

from skyrl_stepwise.run.config import EnvironmentConfig
from skyrl_stepwise.envs.builtin import EnvPluginError, build_env_registry, check_env_classes
from skyrl_stepwise.envs.openenv import observation_text, parse_openenv_spec
from skyrl_stepwise.generator import GeneratorConfig, GeneratorSamplingConfig, StepwiseGenerator, TrajectoryID
from skyrl_stepwise.inference.scripted import ScriptedEngine

SERVER = Path(__file__).parent / "openenv_servers" / "tiny_openenv_server.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server() -> tuple[subprocess.Popen, str]:
    port = _free_port()
    process = subprocess.Popen([sys.executable, str(SERVER), str(port)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return process, f"http://127.0.0.1:{port}"
        except OSError:
            assert process.poll() is None, "the OpenEnv test server exited during start-up"
            time.sleep(0.2)
    process.kill()
    raise TimeoutError("the OpenEnv test server did not start in 120 s")


@pytest.fixture(scope="module")
def server_url():
    process, url = _start_server()
    yield url
    process.terminate()
    process.wait(10)


def _generator(tokenizer, env_classes: dict, script) -> StepwiseGenerator:
    registry = build_env_registry(EnvironmentConfig(env_classes=env_classes))
    cfg = GeneratorConfig(max_turns=4, max_input_length=4096, show_progress=False, merge_stepwise_output=True,
                          sampling=GeneratorSamplingConfig(max_generate_length=64))
    return StepwiseGenerator(tokenizer, ScriptedEngine(script, tokenizer), registry, cfg)


def test_specs_are_checked_at_start_up_naming_the_key():
    cfg = parse_openenv_spec("openenv-mcp:http://127.0.0.1:8000/calc/?message_timeout_s=5", "k")
    assert (cfg.base_url, cfg.mcp, cfg.message_timeout_s) == ("http://127.0.0.1:8000/calc", True, 5.0)
    with pytest.raises(EnvPluginError, match=r"environment.env_classes.echo: 'openenv:localhost': expected openenv:http"):
        check_env_classes(["echo"], EnvironmentConfig(env_classes={"echo": "openenv:localhost"}))
    with pytest.raises(EnvPluginError, match=r"environment.env_classes.echo: unknown option 'action'"):
        check_env_classes(["echo"], EnvironmentConfig(env_classes={"echo": "openenv:http://h:1?action=x"}))
    assert observation_text({"prompt": "hi", "reward": 0.0, "done": False, "metadata": {}}, None) == "hi"
    assert observation_text({"a": 1, "b": "x"}, None) == '{"a": 1, "b": "x"}'


@pytest.mark.integration
async def test_text_env_turns_are_actions_and_the_server_rewards(server_url, tokenizer):
    eos = tokenizer.eos_token_id
    turns = [canonical(tokenizer, "red") + [eos], canonical(tokenizer, "blue") + [eos]]
    gen = _generator(tokenizer, {"guess": f"openenv:{server_url}/text?observation_field=prompt"},
                     lambda p, s, i: turns[i])
    out = await gen.generate([[{"role": "user", "content": "Play."}]], ["guess"], [{}], [TrajectoryID("g", 0)])
    assert out.rollout_metrics["generate/failed_trajectories"] == 0
    assert out.trajectory_rewards() == [1.0]  # the server's reward, on its own step
    text = tokenizer.decode(out.prompt_token_ids[0]) + tokenizer.decode(out.response_ids[0])
    assert "Guess my color." in text and "No. Guess again." in text


@pytest.mark.integration
async def test_mcp_env_tools_are_rendered_and_called_as_call_tool_actions(server_url, tokenizer):
    eos = tokenizer.eos_token_id
    turns = [canonical(tokenizer, '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>') + [eos],
             canonical(tokenizer, "<answer>5</answer>") + [eos]]
    gen = _generator(tokenizer, {"calc": f"openenv-mcp:{server_url}/mcp"}, lambda p, s, i: turns[i])
    out = await gen.generate([[{"role": "user", "content": "2+3?"}]], ["calc"], [{}], [TrajectoryID("c", 0)])
    assert out.rollout_metrics["generate/failed_trajectories"] == 0
    prompt = tokenizer.decode(out.prompt_token_ids[0])
    assert '"name": "add"' in prompt and "Add two integers." in prompt  # the listed schema, in the template
    observation = tokenizer.decode([t for t, k in zip(out.response_ids[0], out.loss_masks[0]) if not k])
    assert "<|im_start|>tool\n5<|im_end|>" in observation  # the server's result as a tool message


@pytest.mark.integration
async def test_a_wrong_url_and_a_dying_server_fail_only_their_trajectories(tokenizer):
    eos = tokenizer.eos_token_id
    process, url = _start_server()
    try:
        crash = canonical(tokenizer, "crash") + [eos]
        blue = canonical(tokenizer, "say blue") + [eos]
        gen = _generator(tokenizer, {"guess": f"openenv:{url}/text", "nowhere": "openenv:http://127.0.0.1:9"},
                         lambda p, s, i: crash if "Crash" in tokenizer.decode(p) else blue)
        prompts = [[{"role": "user", "content": "Crash it."}], [{"role": "user", "content": "Say blue."}],
                   [{"role": "user", "content": "Say blue."}]]
        extras = [{}, {"reward_spec": {"ground_truth": {"target": ["blue"]}}, "turns": 1}, {}]
        out = await gen.generate(prompts, ["guess", "keyword", "nowhere"], extras,
                                 [TrajectoryID("a", 0), TrajectoryID("b", 0), TrajectoryID("c", 0)])
        assert out.rollout_metrics["generate/failed_trajectories"] == 2  # the dead server's and the wrong URL's
        assert out.trajectory_rewards() == [1.0]  # only the healthy keyword trajectory is trained
    finally:
        process.kill()
        process.wait(10)


def test_local_server_specs_are_checked_without_starting_anything():
    from skyrl_stepwise.envs.openenv_local import running_local_servers

    cfg = parse_openenv_spec("openenv-mcp:local://my_env.server:app/mcp?message_timeout_s=5", "k")
    assert (cfg.base_url, cfg.mcp, cfg.message_timeout_s) == ("local://my_env.server:app/mcp", True, 5.0)
    with pytest.raises(EnvPluginError, match=r"environment.env_classes.e: 'local://my-env': expected local://MODULE:APP"):
        check_env_classes(["e"], EnvironmentConfig(env_classes={"e": "openenv:local://my-env"}))
    check_env_classes(["e"], EnvironmentConfig(env_classes={"e": "openenv:local://no_such_module:app"}))
    assert not running_local_servers()  # checking a config starts no server


@pytest.mark.integration
async def test_a_local_server_is_started_per_run_and_stopped_with_it(tokenizer, monkeypatch):
    """`openenv:local://MODULE:APP/PATH`: the run serves the app itself (one server shared by both env classes, one
    session per trajectory) and stops it at the end; a module that cannot be imported fails naming the key."""
    from skyrl_stepwise.envs.openenv_local import LocalServerError, local_server_url, running_local_servers, \
        stop_local_servers

    monkeypatch.setenv("PYTHONPATH", f"{SERVER.parent}:{__import__('os').environ.get('PYTHONPATH', '')}")
    eos = tokenizer.eos_token_id
    turns = [canonical(tokenizer, "red") + [eos], canonical(tokenizer, "blue") + [eos]]
    app = "local://tiny_openenv_server:app"
    try:
        gen = _generator(tokenizer, {"guess": f"openenv:{app}/text?observation_field=prompt",
                                     "guess2": f"openenv:{app}/text"}, lambda p, s, i: turns[i])
        prompts = [[{"role": "user", "content": "Play."}]] * 2
        out = await gen.generate(prompts, ["guess", "guess2"], [{}, {}], [TrajectoryID("g", 0), TrajectoryID("h", 0)])
        assert out.rollout_metrics["generate/failed_trajectories"] == 0
        assert out.trajectory_rewards() == [1.0, 1.0]
        servers = running_local_servers()
        assert list(servers) == ["tiny_openenv_server:app"]  # one server for both env classes
        with pytest.raises(LocalServerError, match=r"env_classes.bad: .*uvicorn no_such_module:app.* exited"):
            local_server_url("no_such_module:app", "environment.env_classes.bad")
    finally:
        stop_local_servers()
    assert servers["tiny_openenv_server:app"].poll() is not None and not running_local_servers()


class _RecordingClient:
    """Stands in for openenv-core's client: records what would reach the server, answers every call with 'pong'."""

    def __init__(self, observation=None):
        self.sent: list[dict] = []
        self.observation = observation if observation is not None else {"prompt": "What is 2+3?"}

    async def reset(self, **kwargs):
        return SimpleNamespace(observation=self.observation, reward=None, done=False)

    async def step(self, action):
        self.sent.append(action)
        if action.get("type") == "list_tools":
            return SimpleNamespace(observation={"tools": []}, reward=None, done=False)
        return SimpleNamespace(observation={"result": "pong"}, reward=None, done=False)


def _env_with(client, mcp: bool = True):
    from skyrl_stepwise.envs.openenv import OpenEnvConfig, OpenEnvMCPEnv, OpenEnvTextEnv

    env = (OpenEnvMCPEnv if mcp else OpenEnvTextEnv)(OpenEnvConfig("http://127.0.0.1:9", mcp=mcp))
    env.session.client = client

    async def opened():  # the recording client is already "connected"
        return None

    env.session.open = opened
    return env


async def test_mcp_env_answers_a_malformed_call_as_our_executor_does_and_never_sends_it():
    """A call the parser could not read, or whose arguments are not a readable JSON object, was sent as `{}`: on a
    tool with no required argument the model read a success ('pong') for a broken call. Now each is answered with
    exactly the message our own executor gives (same tool, same call), counted, and never reaches the server."""
    from skyrl_stepwise.chat.base import ParsedTurn, ToolCallRequest
    from skyrl_stepwise.tools.executor import ToolExecutor

    class Ping:
        name, config_class = "ping", None
        schema = {"type": "function", "function": {"name": "ping", "description": "",
                                                   "parameters": {"type": "object", "properties": {}}}}

        async def call(self, arguments):
            return "pong"

    broken = [ToolCallRequest("ping", '{"host": "a"'),  # unreadable JSON
              ToolCallRequest("ping", "[1, 2]"),  # not an object
              ToolCallRequest("ping", '{"n": NaN}'),  # not JSON any server can be sent
              ToolCallRequest(None, None, raw='<tool_call>{"name": ping', error="invalid_json",
                              expected_format='<tool_call>{"name": ..., "arguments": {...}}</tool_call>')]
    client = _RecordingClient()
    env = _env_with(client)
    result = await env.step_turn(ParsedTurn("", tool_calls=broken + [ToolCallRequest("ping", "{}")]))
    expected = await ToolExecutor({"ping": Ping()}).execute(broken)
    assert [m["content"] for m in result.observations[:4]] == [r.content for r in expected]
    assert all(r.error_kind in ("invalid_arguments", "invalid_json") for r in expected)
    assert "arguments are not valid JSON" in result.observations[0]["content"]
    assert result.observations[4]["content"] == "pong"  # the well-formed call still runs
    assert client.sent == [{"type": "call_tool", "tool_name": "ping", "arguments": {}}]  # only that one was sent
    assert result.metrics["openenv_invalid_calls"] == 4.0 and result.metrics["openenv_tool_calls"] == 5.0


async def test_reset_observation_already_in_the_prompt_is_not_repeated():
    """Rows that carry the env's question got it twice (the prompt, then reset's observation); an observation that a
    prompt message already says is not repeated, any other still joins as a user message."""
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?\n"}]
    for mcp in (True, False):
        env = _env_with(_RecordingClient(), mcp)
        assert await env.reset(prompt, {}) == prompt
        env = _env_with(_RecordingClient({"prompt": "Now: what is 3+4?"}), mcp)
        assert (await env.reset(prompt, {}))[2:] == [{"role": "user", "content": "Now: what is 3+4?"}]


def _readme_openenv_commands() -> list[list[str]]:
    """The documented `skyrl-stepwise train` commands (docs/ecosystems.md, once the README's) that name an OpenEnv env
    class, as the shell splits them."""
    import re
    import shlex

    readme = (Path(__file__).parent.parent / "docs" / "ecosystems.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", readme, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            openenv = any("env_classes" in w and "openenv" in w for w in words)
            if openenv and "skyrl-stepwise" in words and "train" in words:  # also after `PYTHONPATH=... `
                commands.append(words[words.index("train") + 1:])
    return commands


def test_readme_openenv_commands_parse_as_hydra_overrides_and_openenv_addresses():
    """The README's OpenEnv commands work as written: every override parses with Hydra's own override parser (an
    unquoted `?observation_field=prompt` failed there with "mismatched input '='"), the run's config composes from
    them, and each env class's value is an OpenEnv address the start-up check accepts."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from skyrl_stepwise.run.app_config import load_config

    commands = _readme_openenv_commands()
    assert len(commands) >= 2
    parser = OverridesParser.create()
    addresses = []
    for words in commands:
        overrides = parser.parse_overrides([w for w in words if "=" in w and not w.startswith("-")])
        addresses += [o.value() for o in overrides if o.key_or_group.startswith("environment.env_classes.")]
        environment = load_config(words).environment
        assert set(environment.env_classes) and all(v.startswith("openenv") for v in environment.env_classes.values())
        check_env_classes(list(environment.env_classes), environment)
    assert len(addresses) >= 4 and any("?" in a and "=" in a for a in addresses)
