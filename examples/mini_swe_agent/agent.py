"""mini-swe-agent (https://github.com/SWE-agent/mini-swe-agent, `mini-swe-agent` on PyPI), unchanged, as an agent
program on the repo-fixing tasks: its own `DefaultAgent` and its own `LitellmModel` (tool calls, its `mini.yaml`
prompts), the model pointed at the run's endpoint, its bash commands run in the trajectory's bubblewrap sandbox.

A dataset row names it with `extra_info.agent: "examples.mini_swe_agent.agent:run"` (make_data.py writes such rows).
Per trajectory:

- `RepoFixEnv.reset` (envs/repo_fix.py) checks the row and starts the sandbox holding a copy of the task's package,
  exactly as our own agent loop's repo_fix episodes do;
- `SandboxEnvironment` is mini-swe-agent's environment protocol (`execute`, `get_template_vars`, `serialize`) over
  that sandbox: every command is one sandboxed run with the `bash` tool's limits and forbidden patterns
  (tools/repo.py). A refused command, a run stopped at a limit or a sandbox failure is an observation the model
  reads (returncode -1 and why); nothing ever runs outside the sandbox;
- the agent runs until it submits (`echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`), reaches its step limit, or the
  endpoint refuses a prompt longer than `generator.max_input_length` (the trajectory stopped at the context limit);
  its format errors are its own business (it answers them itself, as it does against any API);
- the reward is the task's hidden cases, graded as our own loop's repo_fix episodes are (`RepoFixEnv`'s grading,
  skyrl_stepwise/envs/grading.py: the package's sources as the agent left them, in a fresh sandbox, compared on the
  host), returned with the `repo_fix/*`, `sandbox/*`, `grading/*`, `reward/tamper_suspected` and `mini_swe_agent/*`
  metrics.

Every model call goes through the endpoint, so each one is a step sample, token-exact; nothing here touches ids.
"""

from __future__ import annotations

import asyncio
import logging
import os
import platform
import shlex
from typing import Any

# Before mini-swe-agent / litellm are imported: no start-up banner, litellm's cost map from the wheel (no network
# fetch at import), and one attempt per call: the endpoint is local and answers a refusal (a 409 for an ended
# session, a 400 naming a field) the same way every time, so mini-swe-agent's default 10 retries with 4-60 s waits
# would only burn the agent's time budget. A user's own settings of these variables win.
os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT", "1")

from minisweagent.exceptions import Submitted  # noqa: E402 - after the environment above
from minisweagent.utils.serialize import recursive_merge  # noqa: E402

from skyrl_stepwise.chat.base import ParsedTurn  # noqa: E402
from skyrl_stepwise.sandbox import BwrapSandbox, RunResult, SandboxUnavailable, StopReason  # noqa: E402
from skyrl_stepwise.tools.repo import BashTool  # noqa: E402

SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"  # mini-swe-agent's own end-of-task marker
CONFIG = "mini.yaml"  # the config `mini` itself runs with (tool calls)
STEP_LIMIT = 8  # model calls per trajectory unless the row says otherwise (extra_info.mini_swe_agent)


class SandboxEnvironment:
    """mini-swe-agent's `Environment` protocol over one trajectory's bubblewrap sandbox.

    Like its `LocalEnvironment`, every action is a fresh shell (`/bin/sh -c` in the sandbox, cwd `/work`, the
    working dir holding the task's files), the output is stdout then stderr, and an output whose first line is the
    submit marker ends the task (`Submitted`). Unlike it, nothing runs on the host: the `bash` tool's policy decides
    (`tools.repo.BashTool`: limits, forbidden patterns), and its refusals and stops are messages to the model."""

    def __init__(self, sandbox: BwrapSandbox, *, env: dict[str, str] | None = None, cwd: str = "",
                 bash: dict[str, Any] | None = None, **unknown: Any) -> None:
        if unknown:  # e.g. `timeout` or `environment_class` of mini-swe-agent's local/docker configs: refused, not
            # silently ignored (the commands would not run the way the config says)
            raise ValueError(f"mini-swe-agent config environment.{sorted(unknown)[0]}: the sandbox environment takes "
                             "only env, cwd and bash (the bash tool's limits, e.g. bash.wall_s for a timeout; "
                             "skyrl_stepwise/tools/repo.py BashToolConfig)")
        self.sandbox = sandbox
        self.tool = BashTool(bash)  # its policy only (limits, forbidden patterns); the runs are made here
        self.env = dict(env or {})
        self.cwd = cwd
        self.config = {"env": self.env, "cwd": cwd, "bash": bash or {}}
        self.runs = 0
        self.refused = 0

    def command_line(self, command: str, cwd: str = "") -> str:
        """The command with the config's variables exported (the sandbox starts from a cleared environment) and
        the action's cwd, if any, entered first."""
        exports = "".join(f"export {k}={shlex.quote(str(v))}\n" for k, v in self.env.items())
        where = cwd or self.cwd
        return exports + (f"cd {shlex.quote(where)} && " if where else "") + command

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        """One action in the sandbox: `{"output", "returncode", "exception_info"}` as mini-swe-agent reads it."""
        command = action.get("command", "")
        refused = self.tool.refusal(command)
        if refused is not None:
            self.refused += 1
            return {"output": "", "returncode": -1, "exception_info": refused}
        try:
            result = self.sandbox.run(self.command_line(command, cwd), None, self.tool.cfg.limits())
        except SandboxUnavailable as e:  # never retried outside the sandbox: the model reads that it failed
            return {"output": "", "returncode": -1, "exception_info": f"the sandbox failed: {e}"}
        self.runs += 1
        output = observation(result, self.tool.cfg.output_bytes)
        self._check_finished(output)
        return output

    def _check_finished(self, output: dict) -> None:
        """Submitted when the output's first line is the marker and the command exited 0 (LocalEnvironment's rule)."""
        lines = output.get("output", "").lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT and output["returncode"] == 0:
            submission = "".join(lines[1:])
            raise Submitted({"role": "exit", "content": submission,
                             "extra": {"exit_status": "Submitted", "submission": submission}})

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        """What the prompts may name: the config and the machine (`{{system}} {{release}} ...` in mini.yaml); not
        the trainer's environment variables (LocalEnvironment exposes os.environ)."""
        return recursive_merge(dict(self.config), platform.uname()._asdict(), kwargs)

    def serialize(self) -> dict:
        return {"info": {"config": {"environment": self.config,
                                    "environment_type": f"{type(self).__module__}.{type(self).__name__}"}}}


