"""A tiny OpenEnv server for tests/test_openenv.py, written with openenv-core's own server helpers: a text env at
/text (guess the color; "crash" kills the server mid-episode) and an MCP env at /mcp (an `add` tool), on
127.0.0.1:PORT (argv[1]), or
served by a run itself as `local://tiny_openenv_server:app` (module-level `app`)."""
import os, sys
import uvicorn
from fastmcp import FastMCP
from openenv.core.env_server.http_server import create_fastapi_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.types import Action, Observation, State


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    prompt: str = ""


class GuessEnv(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self.turns = 0

    def reset(self, seed=None, episode_id=None, **kwargs):
        self.turns = 0
        return GuessObservation(prompt="Guess my color.", done=False, reward=None)

    def step(self, action, timeout_s=None, **kwargs):
        self.turns += 1
        if "crash" in action.message:
            os._exit(1)  # the server dies mid-run
        if "blue" in action.message:
            return GuessObservation(prompt="", done=True, reward=1.0)
        return GuessObservation(prompt="No. Guess again.", done=self.turns >= 3, reward=0.0)

    @property
    def state(self):
        return State(step_count=self.turns)


class CalcEnv(MCPEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        mcp = FastMCP("calc")

        @mcp.tool
        def add(a: int, b: int) -> int:
            """Add two integers."""
            return a + b

        super().__init__(mcp)
        self.turns = 0

    def reset(self, seed=None, episode_id=None, **kwargs):
        return Observation(done=False, reward=None, metadata={})

    def _step_impl(self, action, timeout_s=None, **kwargs):
        return Observation(done=True, reward=0.0)

    @property
    def state(self):
        return State(step_count=0)


from fastapi import FastAPI

app = FastAPI()  # module level, so a run can serve it itself: openenv:local://tiny_openenv_server:app/text
app.mount("/text", create_fastapi_app(GuessEnv, GuessAction, Observation, max_concurrent_envs=8))
app.mount("/mcp", create_fastapi_app(CalcEnv, Action, Observation, max_concurrent_envs=8))

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
