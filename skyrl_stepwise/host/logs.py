"""Where a run's output goes: our own lines and every warning to the console, everything to `<run dir>/run.log`.

A researcher watching a run wants one line per start-up phase, a bar per phase of a step and a line per step;
vLLM, Ray, transformers and wandb print hundreds of lines that matter only when something goes wrong. So:

- Driver: the root logger gets a console handler (records of `skyrl_stepwise` and `hydra` at
  `logging.console_level` and up, anything else at WARNING and up) and a file handler on run.log (everything at
  `logging.file_level` and up). Libraries that install handlers of their own (Ray, transformers) are made to
  propagate to these instead, and Python warnings are logged, so a warning from any of them still reaches the
  console.
- Ray workers (the vLLM engine, the FSDP ranks): `route_worker_logs` runs in every worker process of the run
  (Ray's `worker_process_setup_hook`) and points the process's stdout/stderr at run.log, which catches vLLM's
  INFO lines, weight-loading bars and C++ prints alike; WARNING and up are also written to the worker's original
  stderr, which Ray forwards to the driver's console.

Child processes the driver starts (the retrieval server) inherit run.log as their output (`children_output_to`).
Nothing here is active outside `run_logging`, so tests and notebooks keep the libraries' defaults.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import sys
from pathlib import Path
from typing import Iterator

OWN_LOGGERS = ("skyrl_stepwise", "hydra")  # shown on the console at logging.console_level
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
RUN_LOG_ENV = "SKYRL_STEPWISE_RUN_LOG"
FILE_LEVEL_ENV = "SKYRL_STEPWISE_FILE_LEVEL"
CONSOLE_LEVEL_ENV = "SKYRL_STEPWISE_CONSOLE_LEVEL"
# per-request INFO lines (one per search call) that would bury everything else in run.log
CHATTY_LOGGERS = ("httpx", "httpcore", "urllib3", "filelock", "fsspec", "asyncio", "matplotlib", "PIL")
FILE_FORMAT = "%(asctime)s %(levelname)s [pid %(process)d] %(name)s: %(message)s"

_active: dict | None = None  # the run's log file and levels while `run_logging` is open

# Dependency warnings every run prints that tell a user nothing they can act on (vLLM-on-CPU start-up notes, Ray's
# token notice, a deprecation inside vLLM's own API): run.log only. Matched by logger prefix and message start,
# so a new or different warning from the same component still reaches the console; ours always do.
BENIGN_WARNINGS = (
    ("ray._private.authentication", "Token authentication is enabled for this Ray cluster"),
    ("vllm.triton_utils", "Triton is installed, but doesn't include CPU backend"),
    ("vllm.platforms.cpu", "Triton is not installed. triton-cpu is expected"),
    ("vllm.platforms.cpu", "Reset SSM cache type to float32"),
    ("vllm.engine.arg_utils", "The global random seed is set to"),
    ("vllm.config", "Enforce eager set, disabling torch.compile"),
    ("vllm.config", "Inductor compilation was disabled by user settings"),
    ("vllm.config", "Model Runner V2 requires Triton"),
    ("vllm.v1.engine.input_processor", "Passing raw prompts to InputProcessor is deprecated"),
)


def is_benign_warning(record: logging.LogRecord) -> bool:
    """A known dependency warning a user cannot act on (BENIGN_WARNINGS): kept in run.log, off the console."""
    if record.levelno >= logging.ERROR:
        return False
    message = record.getMessage().lstrip()
    return any(record.name.startswith(prefix) and message.startswith(start) for prefix, start in BENIGN_WARNINGS)


class BenignWarningFilter(logging.Filter):
    """Drops BENIGN_WARNINGS from a console handler (workers forward theirs to the driver's console)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not is_benign_warning(record)


def parse_level(value: str, key: str) -> int:
    """A level name from the config as a logging level; a typo fails naming the key, not deep inside logging."""
    name = str(value).upper()
    if name not in LEVELS:
        raise ValueError(f"{key} must be one of {', '.join(LEVELS)}, got {value!r}")
    return logging.getLevelName(name)


class ConsoleFilter(logging.Filter):
    """Our own records at the console level; anyone else's only when they are warnings or errors."""

    def __init__(self, own_level: int) -> None:
        super().__init__()
        self.own_level = own_level
        self.other_level = max(own_level, logging.WARNING)

    def filter(self, record: logging.LogRecord) -> bool:
        own = record.name.split(".", 1)[0] in OWN_LOGGERS
        if not own and is_benign_warning(record):
            return False
        return record.levelno >= (self.own_level if own else self.other_level)


class _Trimmed(logging.Formatter):
    """No trailing newline of a message (Python warnings end with one) becomes an empty console line."""

    def format(self, record: logging.LogRecord) -> str:
        return super().format(record).rstrip()


class ConsoleFormatter(logging.Formatter):
    """Our lines as plain sentences with the time; other components' with level and logger name, so a
    warning says where it came from."""

    def __init__(self) -> None:
        super().__init__(datefmt="%H:%M:%S")
        self.own = _Trimmed("%(asctime)s %(message)s", datefmt="%H:%M:%S")
        self.other = _Trimmed("%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        own = record.name.split(".", 1)[0] in OWN_LOGGERS and record.levelno < logging.WARNING
        return (self.own if own else self.other).format(record)


def adopt_library_loggers(file_level: int | None = None) -> None:
    """Make the libraries that print through handlers of their own log through ours (root) instead.

    Ray's `ray` logger and transformers' library logger do not propagate; left alone they write INFO chatter
    straight to the terminal, and their warnings would bypass run.log. Only libraries already imported are
    touched (ensure_ray calls this again once Ray is up).
    """
    if file_level is None:
        file_level = _active["file_level"] if _active else logging.INFO
    if "ray" in sys.modules:
        ray_logger = logging.getLogger("ray")
        for handler in list(ray_logger.handlers):
            ray_logger.removeHandler(handler)
        ray_logger.propagate = True
    if "transformers" in sys.modules or importlib.util.find_spec("transformers") is not None:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_default_handler()
        hf_logging.enable_propagation()
    for name in CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.DEBUG if file_level <= logging.DEBUG else logging.WARNING)


def _prints_to_terminal(handler: logging.Handler) -> bool:
    return (isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)
            and getattr(handler, "stream", None) in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__))


