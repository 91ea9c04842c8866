"""Run one sandboxed command as a host process: feed stdin, read stdout/stderr under a cap, enforce the wall
clock and the working-dir size, kill the whole process group when a limit is passed, and say why the run stopped.
The working-dir cap is polled by a watchdog process of its own (disk_watch.py: a trainer busy in other threads
cannot delay it); this process checks it too, and once more after the run.

Output is read in chunks and only the first `Limits.output_bytes` are kept; past that the run is killed, so a
program printing gigabytes costs the reader a few kilobytes of memory. Killing the process group kills bwrap,
whose sandbox init then dies (`--die-with-parent`) and takes every process of the PID namespace with it.
A trainer that dies leaves nothing either, whenever it dies: bwrap holds the parent-death signal (make_preexec),
the sandbox's init the run's lifeline (bwrap.INIT), and a bwrap child caught between bwrap's clone() and its own
parent-death signal is killed by the trainer's disk watchdog (leftovers.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import resource
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from skyrl_stepwise.sandbox.base import Limits, RunResult, SandboxUnavailable, StopReason
from skyrl_stepwise.sandbox.disk_watch import DISK_WATCH
from skyrl_stepwise.sandbox.files import over_cap

_PR_SET_PDEATHSIG = 1
_KEYCTL_JOIN_SESSION_KEYRING = 1
_SYS_KEYCTL = {"x86_64": 250, "aarch64": 219}.get(os.uname().machine)
_WATCH_EVERY_S = 0.1  # how often this process also checks the working dir's size (the cap is disk_watch's)
# how often the CPU time of the run's processes is read (tree_cpu_s: ~1 ms per process on a loaded 2-core box); also
# read right before any kill of ours, so only a kill by the disk watchdog can miss the last period's
_CPU_EVERY_S = 0.5
# stderr text by which a limit shows when the program handled the failure itself and exited (kernel refusals
# surface as errno messages, not signals): checked only for a failed exit, last 4 KiB of stderr
_STDERR_MARKERS: tuple[tuple[StopReason, tuple[str, ...]], ...] = (
    # a thread refused: under RLIMIT_AS each thread's stack (8 MiB) and malloc arena (64 MiB) run out of address
    # space long before RLIMIT_NPROC counts 64 threads
    (StopReason.MEMORY_LIMIT, ("MemoryError", "Cannot allocate memory", "std::bad_alloc", "out of memory",
                               "can't start new thread", "unable to create native thread",
                               "failed to create new OS thread")),
    (StopReason.FILE_SIZE_LIMIT, ("File too large", "File size limit exceeded")),
    (StopReason.CPU_LIMIT, ("CPU time limit exceeded",)),  # the shell's word for a child killed by SIGXCPU
    (StopReason.DISK_LIMIT, ("No space left on device", "Disk quota exceeded")),
    (StopReason.PROCESS_LIMIT, ("Resource temporarily unavailable", "Cannot fork", "can't fork", "fork: retry")),
)


@dataclasses.dataclass(frozen=True)
class Credentials:
    """The host uid/gid a sandbox's processes run as (only when the trainer is root: root's processes are exempt
    from RLIMIT_NPROC, so a fork bomb would be unbounded; each sandbox gets its own unprivileged uid)."""

    uid: int
    gid: int


def make_preexec(limits: Limits, creds: Credentials | None) -> Callable[[], None]:
    """The child's set-up before exec'ing bwrap: drop to the sandbox's uid, join a fresh, empty session keyring (the
    trainer's may hold secrets: keys are not namespaced by bwrap; the seccomp filter also refuses keyctl), ask the
    kernel to SIGKILL it when the thread that started it dies (so a killed trainer leaves nothing), and set the
    per-process rlimits. RLIMIT_NPROC is set inside the sandbox instead (its init), where it counts only the
    sandbox's own processes.

    The kernel never fires a parent-death signal set after the parent died: a trainer killed between the fork and
    the prctl would leave this child to exec bwrap unwatched. So once the signal is set the child checks that its
    parent is still the process that made this set-up, and kills itself where it is not."""
    libc = ctypes.CDLL(None, use_errno=True)
    prctl = libc.prctl
    syscall = libc.syscall
    rlimits = [
        (resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1)),
        (resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes)),
        (resource.RLIMIT_FSIZE, (limits.file_size_bytes, limits.file_size_bytes)),
        (resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files)),
        (resource.RLIMIT_CORE, (0, 0)),
    ]

    parent = os.getpid()

    def preexec() -> None:
        if creds is not None:
            os.setgroups([])
            os.setgid(creds.gid)
            os.setuid(creds.uid)
        if _SYS_KEYCTL is not None and syscall(_SYS_KEYCTL, _KEYCTL_JOIN_SESSION_KEYRING, None) < 0:
            raise OSError(ctypes.get_errno(), "keyctl(KEYCTL_JOIN_SESSION_KEYRING) refused")
        # after the uid change: changing credentials clears the parent-death signal
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # it died before the signal was set: nothing would ever fire
            os.kill(os.getpid(), signal.SIGKILL)
        for which, value in rlimits:
            resource.setrlimit(which, value)

    return preexec


class Run:
    """The bwrap process of a run and the init of its PID namespace (the command, `--as-pid-1`). Killing bwrap
    makes the kernel kill its init, whose exit kills the namespace; that happens after bwrap is reaped, so a kill
    also SIGKILLs the init directly and waits until it has exited: when `run()` returns nothing of it is left."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.init_pids: list[int] = []
        self.cpu_seen = 0.0  # the most CPU seconds the run's processes were seen to hold together (tree_cpu_s)
        # held while bwrap is reaped and while it is killed: a kill (close() in another thread) never signals the
        # pid or process group of a bwrap already reaped, whose id the kernel may have given to another process
        self.reap_lock = threading.Lock()

    def note_started(self) -> None:
        """Record the namespace's init (bwrap's child) once the command has printed: it exists by then."""
        if not self.init_pids and self.proc.returncode is None:
            self.init_pids = _children(self.proc.pid)

    def kill(self) -> None:
        """SIGKILL the namespace's init (while bwrap, its parent, is alive: the pid cannot be reused) and bwrap's
        process group; nothing once bwrap was reaped (its ids may belong to another process by then)."""
        with self.reap_lock:
            if self.proc.returncode is not None:
                return
            self.note_started()
            self._sample_cpu_locked()
            for pid in self.init_pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _kill_group(self.proc)

    def reap(self, block: bool) -> tuple[int, int, object] | None:
        """wait4 bwrap (killed first when `block`): (pid, status, rusage), or None while it runs; under the lock
        kill() takes, and the return code is set before the lock is let go."""
        with self.reap_lock:
            if block:
                self.note_started()
                self._sample_cpu_locked()
                for pid in self.init_pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                _kill_group(self.proc)
            pid, status, usage = os.wait4(self.proc.pid, 0 if block else os.WNOHANG)
            if not pid:
                return None
            self.proc.returncode = os.waitstatus_to_exitcode(status)
            return pid, status, usage

    def sample_cpu(self) -> None:
        """Note the CPU seconds of every process of the run now (while bwrap lives: no pid of it can be reused)."""
        with self.reap_lock:
            if self.proc.returncode is None:
                self._sample_cpu_locked()

    def _sample_cpu_locked(self) -> None:
        self.cpu_seen = max(self.cpu_seen, tree_cpu_s(self.proc.pid))

    def wait_for_namespace(self, timeout: float = 5.0) -> None:
        """Block until the namespace's init has exited (it exits last: the kernel kills the rest first)."""
        deadline = time.monotonic() + timeout
        for pid in self.init_pids:
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.005)


