"""Start the retrieval server as a child process for a run, wait until healthy, stop it on exit; tied to the run's
life (host/lifeline.py), so a run killed outright does not leave it holding its port and memory."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from typing import Iterator

import httpx

from skyrl_stepwise.host.lifeline import arm


@contextlib.contextmanager
def local_retriever(corpus: str, kind: str = "bm25", port: int = 0,
                    timeout_s: float = 300.0) -> Iterator[str]:
    """Yield the /retrieve URL of a server on 127.0.0.1 over the corpus JSONL at `corpus`; the index is built
    (once) before it is healthy."""
    if not port:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "skyrl_stepwise.retrieval.server", "--port", str(port), "--retriever", kind,
           "--corpus", str(corpus)]
    arm()  # the server dies with this process, also when it is SIGKILLed
    proc = subprocess.Popen(cmd)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"retrieval server exited with code {proc.returncode}: {' '.join(cmd)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"retrieval server not healthy after {timeout_s:.0f} s: {' '.join(cmd)}")
            time.sleep(0.5)
        yield f"{base}/retrieve"
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        if proc.poll() is None:
            proc.kill()