@contextlib.contextmanager
def run_logging(run_dir: str | os.PathLike, console_level: str = "INFO", file_level: str = "INFO") -> Iterator[Path]:
    """Route this process's logging for one run (see the module docstring); yields run.log's path.

    Everything is put back on exit, so the next job of a Hydra sweep starts clean and writes its own run.log.
    """
    global _active
    console_lvl = parse_level(console_level, "logging.console_level")
    file_lvl = parse_level(file_level, "logging.file_level")
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = (run_dir / "run.log").resolve()

    root = logging.getLogger()
    # handlers printing to the terminal (Hydra's, a notebook's basicConfig) are replaced by ours; others (a test
    # runner's capture, someone's file) keep receiving records
    saved_handlers = [h for h in root.handlers if _prints_to_terminal(h)]
    saved_level = root.level
    saved_env = {k: os.environ.get(k) for k in ("WANDB_SILENT",)}
    file_handler = logging.FileHandler(path, mode="a", encoding="utf-8")
    file_handler.setLevel(file_lvl)
    file_handler.setFormatter(logging.Formatter(FILE_FORMAT))
    console = logging.StreamHandler(sys.stdout)
    console.addFilter(ConsoleFilter(console_lvl))
    console.setFormatter(ConsoleFormatter())
    for handler in saved_handlers:
        root.removeHandler(handler)
    root.addHandler(console)
    root.addHandler(file_handler)
    root.setLevel(min(console_lvl, file_lvl))
    adopt_library_loggers(file_lvl)
    logging.captureWarnings(True)
    os.environ["WANDB_SILENT"] = "true"  # wandb's banner and sync hints; report.md says where its files are
    _active = {"path": path, "file_level": file_lvl, "console_level": console_lvl}
    try:
        yield path
    finally:
        _active = None
        logging.captureWarnings(False)
        for handler in (console, file_handler):
            root.removeHandler(handler)
        file_handler.close()
        for handler in saved_handlers:
            root.addHandler(handler)
        root.setLevel(saved_level)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def active_run_log() -> Path | None:
    """run.log of the run being logged, if any."""
    return _active["path"] if _active else None


