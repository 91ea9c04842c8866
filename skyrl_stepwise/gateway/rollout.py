"""An agent program as a rollout: a dataset row names an agent callable (`extra_info.agent: "pkg.module:function"`),
which gets its session's base URL and API key, runs its own loop against the endpoint, and returns the reward.

The callable takes one `AgentTask` and returns a float, `{"reward": float, "metrics": {...}}`, or None (it posted
the reward to `{task.reward_url}`, or the row's env scores the final answer). A coroutine function is awaited;
a plain function runs in a thread. A timeout, an exception, no call to the model or no reward fails that trajectory
only (`gateway/failed_trajectories/{cause}`), never the batch; failed trajectories are not trained.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import logging
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from skyrl_stepwise.envs.base import EnvRegistry, Message
from skyrl_stepwise.envs.builtin import EnvPluginError, import_object
from skyrl_stepwise.gateway.service import Gateway, RewardError, checked_outcome
from skyrl_stepwise.generator.generator import filter_limit_stops, steps_to_output, trajectory_metrics
from skyrl_stepwise.generator.merge import merge_stepwise_output
from skyrl_stepwise.generator.metrics import sample_metrics
from skyrl_stepwise.generator.output import GeneratorOutput, TrajectoryID

logger = logging.getLogger(__name__)
AGENT_FAILURES = ("agent_error", "agent_timeout", "agent_no_calls", "agent_no_reward", "agent_bad_return")


@dataclass
class AgentTask:
    """What an agent program gets for one trajectory: where to send its chat calls, and the row."""

    base_url: str  # an OpenAI base URL for this trajectory's session: `.../s/{session}/v1`
    api_key: str  # send it as `Authorization: Bearer <api_key>` (an OpenAI client's api_key does)
    model: str
    session: str
    reward_url: str  # POST {"reward": float, "metrics": {...}} here instead of returning it
    messages: list[Message]  # the row's prompt
    extras: dict[str, Any] = field(default_factory=dict)  # the row's env extras (reward_spec, extra_info)


def agent_path(extras: dict[str, Any]) -> str | None:
    """The agent callable a row names (`extra_info.agent`, or `agent` at the top of the extras)."""
    info = extras.get("extra_info") if isinstance(extras.get("extra_info"), dict) else {}
    return extras.get("agent") or info.get("agent")


def load_agents(rows_extras: list[dict[str, Any]], where: str = "data") -> dict[str, Callable]:
    """Every agent the rows name, imported now, so a typo fails at start-up naming the row, not mid-run."""
    agents: dict[str, Callable] = {}
    for i, extras in enumerate(rows_extras):
        path = agent_path(extras)
        if path is None or path in agents:
            continue
        if not isinstance(path, str):
            raise EnvPluginError(f"{where} row {i}: extra_info.agent must be 'pkg.module:function', got {path!r}")
        agents[path] = import_object(path, f"{where} row {i} extra_info.agent")
    return agents


def check_agent_rows(rows_extras: list[dict[str, Any]], where: str = "data", enabled: bool = True) -> None:
    """All or nothing, checked at start-up naming the rows: with gateway.enabled every row (train and val) runs an
    agent program, so a row naming none, or an agent that cannot be imported, fails; without it a row naming an
    agent fails too, since our own agent loop would silently run it instead. A batch mixing the two kinds is
    refused rather than half-served: evals and GRPO groups would compare different rollout machinery."""
    named = [i for i, x in enumerate(rows_extras) if agent_path(x) is not None]
    if not enabled:
        if named:
            raise EnvPluginError(f"{where}: rows {named[:5]} name an agent program (column extra_info, key 'agent') "
                                 "but gateway.enabled=false: set gateway.enabled=true to run them through the agent "
                                 "endpoint, or drop extra_info.agent to run them in our own agent loop")
        return
    missing = [i for i, x in enumerate(rows_extras) if agent_path(x) is None]
    if missing:
        raise EnvPluginError(f"{where}: gateway.enabled=true but rows {missing[:5]} name no agent (column "
                             f"extra_info, key 'agent': 'pkg.module:function'); {len(named)} of {len(rows_extras)} "
                             "rows do: a run is all agent programs (gateway.enabled=true) or none, so split the data "
                             "or name an agent in every row")
    load_agents(rows_extras, where)


class AgentProgramGenerator:
    """The generator's `generate()` for rows that name agents: one session per trajectory on `gateway`, served at
    `server_url`; the result is the GeneratorOutput the trainer consumes, built by the generator's own functions."""

    def __init__(self, gateway: Gateway, server: "AgentServer | str", env_registry: EnvRegistry | None = None) -> None:
        # an AgentServer is started by the first generate() (announced when it serves); a URL is served already
        self.server = server if isinstance(server, AgentServer) else None
        self.gateway, self.server_url = gateway, (server.bind() if self.server else server).rstrip("/")
        self.env_registry = env_registry
        self.cfg = gateway.cfg

    async def generate(self, prompts: list[list[Message]], env_classes: list[str], env_extras: list[dict[str, Any]],
                       trajectory_ids: list[TrajectoryID]) -> GeneratorOutput:
        """Run every row's agent concurrently; each trajectory is what its session sampled, exactly."""
        results = await self.run_agents(prompts, env_classes, env_extras, trajectory_ids)
        overlong = filter_limit_stops(results, self.cfg)  # the loop's rules hold for agent programs too
        output = steps_to_output(results)
        output.rollout_metrics.update(trajectory_metrics(results))
        output.rollout_metrics.update(call_metrics(results))
        output.rollout_metrics["generate/overlong_filtered_trajectories"] = overlong
        output.rollout_metrics.update(self.gateway.metrics())
        if not self.cfg.step_wise_trajectories or self.cfg.merge_stepwise_output:
            output = merge_stepwise_output(output)
        output.rollout_metrics.update(sample_metrics(output))
        output.validate()
        return output

    async def run_agents(self, prompts: list[list[Message]], env_classes: list[str],
                         env_extras: list[dict[str, Any]], trajectory_ids: list[TrajectoryID]) -> list:
        """Every row's agent, concurrently: one TrajectoryResult per trajectory (failed ones carry their cause), in
        row order; what `generate` builds its output from, and what the demo recorder (loop/agent_demos.py) keeps."""
        agents = load_agents(env_extras)
        if self.server is not None:
            self.server_url = await self.server.serve()
        missing = [i for i, x in enumerate(env_extras) if agent_path(x) is None]
        if missing:
            raise ValueError(f"rows {missing[:5]} name no agent (extra_info.agent): AgentProgramGenerator runs "
                             "agent programs only")
        # Plain-function agents get threads of their own, one per row: on the loop's default executor (a handful
        # of workers) they would queue behind each other, and block the engines that decode there (HFEngine's
        # batches run in asyncio.to_thread) while they wait for replies: a deadlock past ~cpu_count+4 agents.
        threads = ThreadPoolExecutor(max_workers=max(1, len(prompts)), thread_name_prefix="agent")
        try:
            results = await asyncio.gather(*[
                self._run(agents[agent_path(x)], p, c, x, t, threads)
                for p, c, x, t in zip(prompts, env_classes, env_extras, trajectory_ids)])
        finally:
            threads.shutdown(wait=False)  # an agent past its timeout keeps its thread until it returns
        return list(results)

    async def _run(self, agent: Callable, prompt: list[Message], env_class: str, extras: dict[str, Any],
                   trajectory_id: TrajectoryID, threads: ThreadPoolExecutor | None = None):
        gateway = self.gateway
        sid = gateway.open_session(trajectory_id)
        task = AgentTask(f"{self.server_url}/s/{sid}/v1", gateway.gateway.api_key or "none", gateway.model_names[0],
                         sid, f"{self.server_url}/s/{sid}/reward", list(prompt), dict(extras))
        session = gateway.sessions[sid]
        try:
            value = await asyncio.wait_for(_call(agent, task, threads), gateway.gateway.agent_timeout_s)
            reward, metrics = _outcome(value)
            if session.failure is not None:
                pass  # a call failed it (engine error): the failure stands, whatever the agent made of it
            elif reward is not None:
                gateway.post_reward(sid, reward, metrics)
            elif session.reward is None and self.env_registry is not None and session.calls:
                session.reward = await self._score(env_class, prompt, extras, session)
        except asyncio.TimeoutError:
            session.fail("agent_timeout", f"the agent ran longer than gateway.agent_timeout_s="
                                          f"{gateway.gateway.agent_timeout_s}")
        except _BadReturn as e:
            session.fail("agent_bad_return", str(e))
        except Exception as e:  # noqa: BLE001 - the agent's own failure ends its trajectory only (warned at close)
            session.fail("agent_error", repr(e))
        return gateway.close_session(sid)

    async def _score(self, env_class: str, prompt: list[Message], extras: dict[str, Any], session) -> float:
        """The row's env scores the agent's final answer (the last reply's text), as it scores our own loop's: under
        the env contract (a NaN or non-number reward fails the trajectory, never trained on) and releasing the env
        (`aclose`) however it ended; a failing close is logged, the score stands."""
        from skyrl_stepwise.envs.contract import check_step_result

        env = self.env_registry.make(env_class)
        try:
            await env.reset(prompt, extras)
            final = session.calls[-1].reply.get("content") or ""
            return float(check_step_result(await env.step(final), env).reward)
        finally:
            close = getattr(env, "aclose", None)
            if close is not None:
                try:
                    await close()
                except Exception as e:  # noqa: BLE001 - the score stands; the leak is reported
                    logger.warning("closing the scoring env %s failed: %r", env_class, e)