_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def tree_cpu_s(root: int) -> float:
    """CPU seconds of `root` and every process under it, each one's own and its reaped children's (utime, stime,
    cutime, cstime of /proc/<pid>/stat).

    Why: a run's rusage counts only what was reaped up to bwrap. A run the host kills (wall clock, output or disk
    cap, close()) takes the sandbox's init down before it reaps anything, so every process's CPU time was lost:
    two detached burners and a foreground one reported `cpu_s` 0.006. Every process of the sandbox is under bwrap
    (an orphan is adopted by the namespace's init), so the sum over the tree, read while it lives, is what they
    used. Parents are read before their children: a child reaped mid-walk is missed, never counted twice. A pid
    whose parent is not the one that listed it (reused meanwhile) is skipped."""
    total, stack = 0, [(root, None)]
    while stack:
        pid, parent = stack.pop()
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            if parent is not None and int(fields[1]) != parent:
                continue
            total += sum(int(f) for f in fields[11:15])
            for task in os.listdir(f"/proc/{pid}/task"):
                stack += [(int(c), pid) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
        except (OSError, ValueError, IndexError):
            continue
    return total / _TICKS_PER_S


def _children(pid: int) -> list[int]:
    """Direct children of `pid` (/proc's children list, else psutil's scan of every process's parent)."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        import psutil

        try:
            return [c.pid for c in psutil.Process(pid).children()]
        except psutil.Error:
            return []


def _alive(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie (a zombie holds no memory, files or namespace members)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


@dataclasses.dataclass
class _Capture:
    """One output stream, kept up to the shared cap."""

    chunks: list[bytes] = dataclasses.field(default_factory=list)
    kept: int = 0

    def text(self) -> str:
        return b"".join(self.chunks).decode("utf-8", errors="replace")


class SandboxClosed(RuntimeError):
    """close() ran (in another thread) before this run could start."""


def run_process(
    argv: list[str],
    stdin: bytes | None,
    limits: Limits,
    preexec: Callable[[], None],
    workdir: Path,
    runs: set[Run],
    preamble: bytes = b"",
    start_lock: threading.Lock | None = None,
    closed: Callable[[], bool] | None = None,
    env: dict[str, str] | None = None,
    pass_fds: tuple[int, ...] = (),
    status_fd: int | None = None,
) -> RunResult:
    """Run `argv` (a full bwrap command line) under `limits`; the run sits in `runs` while it lives, so the
    sandbox's close() can kill a run still going in another thread. The command's wrapper prints
    `preamble` on stdout before running the command: where it is missing, bwrap's own set-up failed and
    SandboxUnavailable is raised with bwrap's message, never a RunResult the model would take as its own.

    `start_lock` / `closed`: the process starts and joins `runs` under the lock the sandbox's close() takes to kill
    them, so a close() in another thread either comes first (`closed()` is then true: SandboxClosed, nothing
    starts) or finds the run registered and kills it; without the lock a run started a moment before close() was
    missed, and outlived its sandbox.

    `env`: the environment of the host-side process (bwrap: a bare PATH; a container CLI needs e.g. DOCKER_HOST or
    XDG_RUNTIME_DIR to reach its daemon). What runs inside gets its environment from the backend, never this.

    `pass_fds`: descriptors made for this spawn only (bwrap's seccomp filter, the write end of the status pipe),
    inherited by the process and closed here once it started. `status_fd`: the read end of the pipe on which the
    sandbox's init writes the command's own wait status (bwrap.INIT); without it (the container backend) a shell's
    exit code 128+N is read as signal N, the only thing its status says."""
    DISK_WATCH.ensure_started()
    start = time.monotonic()
    with start_lock or contextlib.nullcontext():
        if closed is not None and closed():
            for fd in (*pass_fds, *([status_fd] if status_fd is not None else [])):
                os.close(fd)
            raise SandboxClosed("the sandbox was closed before this run started")
        try:
            proc = subprocess.Popen(
                argv, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, preexec_fn=preexec, start_new_session=True, close_fds=True,
                env=env if env is not None else {"PATH": "/usr/bin:/bin"}, pass_fds=pass_fds,
            )
        except (OSError, subprocess.SubprocessError) as e:  # bwrap missing, the uid switch or an rlimit refused
            _read_status(status_fd)  # (closes it)
            program = _program(argv)
            raise SandboxUnavailable(f"could not start {os.path.basename(program)} ({program}): "
                                     f"{type(e).__name__}: {e}") from e
        finally:
            for fd in pass_fds:
                os.close(fd)
        run = Run(proc)
        runs.add(run)
    try:
        watch = DISK_WATCH.watch(proc.pid, limits.workdir_bytes, workdir)
        watch_killed = False
        try:
            why, out, err, truncated = _pump(run, stdin, limits, workdir, start, len(preamble))
        finally:
            # before bwrap is reaped: its pid (the group's id) cannot be reused before
            watch_killed = DISK_WATCH.unwatch(watch)
        if why is None and watch_killed:
            why = StopReason.DISK_LIMIT
        status, usage = _reap(run, start + limits.wall_s + 5.0)
    finally:
        if proc.returncode is None:  # the reader itself failed: kill, and reap so no zombie stays behind
            run.reap(block=True)
        run.wait_for_namespace()
        runs.discard(run)
        inner = _read_status(status_fd)
    if preamble:
        head = b"".join(out.chunks)
        if not head.startswith(preamble):
            if why is None:
                raise SandboxUnavailable(f"{os.path.basename(_program(argv))} could not start the sandbox: "
                                         f"{err.text().strip()[:500]!r}")
        else:
            out.chunks = [head[len(preamble):]]
    wall = time.monotonic() - start
    # rusage is complete where the init reaped everything (the command exited); a killed run's is not
    cpu = max(usage.ru_utime + usage.ru_stime if usage is not None else 0.0, run.cpu_seen)
    exit_code, sig = _decode_status(status, inner)
    if why is None and over_cap(workdir, limits.workdir_bytes):
        why = StopReason.DISK_LIMIT
    if why is None:
        why = _classify(exit_code, sig, cpu, limits, err)
    return RunResult(stdout=out.text(), stderr=err.text(), exit_code=exit_code, signal=sig, stop_reason=why,
                     wall_s=wall, cpu_s=cpu, truncated=truncated)


def _program(argv: list[str]) -> str:
    """The sandbox program a command line starts (bwrap, docker), past an `nsenter ... --` prefix (a non-root
    trainer's bwrap starts in its working dir holder's namespaces: workdir_holder.py)."""
    if os.path.basename(argv[0]) == "nsenter" and "--" in argv:
        return argv[argv.index("--") + 1]
    return argv[0]


def _pump(run: Run, stdin: bytes | None, limits: Limits, workdir: Path, start: float, extra: int = 0):
    """Feed stdin and read both pipes until EOF, the wall clock, the output cap or the disk cap; kill on a limit."""
    proc = run.proc
    out, err = _Capture(), _Capture()
    sel = selectors.DefaultSelector()
    streams = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
    for fd in streams:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    pending = memoryview(stdin or b"")
    stdin_fd = proc.stdin.fileno() if proc.stdin is not None else None
    if stdin_fd is not None:
        os.set_blocking(stdin_fd, False)
        sel.register(stdin_fd, selectors.EVENT_WRITE)
    deadline = start + limits.wall_s
    next_watch = start + _WATCH_EVERY_S
    next_cpu = start + _CPU_EVERY_S
    why: StopReason | None = None
    truncated = False
    open_reads = len(streams)
    try:
        while open_reads:
            now = time.monotonic()
            if now >= deadline:
                why = StopReason.TIMEOUT
                break
            if now >= next_watch:
                next_watch = now + _WATCH_EVERY_S
                if now >= next_cpu:  # a kill from outside (the disk watchdog) leaves no time to read it
                    next_cpu = now + _CPU_EVERY_S
                    run.sample_cpu()
                if over_cap(workdir, limits.workdir_bytes):
                    why = StopReason.DISK_LIMIT
                    break
            for key, _ in sel.select(timeout=min(deadline, next_watch) - now):
                fd = key.fd
                if fd == stdin_fd:
                    pending = _feed(sel, proc, pending)
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:
                    sel.unregister(fd)
                    open_reads -= 1
                    continue
                cap = streams[fd]
                if not cap.chunks:
                    run.note_started()
                room = limits.output_bytes + extra - out.kept - err.kept
                if len(chunk) > room:
                    cap.chunks.append(chunk[:max(room, 0)])
                    cap.kept += max(room, 0)
                    truncated = True
                    why = StopReason.OUTPUT_LIMIT
                    break
                cap.chunks.append(chunk)
                cap.kept += len(chunk)
            if why is not None:
                break
    finally:
        sel.close()
    if why is not None:
        run.kill()
    for f in (proc.stdin, proc.stdout, proc.stderr):
        if f is not None and not f.closed:
            f.close()
    if truncated:
        err.chunks.append(f"\n[output truncated at {limits.output_bytes} bytes; the run was stopped]".encode())
    return why, out, err, truncated


def _feed(sel: selectors.BaseSelector, proc: subprocess.Popen, pending: memoryview) -> memoryview:
    """Write what the pipe takes of stdin; close it when all is written (or the reader went away)."""
    try:
        written = os.write(proc.stdin.fileno(), pending[:65536]) if pending else 0
    except (BrokenPipeError, OSError):
        written, pending = 0, memoryview(b"")
    pending = pending[written:]
    if not pending:
        sel.unregister(proc.stdin.fileno())
        proc.stdin.close()
    return pending


def _reap(run: Run, deadline: float):
    """wait4 the bwrap process (for its rusage: the run's CPU time), killing it if it outlives the deadline."""
    while True:
        reaped = run.reap(block=time.monotonic() >= deadline)
        if reaped is not None:
            return reaped[1], reaped[2]
        time.sleep(0.002)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the run's process group (bwrap; its sandbox init dies with it and takes the PID namespace)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_status(status_fd: int | None) -> int | None:
    """The command's own wait status as the sandbox's init wrote it, or None (no pipe: the container backend; or
    the init never wrote it: it was killed, with its sandbox, from outside). Closes `status_fd`."""
    if status_fd is None:
        return None
    try:
        os.set_blocking(status_fd, False)
        data = os.read(status_fd, 64)
    except OSError:
        data = b""
    finally:
        os.close(status_fd)
    try:
        return int(data.split(b"\n", 1)[0])
    except ValueError:
        return None


def _decode_status(status: int, inner: int | None = None) -> tuple[int | None, int | None]:
    """(exit code, signal) of a run. `inner`: the command's own wait status from the sandbox's init, which tells a
    command's `exit 137` from a SIGKILL (bwrap reports both as exit 137): exact. Without it (the init was killed
    before it could report, or a backend whose status is a shell's) a status 128+N can only be read as signal N."""
    if inner is not None:
        if os.WIFSIGNALED(inner):
            return None, os.WTERMSIG(inner)
        return os.WEXITSTATUS(inner), None
    if os.WIFSIGNALED(status):
        return None, os.WTERMSIG(status)
    code = os.WEXITSTATUS(status)
    if 128 < code <= 128 + 64:
        return None, code - 128
    return code, None


def _classify(exit_code: int | None, sig: int | None, cpu: float, limits: Limits, err: _Capture) -> StopReason:
    """Why a run that the reader did not stop ended: by its signal, else by the errno text of a failed exit."""
    if sig is not None:
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= limits.cpu_s):
            return StopReason.CPU_LIMIT
        if sig == signal.SIGXFSZ:
            return StopReason.FILE_SIZE_LIMIT
        return StopReason.KILLED
    if exit_code == 128 + signal.SIGXCPU and cpu >= limits.cpu_s:  # a shell whose child the CPU limit killed
        return StopReason.CPU_LIMIT
    if exit_code:
        tail = b"".join(err.chunks)[-4096:].decode("utf-8", errors="replace")
        for reason, markers in _STDERR_MARKERS:
            if any(m in tail for m in markers):
                return reason
    return StopReason.EXITED