def ray_init_options() -> dict:
    """Extra `ray.init` arguments that send the run's Ray workers' output to run.log.

    Empty outside `run_logging` (a caller's own Ray, tests): their output then reaches the driver as usual.
    The environment variables are job-wide, so every actor gets them; an actor's own runtime_env env_vars
    (the vLLM engine's) are merged with them by Ray.
    """
    if _active is None:
        return {}
    env = {
        RUN_LOG_ENV: str(_active["path"]),
        FILE_LEVEL_ENV: logging.getLevelName(_active["file_level"]),
        CONSOLE_LEVEL_ENV: logging.getLevelName(max(_active["console_level"], logging.WARNING)),
        "VLLM_CONFIGURE_LOGGING": "0",  # vLLM's loggers propagate to the worker's root logger (below)
        "TQDM_DISABLE": "1",  # weight-loading bars: a few hundred \r-updates per rank in a file nobody watches
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    }
    return {"configure_logging": False,
            "runtime_env": {"worker_process_setup_hook": f"{__name__}.route_worker_logs", "env_vars": env}}


def route_worker_logs() -> None:
    """Ray `worker_process_setup_hook`: this worker's output into run.log, its warnings to the driver's console.

    Runs before any actor code, so everything the worker later prints (vLLM INFO lines, weight-loading bars,
    NCCL/gloo messages from C++) lands in run.log through the redirected file descriptors 1 and 2. Ray forwards
    what its per-worker stderr file receives to the driver, so the records at WARNING and up are written there.
    """
    path = os.environ.get(RUN_LOG_ENV)
    if not path:
        return
    try:  # e.g. a worker on another node of a cluster, where the driver's run dir does not exist
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as e:
        print(f"skyrl_stepwise: cannot write {path} ({e}); this worker's output goes to Ray's logs", file=sys.stderr)
        return
    sys.stdout.flush()
    sys.stderr.flush()
    forwarded = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8", errors="replace")
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    file_lvl = parse_level(os.environ.get(FILE_LEVEL_ENV, "INFO"), FILE_LEVEL_ENV)
    forward_lvl = parse_level(os.environ.get(CONSOLE_LEVEL_ENV, "WARNING"), CONSOLE_LEVEL_ENV)
    to_file = logging.StreamHandler(sys.stderr)  # fd 2: run.log now
    to_file.setLevel(file_lvl)
    to_file.setFormatter(logging.Formatter(FILE_FORMAT))
    to_console = logging.StreamHandler(forwarded)
    to_console.setLevel(forward_lvl)
    to_console.setFormatter(_Trimmed("%(levelname)s %(name)s: %(message)s"))
    to_console.addFilter(BenignWarningFilter())
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.addHandler(to_file)
    root.addHandler(to_console)
    root.setLevel(min(file_lvl, forward_lvl))
    adopt_library_loggers(file_lvl)
    logging.captureWarnings(True)


@contextlib.contextmanager
def children_output_to(path: str | os.PathLike | None) -> Iterator[None]:
    """Processes started inside the block write their stdout/stderr to `path` (they inherit fds 1 and 2).

    For child processes whose launcher takes no log file (the local retrieval server): its start-up lines and
    index-building bars go to run.log, its crash still fails the run. The driver's own console output is
    restored when the block ends; nothing else in the driver runs meanwhile. A None path changes nothing.
    """
    if path is None:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (fd, *saved):
            os.close(f)