def call_metrics(results: list) -> dict[str, float]:
    """Calls to the model per trained trajectory (`gateway/calls_per_trajectory_mean`) and the share with two or more
    (`gateway/multi_call_share`): an agent whose model never calls a tool makes one call per trajectory, so these say
    whether a warm start taught it to (docs/agent-programs.md "A warm start"). Failed trajectories are not trained
    and not in those two (`gateway/failed_trajectories/*` counts them); the calls they made before failing are
    `gateway/calls_per_failed_trajectory_mean`. With no finished trajectory the two means are left out rather than
    read as 0 calls: `gateway/finished_trajectories` says how many trajectories they average. A call is not a tool
    call (an agent may answer a reply with no call by a format error, and call again):
    `gateway/tool_calls_per_trajectory_mean` counts the replies that carried one."""
    finished = [r for r in results if r.failure is None]
    calls = [len(r.steps) for r in finished]
    failed = [len(r.partial_steps) for r in results if r.failure is not None]
    metrics = {"gateway/finished_trajectories": float(len(calls))}
    if calls:
        metrics["gateway/calls_per_trajectory_mean"] = sum(calls) / len(calls)
        metrics["gateway/multi_call_share"] = sum(c >= 2 for c in calls) / len(calls)
        metrics["gateway/tool_calls_per_trajectory_mean"] = sum(r.stats.tool_call_turns for r in finished) / len(calls)
    if failed:
        metrics["gateway/calls_per_failed_trajectory_mean"] = sum(failed) / len(failed)
    return metrics


