"""The container sandbox backend (`environment.sandbox.backend: docker | podman`): the docker or podman CLI, driven
by subprocess (no Python client library).

One long-lived container per trajectory, started detached (`run -d`) from a pre-pulled image (`--pull never`: a
run never downloads anything) with: no network unless the task asks (`--network none`), a read-only root, a
size-capped `--tmpfs /tmp`, a TOTAL memory cap (`--memory` = `--memory-swap`, so no swap: what bwrap's per-process
RLIMIT_AS cannot give), `--pids-limit`, `--cpus`, `--cap-drop ALL`, `--security-opt no-new-privileges`, a non-root
`--user`, `--init` (reaps orphans), and the trajectory's private working dir bind-mounted at /work as the only
writable host path. Each `run()` is a `docker exec` of a small shell wrapper that sets the per-run rlimits
(`ulimit`: CPU, address space, file size, open files; what bwrap's preexec sets), prints the start marker, runs the
command, then kills every process the command left (`kill -KILL -1`: the commands run as their own uid, the
container's keeper as another, so the keeper survives). Output cap, wall clock, disk watchdog and the stop-reason
mapping are runner.py's, shared with bwrap; a run the host stopped (timeout, output cap, disk) or that was killed
gets the same kill from outside, and a SIGKILL is told apart as an OOM kill by the container cgroup's `oom_kill`
count (or `inspect`'s OOMKilled). `close()` is `rm -f`, also on exceptions and on garbage collection; every
container carries a label naming its owner (host + pid), so the next start-up removes those a killed trainer left.

Unlike bwrap (a fresh PID namespace per run), processes of one trajectory share the container between runs; the
wrapper's kill at the end of every run keeps files.py's guarantee that no sandboxed process runs while the host
reads or writes the working dir.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import weakref
from pathlib import Path

from skyrl_stepwise.sandbox.base import Limits, RunResult, SandboxMetrics, SandboxUnavailable, StopReason, pid_alive
from skyrl_stepwise.sandbox.bwrap import (
    DIR_PREFIX,
    START_MARKER,
    START_MARKER_PRINTF,
    WORKDIR_IN_SANDBOX,
    _allocate_credentials,
    _remove_quietly,
    sweep_stale_dirs,
)
from skyrl_stepwise.sandbox.files import HostWorkdir, copy_in
from skyrl_stepwise.sandbox.runner import Run, SandboxClosed, run_process

CONTAINER_CLIS = ("docker", "podman")
OWNER_LABEL = "skyrl-sandbox.owner"  # value "<hostname>/<pid>": the start-up sweep removes a dead pid's containers
KEEPER_UID = 65534  # the container's own process (nobody): never the uid the commands run as, so they cannot kill it
KILL_ALL = "kill -KILL -1 2>/dev/null"  # every process the caller's uid may signal but pid 1 and the caller
OOM_PROBE = "cat /sys/fs/cgroup/memory.events 2>/dev/null || cat /sys/fs/cgroup/memory/memory.oom_control"
CLI_TIMEOUT_S = 60.0  # run -d / rm -f / inspect / the out-of-band kill: a hung daemon fails, it does not hang us
_PR_SET_PDEATHSIG = 1
KEY = "environment.sandbox.backend"


def cli_binary(cli: str) -> str:
    """Path of the docker / podman CLI; SandboxUnavailable naming the key where it is not on PATH."""
    if cli not in CONTAINER_CLIS:
        raise ValueError(f"{KEY}: {cli!r} is not a container backend (one of {list(CONTAINER_CLIS)})")
    found = shutil.which(cli)
    if not found:
        raise SandboxUnavailable(f"{KEY}={cli}: no `{cli}` on PATH; install it, or use {KEY}=bwrap")
    return found


def cli_env() -> dict[str, str]:
    """What the CLI needs from the trainer's environment to reach its daemon (DOCKER_HOST, a rootless podman's
    XDG_RUNTIME_DIR, ~/.docker's HOME...); the container's own environment is set explicitly (`-e`), never this."""
    keep = ("PATH", "HOME", "USER", "XDG_RUNTIME_DIR", "XDG_CONFIG_HOME", "CONTAINER_HOST", "CONTAINERS_CONF")
    env = {k: v for k, v in os.environ.items() if k in keep or k.startswith("DOCKER_")}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    return env


def owner_label() -> str:
    """This process's owner label value."""
    return f"{socket.gethostname()}/{os.getpid()}"


