"""A component that fails to start is named with its root cause on the console's one line and in report.md.

What reaches the driver is rarely the cause. A vLLM engine that refuses its KV cache logs vLLM's `ValueError:
Available memory on node 0 ...` into run.log and raises `RuntimeError: Engine core initialization failed. See root
cause above`, which Ray wraps in `ActorDiedError: The actor died because of an error raised in its creation task,
ray::VLLMWorker.__init__() (pid=..., ...)` and 60 lines of traceback. The retrieval server's crash reaches the
driver as an exit code, its traceback in run.log; an OOM kill reaches it as Ray's worker-exit detail. `starting()`
turns each into `StartupFailure("engine failed to start: ValueError: Available memory on node 0 ...")`, the
traceback staying in run.log (where the caller's logger.exception and the component's own output put it).
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

# "ValueError: ...", "vllm.x.EngineDeadError: ...", "(VLLMWorker pid=7) OSError: ..." (Ray's prefix on a worker's line)
_EXCEPTION_LINE = re.compile(r"^\s*(?:\([^)]*\)\s*)?((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Failure|"
                             r"Interrupt|Warning)): (\S.*)$")
# messages that only point elsewhere: the cause is the line before them, or in the component's own output
_WRAPPERS = re.compile(r"^SystemExit: -?\d*$|see root cause above|see (?:the )?(?:log|above|stderr)|initialization failed\.?$|"
                       r"died because of an error raised in its creation task|exited with code|"
                       r"The actor died unexpectedly|actor is dead because", re.IGNORECASE)
# a record the run's loggers wrote at ERROR or above (host.logs.FILE_FORMAT): "... ERROR [pid 7] uvicorn.error: msg"
_ERROR_RECORD = re.compile(r"^\S+ \S+ (?:ERROR|CRITICAL) \[pid \d+\] ([\w.]+): (\S.*)$")
# Ray's words for a worker the OS or Ray's memory monitor killed
_KILLED = re.compile(r"(?:Worker exit detail|exit_detail)[:=]\s*(.+)|(.*(?:OOM|out of memory|memory pressure|"
                     r"running low on memory|SIGKILL).*)", re.IGNORECASE)
# our knob for what a component's own message names in its own words
HINTS = ((re.compile(r"requested memory for kv|kv[ -]cache", re.IGNORECASE),
          "the engine's KV cache is engine.cpu_kvcache_gib (null: sized by the run's resource plan)"),
         (re.compile(r"address already in use", re.IGNORECASE), "pick a free port or 0 (any free port)"))
TAIL_BYTES = 1 << 20  # the part of run.log a component's start wrote is read from its offset, at most this much
# terminal colours Ray puts around `ray::Actor.__init__()` and worker prefixes: they break a line's match
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# the worker process an error of Ray's names: "(pid=30051, ip=..., actor_id=...)"
_RAY_PID = re.compile(r"\bpid=(\d+)")


class StartupFailure(RuntimeError):
    """`<component> failed to start: <root cause>`: one line, the component's own exception text."""

    def __init__(self, component: str, cause: str, verb: str = "failed to start") -> None:
        super().__init__(f"{component} {verb}: {cause}")
        self.component, self.cause = component, cause


@dataclass(frozen=True)
class LogMark:
    """Where run.log ended when a component began to start: its own output is what follows."""

    path: Path | None
    offset: int

    @classmethod
    def now(cls, path: Path | None) -> "LogMark":
        size = path.stat().st_size if path is not None and path.is_file() else 0
        return cls(path, size)

    def text_since(self) -> str:
        if self.path is None or not self.path.is_file():
            return ""
        with open(self.path, "rb") as f:
            f.seek(max(self.offset, f.seek(0, 2) - TAIL_BYTES))
            return f.read().decode("utf-8", errors="replace")


def _plain(text: str) -> str:
    return _ANSI.sub("", text)


def ray_logs_dir() -> Path | None:
    """This node's Ray log folder while a Ray session is connected (where each worker's stdout/stderr file is)."""
    try:
        import ray
        from ray._private import worker

        if not ray.is_initialized() or worker._global_node is None:
            return None
        return Path(worker._global_node.get_logs_dir_path())
    except Exception:  # no Ray, or a Ray whose private layout moved: the other sources still answer
        return None