class _BadReturn(ValueError):
    pass


async def _call(agent: Callable, task: AgentTask, threads: ThreadPoolExecutor | None = None) -> Any:
    """A coroutine function awaited; a plain function in a thread of `threads` (its blocking client must not stall
    the loop; None: the loop's default executor)."""
    if inspect.iscoroutinefunction(agent):
        return await agent(task)
    run = functools.partial(contextvars.copy_context().run, agent, task)
    value = await asyncio.get_running_loop().run_in_executor(threads, run)
    return await value if inspect.isawaitable(value) else value


def _outcome(value: Any) -> tuple[float | None, dict[str, float]]:
    """A float, {"reward": float, "metrics": {...}}, or None (posted, or scored by the env); anything else, an
    infinite or NaN reward or a metric that is not a finite number included, is a bad return naming the field."""
    if value is None:
        return None, {}
    reward, metrics = (value.get("reward"), value.get("metrics")) if isinstance(value, dict) else (value, None)
    if isinstance(value, dict) and "reward" not in value:
        raise _BadReturn(f"the agent returned a dict without 'reward': {sorted(value)}")
    try:
        return checked_outcome(reward, metrics)
    except RewardError as e:
        raise _BadReturn(f"the agent's return value: {e}") from None


class AgentServer:
    """The endpoint served by uvicorn in this event loop (so agents in threads or subprocesses can reach it);
    `async with AgentServer(gateway) as url:`, or `bind()` at start-up and `await serve()` where it is first needed.

    `bind()` takes the port (a port that cannot be bound fails then, naming it) but nothing listens until `serve()`,
    which `announce`s the URL only once the server answers: a run's start-up blocks its event loop for minutes
    (worker start, SFT), and an endpoint announced then would leave early requests hanging; before `serve()` a
    connection is refused at once."""

    def __init__(self, gateway: Gateway, announce: Callable[[str], None] | None = None) -> None:
        self.gateway = gateway
        self.host = gateway.gateway.host
        self.port = gateway.gateway.port  # 0: the free port bind() gets
        self.announce = announce
        self._socket: socket.socket | None = None
        self._server = None
        self._task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def serving(self) -> bool:
        return self._server is not None and self._server.started

    def bind(self) -> str:
        """Take the port, not listening yet (once); the URL. The socket is bound here, not by uvicorn: a port that
        cannot be bound is an OSError naming the keys (uvicorn would exit the process), and gateway.port=0 gets
        a free port with no race."""
        if self._socket is None:
            sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((self.host, self.port))
            except OSError as e:
                sock.close()
                raise OSError(f"the agent endpoint cannot listen on gateway.host={self.host!r}, gateway.port="
                              f"{self.port}: {e}") from e
            self._socket, self.port = sock, sock.getsockname()[1]
        return self.url

    async def serve(self) -> str:
        """Start serving (once; later calls return at once) and announce; the URL it serves at."""
        if self.serving:
            return self.url
        import uvicorn

        from skyrl_stepwise.gateway.app import create_app

        self.bind()
        config = uvicorn.Config(create_app(self.gateway), log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._task = asyncio.ensure_future(self._server.serve(sockets=[self._socket]))
        while not self._server.started:
            if self._task.done():
                self._server = None
                self._task.result()  # raises why it could not start
                raise OSError(f"the agent endpoint stopped before it served on {self.url}")
            await asyncio.sleep(0.01)
        if self.announce is not None:
            self.announce(self.url)
        return self.url

    async def __aenter__(self) -> str:
        return await self.serve()

    async def __aexit__(self, *exc) -> None:
        if self._server is not None:
            self._server.should_exit = True
            await self._task
            self._server = None
        if self._socket is not None:
            self._socket.close()
            self._socket = None