def observation(result: RunResult, output_bytes: int) -> dict[str, Any]:
    """A sandbox run as mini-swe-agent's execute() result: a run stopped at a limit has returncode -1 and says why."""
    info = ""
    if result.stop_reason is not StopReason.EXITED:
        info = result.describe()
    if result.truncated:
        info = (info + "; " if info else "") + f"output truncated at {output_bytes} bytes"
    returncode = result.exit_code if result.stop_reason is StopReason.EXITED and result.exit_code is not None else -1
    return {"output": result.stdout + result.stderr, "returncode": returncode, "exception_info": info}


def context_exhausted(error: Exception, context_error: type) -> bool:
    """Whether the call failed because the endpoint refused a prompt longer than generator.max_input_length (400,
    OpenAI error code `context_length_exceeded`). litellm raises it as `ContextWindowExceededError` only when the
    message matches one of its providers' wordings; otherwise as a BadRequestError carrying the body's code."""
    return isinstance(error, context_error) or getattr(error, "code", None) == "context_length_exceeded"


def task_text(messages: list[dict]) -> str:
    """The task mini-swe-agent's instance template is filled with: the row's last user message (the row's own system
    prompt describes our loop's bash/view/edit tools; mini-swe-agent brings its own prompt and its one bash tool)."""
    users = [m.get("content") for m in messages if m.get("role") == "user"]
    if not users or not isinstance(users[-1], str):
        raise ValueError("the row's prompt has no user message with text: mini-swe-agent needs the task as text")
    return users[-1]


def agent_config(task) -> dict[str, Any]:
    """mini-swe-agent's own `mini.yaml`, merged with the row's `extra_info.mini_swe_agent` (e.g.
    `{"agent": {"step_limit": 6}}`), its model pointed at the session's endpoint through litellm's OpenAI provider."""
    from minisweagent.config import get_config_from_spec

    info = task.extras.get("extra_info") if isinstance(task.extras.get("extra_info"), dict) else {}
    own = info.get("mini_swe_agent") or {}
    if not isinstance(own, dict):
        raise ValueError(f"extra_info.mini_swe_agent must be a mapping of mini-swe-agent config, got {own!r}")
    endpoint = {"model": {"model_name": f"openai/{task.model}", "cost_tracking": "ignore_errors",
                          "model_kwargs": {"api_base": task.base_url, "api_key": task.api_key}}}
    return recursive_merge(get_config_from_spec(CONFIG), {"agent": {"step_limit": STEP_LIMIT}}, own, endpoint)


def run(task) -> dict[str, Any]:
    """One trajectory: the task's sandbox, mini-swe-agent's agent run against the endpoint, the hidden tests.

    A plain function (the rollout gives it a thread of its own): mini-swe-agent and litellm are synchronous. The
    env's async reset and grading run on a loop private to this thread."""
    import litellm
    from litellm.exceptions import ContextWindowExceededError
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.models.litellm_model import LitellmModel

    from skyrl_stepwise.envs.repo_fix import RepoFixEnv

    litellm.suppress_debug_info = True  # else each call prints litellm's provider list (our model has no price)
    logging.getLogger("LiteLLM").setLevel(max(logging.WARNING, logging.getLogger("LiteLLM").level))  # not 2 INFO
    # lines per model call in the run's log (the trainer's root logger is at INFO)
    config = agent_config(task)
    env = RepoFixEnv()
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(env.reset(list(task.messages), task.extras))
        environment = SandboxEnvironment(env.sandbox, **config.get("environment", {}))
        agent = DefaultAgent(LitellmModel(**config["model"]), environment, **config["agent"])
        try:
            exit_status = agent.run(task=task_text(task.messages)).get("exit_status", "")
        except Exception as e:  # noqa: BLE001 - anything but the context limit fails the trajectory (re-raised)
            if not context_exhausted(e, ContextWindowExceededError):
                raise
            exit_status = "ContextWindowExceeded"
        graded = loop.run_until_complete(env.step_turn(ParsedTurn("")))  # no call: the episode ends, graded
        metrics = {k: v for k, v in graded.metrics.items() if k not in ("tool_calls", "turns")}
        format_errors = sum(1 for m in agent.messages if (m.get("extra") or {}).get("interrupt_type") == "FormatError")
        metrics.update({"mini_swe_agent/calls": float(agent.n_calls),
                        "mini_swe_agent/commands": float(environment.runs),
                        "mini_swe_agent/refused_commands": float(environment.refused),
                        "mini_swe_agent/format_errors": float(format_errors),
                        "mini_swe_agent/submitted": float(exit_status == "Submitted"),
                        "mini_swe_agent/step_limit": float(exit_status == "LimitsExceeded"),
                        "mini_swe_agent/context_exhausted": float(exit_status == "ContextWindowExceeded")})
        return {"reward": graded.reward, "metrics": metrics}
    finally:
        loop.run_until_complete(env.aclose())
        loop.close()