def container_run_argv(cli: str, image: str, workdir: Path, limits: Limits, network: bool, cpus: float,
                       user: tuple[int, int]) -> list[str]:
    """`run -d` of one trajectory's container: every limit that is fixed for the container's life."""
    memory = limits.memory_bytes + limits.tmp_bytes  # tmpfs pages are charged to the container's memory cgroup
    keeper = KEEPER_UID if user[0] != KEEPER_UID else KEEPER_UID - 1
    return [
        cli_binary(cli), "run", "-d", "--pull", "never", "--label", f"{OWNER_LABEL}={owner_label()}",
        *([] if network else ["--network", "none"]),
        "--read-only", "--tmpfs", f"/tmp:rw,exec,nosuid,nodev,size={limits.tmp_bytes},mode=1777",
        "--memory", str(memory), "--memory-swap", str(memory),
        # the keeper and --init take two; each run's wrapper shell one more
        "--pids-limit", str(limits.processes + 4), "--cpus", f"{cpus:g}",
        "--cap-drop", "ALL", "--security-opt", "no-new-privileges", "--ulimit", "core=0",
        "--user", f"{keeper}:{keeper}", "--init",
        "--mount", f"type=bind,source={workdir},target={WORKDIR_IN_SANDBOX}", "--workdir", WORKDIR_IN_SANDBOX,
        *_container_env(),
        image, "sleep", "infinity",
    ]


