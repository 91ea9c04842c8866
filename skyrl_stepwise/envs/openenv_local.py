"""A local OpenEnv server the run starts and stops itself, so a user with an env's ASGI app (what `openenv init`
scaffolds, or any `create_fastapi_app(...)`) needs no second terminal and no port bookkeeping.

    environment.env_classes:
      guess: "openenv:local://my_env.server:app/text?observation_field=prompt"   # uvicorn my_env.server:app
      calc:  "openenv-mcp:local://my_env.server:app/mcp"

`local://MODULE:APP[/PATH]` is served by `python -m uvicorn MODULE:APP` on 127.0.0.1 and a free port (the module must
be importable: on PYTHONPATH or installed); PATH is where the env is mounted in that app. The server starts on the
first trajectory that needs it (never while a config is only being checked), its output goes to the run's run.log,
one server per app is shared by every env class naming it (each trajectory still gets its own session), and it is
stopped when the run's env registry closes (`stop_local_servers`) or, failing that, when the process exits.
A server that exits or stays closed during start-up fails with its module and the key that named it.
"""

from __future__ import annotations

import atexit
import os
import socket
import subprocess
import sys
import threading
import time
from urllib.parse import urlsplit

LOCAL_SCHEME = "local"
START_TIMEOUT_S = 120.0
_servers: dict[str, "LocalServer"] = {}
_lock = threading.Lock()


class LocalServerError(RuntimeError):
    """The local OpenEnv server could not be started: names the app and the key that asked for it."""


def is_local_url(url: str) -> bool:
    return urlsplit(url).scheme == LOCAL_SCHEME


def parse_local_url(url: str, key: str) -> tuple[str, str]:
    """`local://MODULE:APP[/PATH]` -> ("MODULE:APP", "/PATH"), failing naming `key` on a malformed one."""
    parts = urlsplit(url)
    module, sep, app = parts.netloc.partition(":")
    if not (module and sep and app) or not all(p.isidentifier() for p in module.split(".")) or not app.isidentifier():
        raise ValueError(f"{key}: {url!r}: expected local://MODULE:APP[/PATH] (an importable ASGI app, e.g. "
                         "local://my_env.server:app/text)")
    return f"{module}:{app}", parts.path.rstrip("/")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    """One `uvicorn MODULE:APP` child process on 127.0.0.1; `url` once it accepts connections."""

    def __init__(self, app: str, key: str) -> None:
        self.app, self.key = app, key
        self.process: subprocess.Popen | None = None
        self.url = ""

    def start(self, timeout_s: float = START_TIMEOUT_S) -> str:
        from skyrl_stepwise.host.logs import active_run_log

        port = _free_port()
        log_path = active_run_log()
        output = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 - the child keeps it
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", self.app, "--host", "127.0.0.1", "--port", str(port),
             "--log-level", "warning"], stdout=output, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        if output is not subprocess.DEVNULL:
            output.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                code, self.process = self.process.returncode, None
                where = f"; its output is in {log_path}" if log_path else ""
                raise LocalServerError(f"{self.key}: the local OpenEnv server `uvicorn {self.app}` exited with code "
                                       f"{code} during start-up (is the module importable?){where}")
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                self.url = f"http://127.0.0.1:{port}"
                return self.url
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise LocalServerError(f"{self.key}: the local OpenEnv server `uvicorn {self.app}` did not accept connections "
                               f"within {timeout_s:.0f} s")

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def local_server_url(app: str, key: str) -> str:
    """The base URL of the run's server for `app`, started on first use (one per app, shared by env classes)."""
    with _lock:
        server = _servers.get(app)
        if server is None or server.process is None or server.process.poll() is not None:
            server = _servers[app] = LocalServer(app, key)
            server.start()
        return server.url


def is_running(app: str) -> bool:
    """Whether this process's server for `app` is alive (a dead one is restarted for the next trajectory)."""
    server = _servers.get(app)
    return server is not None and server.process is not None and server.process.poll() is None


def running_local_servers() -> dict[str, subprocess.Popen]:
    """app -> its live process (what tests and the run's shutdown look at)."""
    return {app: s.process for app, s in _servers.items() if s.process is not None and s.process.poll() is None}


def stop_local_servers() -> None:
    """Stop every local server this process started (the run's end; also registered with atexit)."""
    with _lock:
        for server in _servers.values():
            server.stop()
        _servers.clear()


atexit.register(stop_local_servers)