def ray_worker_output(texts: list[str], logs_dir: Path | None = None) -> str:
    """What the Ray workers named in an error (`pid=N`) wrote to their own log files on this node.

    A component's output reaches run.log only when Ray was started inside the run's logging; a Ray the user (or a
    test session) started before is not, and its log_to_driver copy arrives at the driver after the exception.
    Ray's per-worker files (`worker-<id>-<job>-<pid>.err`) hold it at once: the worker has died, so they are
    complete. A worker on another node has its files there; the other sources still answer for it.
    """
    logs_dir = logs_dir or ray_logs_dir()
    pids = dict.fromkeys(m for text in texts for m in _RAY_PID.findall(text))
    if logs_dir is None or not pids:
        return ""
    out = []
    for pid in pids:
        for path in sorted(logs_dir.glob(f"worker-*-{pid}.out")) + sorted(logs_dir.glob(f"worker-*-{pid}.err")):
            with contextlib.suppress(OSError):
                with open(path, "rb") as f:
                    f.seek(max(0, f.seek(0, 2) - TAIL_BYTES))
                    out.append(f.read().decode("utf-8", errors="replace"))
    return "\n".join(out)


def _chain(error: BaseException) -> list[BaseException]:
    """The error, what caused it (`raise ... from`, the exception being handled) and Ray's wrapped causes."""
    seen, out, todo = set(), [], [error]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        out.append(e)
        ray_cause = getattr(e, "cause", None)  # RayTaskError.cause / ActorDiedError's task error
        todo += [c for c in (e.__cause__, e.__context__, ray_cause) if isinstance(c, BaseException)]
    return out


def _exception_lines(text: str) -> list[str]:
    """Every `SomeError: message` line of a text (tracebacks, Ray's error strings), in order."""
    found = []
    for line in text.splitlines():
        m = _EXCEPTION_LINE.match(line)
        if m:
            found.append(f"{m.group(1).rsplit('.', 1)[-1] if m.group(1).startswith('ray.') else m.group(1)}: "
                         f"{m.group(2).strip()}")
    return found


def _logged_errors(text: str) -> list[str]:
    """Exception lines and ERROR records of a component's output, in order (uvicorn says why it could not bind
    in an ERROR record, then exits 1)."""
    found = []
    for line in text.splitlines():
        record = _ERROR_RECORD.match(line)
        if record:
            found.append(f"{record.group(2).strip()} ({record.group(1)})")
        else:
            found += _exception_lines(line)
    return found


def _is_wrapper(line: str) -> bool:
    return bool(_WRAPPERS.search(line)) or line.startswith(("RayTaskError", "ActorDiedError", "RayActorError"))


def root_cause(error: BaseException, mark: LogMark | None = None) -> str:
    """The first-hand reason a component did not start: the outermost exception in the chain that is not a
    wrapper, else the last real exception in a remote traceback Ray carries, else the last such exception the
    component wrote to run.log since `mark` or to the Ray worker's own log files, else a kill reason Ray gives,
    else the error's own first line. Terminal colours are removed first."""
    chain = _chain(error)
    texts = [_plain(str(e)) for e in chain]
    direct = [f"{type(e).__name__}: {text.strip().splitlines()[0]}" for e, text in zip(chain, texts)
              if text.strip() and not _is_wrapper(f"{type(e).__name__}: {text.strip().splitlines()[0]}")]
    in_tracebacks = [line for text in texts for line in _exception_lines(text) if not _is_wrapper(line)]
    if direct:  # the outermost that says something itself (a re-raise that adds context beats the bare OSError)
        return direct[0]
    if in_tracebacks:  # Ray's text carries the remote traceback: its last real exception is the one raised
        return in_tracebacks[-1]
    for output in (mark.text_since() if mark else "", ray_worker_output(texts)):
        logged = [line for line in _logged_errors(_plain(output)) if not _is_wrapper(line)]
        if logged:
            return logged[-1]
    for text in texts:
        for line in text.splitlines():
            m = _KILLED.search(line)
            if m:
                return (m.group(1) or m.group(2)).strip()
    first = _plain(str(error)).strip().splitlines()
    return f"{type(error).__name__}: {first[0] if first else '(no message)'}"


@contextlib.contextmanager
def starting(component: str, verb: str = "failed to start") -> Iterator[None]:
    """Run a component's start-up; a failure becomes StartupFailure naming the component and its root cause
    (chained to the original, whose traceback the run's logger puts in run.log). Interrupts pass through."""
    import asyncio

    from skyrl_stepwise.host.logs import active_run_log

    mark = LogMark.now(active_run_log())
    try:
        yield
    except (KeyboardInterrupt, asyncio.CancelledError, StartupFailure):
        raise
    except (Exception, SystemExit) as e:  # a server that calls sys.exit (uvicorn on a taken port) did not start
        cause = root_cause(e, mark)
        hints = [hint for pattern, hint in HINTS if pattern.search(cause)]
        raise StartupFailure(component, cause + (f" [{hints[0]}]" if hints else ""), verb) from e