def _container_env() -> list[str]:
    """The commands' environment (bwrap's --setenv list)."""
    env = {"HOME": WORKDIR_IN_SANDBOX, "TMPDIR": "/tmp", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
    return [arg for k, v in env.items() for arg in ("-e", f"{k}={v}")]


def wrapper_script(limits: Limits) -> str:
    """The shell that runs one command: rlimits first (if one fails, no start marker: the sandbox's failure, not
    the command's), the marker, the command as a fresh shell's script ($1, never pasted in), then the kill of
    whatever it left behind, and its exit status (128+N for a signal, as bwrap reports it)."""
    kib = max(limits.memory_bytes // 1024, 1)
    blocks = max(limits.file_size_bytes // 512, 1)  # POSIX sh's `ulimit -f` unit (dash, busybox, bash as sh)
    # soft CPU first (a hard limit below the current soft one is EINVAL), then hard = soft + 1: SIGXCPU, then KILL
    return (f"ulimit -S -t {limits.cpu_s} && ulimit -H -t {limits.cpu_s + 1} && ulimit -v {kib} && "
            f"ulimit -f {blocks} && ulimit -n {limits.open_files} && ulimit -c 0 || exit 125\n"
            f"printf '{START_MARKER_PRINTF}'\n"
            "/bin/sh -c \"$1\"\n"
            "rc=$?\n"
            f"{KILL_ALL}\n"
            "exit $rc\n")


def container_exec_argv(cli: str, container: str, command: str, limits: Limits, user: tuple[int, int]) -> list[str]:
    """`exec` of one command in the trajectory's container, as the commands' uid, cwd /work."""
    return [cli_binary(cli), "exec", "-i", "--user", f"{user[0]}:{user[1]}", "--workdir", WORKDIR_IN_SANDBOX,
            *_container_env(), container, "/bin/sh", "-c", wrapper_script(limits), "sh", command]


def sweep_stale_containers(cli: str) -> list[str]:
    """Remove this host's sandbox containers whose owning trainer is dead (SIGKILLed: its `close()` never ran),
    found by their owner label; another host's or a live process's containers are left alone."""
    path = cli_binary(cli)
    listed = _cli([path, "ps", "-a", "-q", "--no-trunc", "--filter", f"label={OWNER_LABEL}"])
    removed = []
    host = socket.gethostname()
    for cid in listed.stdout.split() if listed.returncode == 0 else []:
        # `inspect` with index .Config.Labels reads the same in docker and podman (their `ps` templates differ)
        owner = _cli([path, "inspect", "--format", '{{index .Config.Labels "%s"}}' % OWNER_LABEL, cid]).stdout
        owner_host, _, pid = owner.strip().rpartition("/")
        if owner_host == host and pid.isdigit() and not pid_alive(int(pid)):
            if _cli([path, "rm", "-f", cid]).returncode == 0:
                removed.append(cid)
    return removed


@functools.lru_cache(maxsize=None)
def check_container_available(cli: str, image: str) -> str:
    """Refuse (SandboxUnavailable naming environment.sandbox.backend and the CLI's own reason) unless the CLI
    reaches its daemon, the image is on this host, and a container of it runs `true`; then sweep what a killed
    trainer left. Returns the CLI's path. Never falls back to bwrap or to the host."""
    path = cli_binary(cli)
    info = _cli([path, "version"])
    if info.returncode != 0:
        raise SandboxUnavailable(f"{KEY}={cli}: `{cli} version` failed, so no container can start: {_reason(info)}"
                                 f"; start the {cli} daemon (or service/socket), or use {KEY}=bwrap")
    image_check = _cli([path, "image", "inspect", image])
    if image_check.returncode != 0:
        raise SandboxUnavailable(f"{KEY}={cli}: image {image!r} (environment.sandbox.image) is not on this host "
                                 f"({_reason(image_check)}); `{cli} pull {image}` first (runs never pull)")
    sweep_stale_containers(cli)
    sweep_stale_dirs(Path(tempfile.gettempdir()))
    with ContainerSandbox(cli, image, metrics=SandboxMetrics()) as probe:
        result = probe.run("true", limits=Limits(wall_s=60.0))
    if not result.ok:
        raise SandboxUnavailable(f"{KEY}={cli}: a container of {image!r} could not run `true` "
                                 f"({result.describe()}): {result.stderr.strip()[:500]!r}")
    return path


def _cli(argv: list[str], timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
    """One short CLI call (captured, text); a missing binary or a hang becomes a failed CompletedProcess."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=cli_env(),
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        return subprocess.CompletedProcess(argv, 255, "", f"{type(e).__name__}: {e}")


def _with_reason(result: RunResult, reason: StopReason) -> RunResult:
    """The same result under another stop reason."""
    import dataclasses

    return dataclasses.replace(result, stop_reason=reason)


def _reason(proc: subprocess.CompletedProcess) -> str:
    """The CLI's own words for a failure (its last stderr lines, else stdout)."""
    text = (proc.stderr or "").strip() or (proc.stdout or "").strip() or f"exit code {proc.returncode}"
    return " | ".join(text.splitlines()[-3:])[:600]


def _preexec() -> None:
    """The CLI dies with the thread that started it (a killed trainer leaves no `exec` client behind). No rlimits
    here: they are the wrapper's, inside the container (a Go CLI under RLIMIT_AS may not even start)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _cleanup(cli_path: str, container: list[str], base: Path, runs: set[Run], start_lock: threading.Lock) -> None:
    """Kill every live exec client, remove the container (`rm -f` kills what runs in it) and the working dir."""
    with start_lock:
        live = list(runs)
    for run in live:
        run.kill()
    if container:
        _cli([cli_path, "rm", "-f", container[0]])
    _remove_quietly(base)  # any depth, any modes the container's processes left


class ContainerSandbox(HostWorkdir):
    """One trajectory's container (docker or podman): a private working dir at /work, runs one at a time. The
    same RunResult, stop reasons and metrics as BwrapSandbox; open it through backends.open_sandbox."""

    def __init__(self, cli: str = "docker", image: str = "python:3.11-slim", files_from: Path | None = None,
                 limits: Limits | None = None, network: bool = False, metrics: SandboxMetrics | None = None,
                 cpus: float = 1.0, root: Path | None = None) -> None:
        self.cli = cli
        self.cli_path = cli_binary(cli)
        self.image = image
        self.cpus = cpus
        self.limits = limits or Limits()
        self.network = network
        self.metrics = metrics if metrics is not None else SandboxMetrics()
        creds = _allocate_credentials()  # a root trainer's commands get an unprivileged uid of their own
        self._owner = (creds.uid, creds.gid) if creds else None
        self.user = self._owner or (os.getuid(), os.getgid())
        base = Path(tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-", dir=root))
        os.chmod(base, 0o700)
        self.workdir = base / "work"
        self.workdir.mkdir(mode=0o700)
        self._container: list[str] = []  # filled once `run -d` answered (a list: the finalizer sees it)
        self._runs: set[Run] = set()
        self._lock = threading.Lock()
        self._start_lock = threading.Lock()
        self._closed = False
        self._oom_kills = 0
        self._finalizer = weakref.finalize(self, _cleanup, self.cli_path, self._container, base, self._runs,
                                           self._start_lock)
        try:
            if files_from is not None:
                copy_in(Path(files_from), self.workdir)
            if self._owner is not None:
                for dirpath, dirnames, filenames in os.walk(self.workdir):
                    for name in [dirpath, *(os.path.join(dirpath, n) for n in dirnames + filenames)]:
                        os.lchown(name, *self._owner)
            self._start()
        except BaseException:
            self.close()
            raise
        self.metrics.count("started")

    def _start(self) -> None:
        """`run -d`: the container id, or SandboxUnavailable with the CLI's reason."""
        argv = container_run_argv(self.cli, self.image, self.workdir, self.limits, self.network, self.cpus, self.user)
        proc = _cli(argv)
        cid = proc.stdout.strip().splitlines()[-1] if proc.returncode == 0 and proc.stdout.strip() else ""
        if not cid:
            raise SandboxUnavailable(f"{KEY}={self.cli}: could not start a container from image {self.image!r}: "
                                     f"{_reason(proc)}")
        self._container.append(cid)

    @property
    def container_id(self) -> str | None:
        """The container's id (None before it started)."""
        return self._container[0] if self._container else None

    def run(self, command: str, stdin: str | bytes | None = None, limits: Limits | None = None) -> RunResult:
        """Run `command` with /bin/sh in the container, cwd /work; blocking (call it off the event loop)."""
        limits = limits or self.limits
        data = stdin.encode() if isinstance(stdin, str) else stdin
        with self._lock:
            if self._closed:
                raise RuntimeError("this sandbox is closed")
            argv = container_exec_argv(self.cli, self.container_id, command, limits, self.user)
            try:
                result = run_process(argv, data, limits, _preexec, self.workdir, self._runs, START_MARKER,
                                     self._start_lock, lambda: self._closed, env=cli_env())
            except (SandboxClosed, SandboxUnavailable):
                if not self._closed:
                    raise
                result = RunResult(stdout="", stderr="", exit_code=None, signal=None, stop_reason=StopReason.KILLED,
                                   wall_s=0.0, cpu_s=0.0, truncated=False)
            if result.stop_reason is not StopReason.EXITED and not self._closed:
                self._kill_leftovers()  # the host stopped the exec client: what it ran inside is still there
                if result.stop_reason is StopReason.KILLED and result.signal == signal.SIGKILL and self._oom_killed():
                    result = _with_reason(result, StopReason.MEMORY_LIMIT)
        self.metrics.count_run(result.stop_reason, result.wall_s)
        return result

    def _kill_leftovers(self) -> None:
        """Kill every process of the commands' uid in the container (pid 1 and the keeper are another uid)."""
        proc = _cli([self.cli_path, "exec", "--user", f"{self.user[0]}:{self.user[1]}", self.container_id,
                     "/bin/sh", "-c", KILL_ALL])
        if proc.returncode not in (0, 1) and not self._closed:
            raise SandboxUnavailable(f"{KEY}={self.cli}: could not kill the processes a stopped run left in "
                                     f"container {self.container_id}: {_reason(proc)}")

    def _oom_killed(self) -> bool:
        """Whether the container's memory cgroup killed a process since the last look (cgroup v2 memory.events'
        oom_kill, v1's oom_control), else whether `inspect` says the container itself was OOM-killed."""
        proc = _cli([self.cli_path, "exec", self.container_id, "/bin/sh", "-c", OOM_PROBE])
        for line in proc.stdout.splitlines() if proc.returncode == 0 else []:
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                seen, self._oom_kills = self._oom_kills, max(self._oom_kills, int(value))
                return int(value) > seen
        inspect = _cli([self.cli_path, "inspect", "-f", "{{.State.OOMKilled}}", self.container_id])
        return inspect.returncode == 0 and inspect.stdout.strip().lower() == "true"
