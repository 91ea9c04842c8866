"""Per-sandbox cgroup v2 caps (sandbox/cgroup.py), against a fake cgroup tree: this repo's CI host binds memory and
cpu to cgroup v1, so the kernel's side is played by `FakeKernel` (interface files made on mkdir, removed on rmdir,
refusals on demand). The runs themselves are real where it matters: a real child joins with the real preexec, and
real bwrap sandboxes run with the fake tree. The last test checks that on a host without the controllers nothing
changes."""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from skyrl_stepwise.sandbox import Limits, RunResult, StopReason
from skyrl_stepwise.sandbox.bwrap import BwrapSandbox, caps_report
from skyrl_stepwise.sandbox.caps import CapsReport, cgroup_v2_missing
from skyrl_stepwise.sandbox.cgroup import CgroupUsage, SandboxCgroups, account
from skyrl_stepwise.sandbox.runner import Credentials, make_preexec

LOGGER = "skyrl_stepwise.sandbox.cgroup"


class FakeKernel(SandboxCgroups):
    """cgroupfs as far as cgroup.py relies on it: a new cgroup comes with its interface files (`swap`: with
    memory.swap.max; `peak`, `oom_kills`: what the kernel counted), rmdir takes them, a write to a file named in
    `refuse` fails with that errno. What each removed cgroup held in cgroup.procs, cgroup.kill and memory.max is
    kept. A pid written into a cgroup.procs leaves the others; subtree_control refuses (EBUSY) while a non-root
    cgroup lists a process, as the kernel does."""

    def __init__(self, base: Path, refuse: dict[str, int] | None = None, swap: bool = True, peak: int = 5 << 20,
                 oom_kills: int = 0, pid: int | None = None) -> None:
        super().__init__(base, pid=pid)
        self.refuse, self.swap, self.peak, self.oom_kills = refuse or {}, swap, peak, oom_kills
        self.removed: dict[str, dict[str, str]] = {}

    def _mkdir(self, path: Path, exist_ok: bool = False) -> None:
        if path.name in self.refuse:
            raise OSError(self.refuse[path.name], os.strerror(self.refuse[path.name]), str(path))
        path.mkdir(exist_ok=exist_ok)
        handed_down = (path.parent / "cgroup.subtree_control").read_text()
        files = {"cgroup.controllers": handed_down, "cgroup.subtree_control": "\n", "cgroup.procs": "",
                 "cgroup.type": "domain\n", "cgroup.kill": "", "memory.max": "max\n",
                 "pids.max": "max\n", "memory.peak": f"{self.peak}\n", "cpu.stat": "usage_usec 1234567\n",
                 "memory.events": f"low 0\nhigh 0\nmax 3\noom 1\noom_kill {self.oom_kills}\n"}
        if self.swap:
            files["memory.swap.max"] = "max\n"
        for name, text in files.items():
            if not (path / name).exists():
                (path / name).write_text(text)

    def _rmdir(self, path: Path) -> None:
        self.removed[path.name] = {n: (path / n).read_text() for n in ("cgroup.procs", "cgroup.kill", "memory.max")}
        shutil.rmtree(path)

    def _write(self, path: Path, text: str) -> None:
        if path.name in self.refuse:
            raise OSError(self.refuse[path.name], os.strerror(self.refuse[path.name]), str(path))
        if path.name == "cgroup.procs":  # a pid written moves that process here from wherever it was
            for other in self._given_base.parent.rglob("cgroup.procs"):
                other.write_text("\n".join(p for p in other.read_text().split() if p != text.strip()))
            text = "\n".join([*path.read_text().split(), text.strip()])
        if path.name == "cgroup.subtree_control" and (path.parent / "cgroup.type").exists() and (
                path.parent / "cgroup.procs").read_text().split():  # cgroup v2's no-internal-processes rule
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(path))
        if path.name == "cgroup.subtree_control":  # "+a -b" edits the set; it reads back as "a c"
            enabled = set(path.read_text().split())
            enabled |= {w[1:] for w in text.split() if w[0] == "+"}
            text = " ".join(sorted(enabled - {w[1:] for w in text.split() if w[0] == "-"}))
        super()._write(path, text)


def fake_tree(tmp_path: Path, procs: str = "", controllers: str = "cpuset cpu io memory pids") -> Path:
    """The trainer's own cgroup: a non-root one (cgroup.type) listing `procs`."""
    base = tmp_path / "own"
    base.mkdir()
    for name, text in {"cgroup.controllers": controllers + "\n", "cgroup.subtree_control": "\n",
                       "cgroup.procs": procs, "cgroup.type": "domain\n"}.items():
        (base / name).write_text(text)
    return base


def test_the_trainer_moves_into_a_leaf_and_enables_the_controllers_for_its_sandboxes(tmp_path):
    """cgroup v2 lets a non-root cgroup hand controllers down only while it holds no process: this process (listed
    in its own cgroup) moves into <own>/trainer, and only then is subtree_control written."""
    base = fake_tree(tmp_path, procs=f"{os.getpid()}\n")
    cgroups = FakeKernel(base)
    assert cgroups.status() == (base, None)
    assert (base / "trainer" / "cgroup.procs").read_text() == str(os.getpid())
    assert (base / "cgroup.subtree_control").read_text() == "memory pids"
    assert CapsReport(True, None, cgroups.status()[0]).line().count(f"per-sandbox cgroup v2 totals at {base}") == 1


def test_the_processes_the_trainer_started_move_into_the_leaf_with_it(tmp_path):
    """Found on a real cgroup v2 kernel (benchmarks/cgroup_v2_vm.py): a non-root trainer's first sandbox starts its
    working dir's holder (workdir_holder.py) before its first run, so the trainer's cgroup held two processes when
    the controllers were enabled, and the kernel refused (EBUSY): per-sandbox cgroups never came up for a laptop's
    delegated scope. Children of the trainer (the holder, the disk watchdog, an engine's workers) move with it."""
    child = subprocess.Popen(["sleep", "30"])
    try:
        base = fake_tree(tmp_path, procs=f"{os.getpid()}\n{child.pid}\n")
        cgroups = FakeKernel(base)
        assert cgroups.status() == (base, None)
        assert (base / "trainer" / "cgroup.procs").read_text().split() == [str(os.getpid()), str(child.pid)]
        assert (base / "cgroup.procs").read_text() == "" and "memory" in (base / "cgroup.subtree_control").read_text()
    finally:
        child.kill()
        child.wait()


def test_a_process_the_trainer_did_not_start_keeps_the_cgroups_off_and_is_named(tmp_path, caplog):
    """pid 1 is no child of ours: it stays in the trainer's cgroup, the kernel refuses the controllers, this process
    and its children go back where they were, and the warning names the pid that is in the way."""
    child = subprocess.Popen(["sleep", "30"])
    try:
        base = fake_tree(tmp_path, procs=f"1\n{os.getpid()}\n{child.pid}\n")
        caplog.set_level("WARNING", logger=LOGGER)
        at, why = FakeKernel(base).status()
        assert at is None and "EBUSY" in why and "pids 1 left in it (not started by this process" in why, why
        assert sorted((base / "cgroup.procs").read_text().split()) == sorted(["1", str(os.getpid()), str(child.pid)])
        assert len(_degraded(caplog)) == 1
    finally:
        child.kill()
        child.wait()


def test_a_process_started_from_a_prepared_trainer_makes_its_runs_beside_the_trainers(tmp_path):
    """A process the trainer starts (a spawned worker) is in <own>/trainer: it shares the layout, moves nothing,
    and enables nothing (<own>/trainer holds the trainer, so it could not)."""
    base = fake_tree(tmp_path, procs=f"{os.getpid()}\n")
    assert FakeKernel(base).status() == (base, None)
    worker = FakeKernel(base / "trainer", pid=os.getpid() + 1, refuse={"cgroup.subtree_control": errno.EBUSY})
    assert worker.status() == (base, None)
    with worker.for_run(Limits()) as run:
        assert run.path.parent == base and run.path.name.startswith(f"sandbox-{os.getpid() + 1}-")


def test_each_run_gets_a_fresh_cgroup_capped_at_its_limits_and_removed_after(tmp_path):
    base = fake_tree(tmp_path)
    cgroups = FakeKernel(base)
    limits = Limits(memory_bytes=300 << 20, processes=7)
    with cgroups.for_run(limits, tmpfs_bytes=64 << 20) as first:
        assert first.path.parent == base and first.path.name.startswith(f"sandbox-{os.getpid()}-")
        assert (first.path / "memory.max").read_text() == str(364 << 20)  # tmpfs pages are charged here too
        assert (first.path / "memory.swap.max").read_text() == "0"
        assert (first.path / "pids.max").read_text() == "9"  # the command's 7, bwrap and the sandbox's init
        with cgroups.for_run(Limits()) as second:
            assert second.path != first.path and (second.path / "memory.max").read_text() == str(1 << 30)
    assert not first.path.exists() and not second.path.exists()
    assert cgroups.removed[first.path.name]["cgroup.kill"] == "1"  # killed before it was removed
    assert list(base.glob("sandbox-*")) == []


def test_no_swap_file_no_swap_write_and_no_pids_controller_no_pids_cap(tmp_path):
    """memory.swap.max exists only with swap accounting, pids.max only where the pids controller is delegated:
    neither is a reason to give up the memory cap."""
    cgroups = FakeKernel(fake_tree(tmp_path, controllers="cpu memory"), swap=False)
    with cgroups.for_run(Limits()) as run:
        assert run is not None and (run.path / "memory.max").read_text() == str(1 << 30)
        assert not (run.path / "memory.swap.max").exists()
        assert (run.path / "pids.max").read_text() == "max\n"
    assert (cgroups.status()[0] / "cgroup.subtree_control").read_text() == "memory"


def test_the_runs_child_joins_its_cgroup_in_the_preexec_before_exec(tmp_path):
    """The real preexec of a real child writes the child's pid into the run's cgroup.procs (so the exec'd program
    and all it forks start inside) and tells the parent it got in."""
    cgroups = FakeKernel(fake_tree(tmp_path))
    with cgroups.for_run(Limits()) as run:
        proc = subprocess.Popen(["true"], preexec_fn=run.joining_first(make_preexec(Limits(), None)), close_fds=True)
        proc.wait()
        assert (run.path / "cgroup.procs").read_text() == str(proc.pid)
        assert run.joined() is None


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to the sandbox's own uid needs a root trainer")
def test_a_root_trainers_child_joins_before_it_drops_to_the_sandboxs_uid(tmp_path):
    """Only root may write a root-owned cgroup.procs: the join must come before setuid, or a root trainer's runs
    would all stay outside their cgroup."""
    cgroups = FakeKernel(fake_tree(tmp_path))
    with cgroups.for_run(Limits()) as run:
        os.chmod(run.path / "cgroup.procs", 0o600)
        creds = Credentials(uid=65534, gid=65534)
        proc = subprocess.Popen(["true"], preexec_fn=run.joining_first(make_preexec(Limits(), creds)), close_fds=True)
        proc.wait()
        assert (run.path / "cgroup.procs").read_text() == str(proc.pid)
        assert run.joined() is None


def test_a_refused_join_is_noticed_and_turns_the_cgroups_off_with_one_warning(tmp_path, caplog):
    cgroups = FakeKernel(fake_tree(tmp_path))
    caplog.set_level("WARNING", logger=LOGGER)
    with cgroups.for_run(Limits()) as run:
        (run.path / "cgroup.procs").unlink()  # the kernel says no: ENOENT on the join
        subprocess.Popen(["true"], preexec_fn=run.joining_first(make_preexec(Limits(), None)), close_fds=True).wait()
        result = _result(StopReason.EXITED, exit_code=0)
        assert cgroups.account(run, result) == result and result.memory_peak_bytes is None
    base, why = cgroups.status()
    assert base is None and "cgroup.procs" in why and "ENOENT" in why
    assert len(_degraded(caplog)) == 1
    with cgroups.for_run(Limits()) as later:
        assert later is None


@pytest.mark.parametrize("refused, code", [("cgroup.subtree_control", errno.EBUSY),
                                            ("trainer", errno.EACCES), ("cgroup.procs", errno.EROFS)])
def test_a_refusal_at_enable_time_falls_back_to_per_process_caps_with_one_warning(tmp_path, caplog, refused, code):
    """EBUSY: another process shares the trainer's cgroup; EACCES: not delegated to this user; EROFS: a read-only
    cgroupfs (a container). The sandboxes stay per process, the warning and the start-up line name the file and
    errno, and this process is left where it was."""
    base = fake_tree(tmp_path, procs=f"{os.getpid()}\n")
    cgroups = FakeKernel(base, refuse={refused: code})
    caplog.set_level("WARNING", logger=LOGGER)
    at, why = cgroups.status()
    name = errno.errorcode[code]
    assert at is None and refused in why and name in why, why
    assert len(_degraded(caplog)) == 1 and refused in _degraded(caplog)[0] and name in _degraded(caplog)[0]
    line = CapsReport(kernel_disk_cap=True, cgroup_missing=why, cgroup_at=at).line()
    assert "memory/CPU: per-process only" in line and name in line and "totals" not in line
    with cgroups.for_run(Limits()) as run:
        assert run is None
    assert cgroups.status() == (None, why) and len(_degraded(caplog)) == 1
    if refused == "cgroup.subtree_control":  # moved into the leaf, then back
        assert (base / "cgroup.procs").read_text() == str(os.getpid())


def _degraded(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "SANDBOX CAPS DEGRADED" in r.getMessage()]


def test_a_refused_cap_write_gives_up_once_and_leaves_no_cgroup(tmp_path, caplog):
    cgroups = FakeKernel(fake_tree(tmp_path), refuse={"memory.max": errno.EACCES})
    caplog.set_level("WARNING", logger=LOGGER)
    for _ in range(2):
        with cgroups.for_run(Limits()) as run:
            assert run is None
    at, why = cgroups.status()
    assert at is None and "memory.max: EACCES" in why, why
    assert len(_degraded(caplog)) == 1 and list((tmp_path / "own").glob("sandbox-*")) == []


def _result(reason: StopReason, exit_code: int | None = None, sig: int | None = None, cpu: float = 0.1) -> RunResult:
    return RunResult(stdout="", stderr="", exit_code=exit_code, signal=sig, stop_reason=reason, wall_s=0.5,
                     cpu_s=cpu, truncated=False)


@pytest.mark.parametrize("before, after", [
    (_result(StopReason.KILLED, sig=signal.SIGKILL), StopReason.MEMORY_LIMIT),  # the command itself OOM-killed
    (_result(StopReason.EXITED, exit_code=137), StopReason.MEMORY_LIMIT),  # a shell whose child was
    (_result(StopReason.EXITED, exit_code=0), StopReason.EXITED),  # the command survived a killed child
    (_result(StopReason.TIMEOUT, sig=signal.SIGKILL), StopReason.TIMEOUT),  # the reader's own stop stands
])
def test_an_oom_kill_counted_by_the_cgroup_is_a_memory_stop(before, after):
    usage = CgroupUsage(memory_peak_bytes=64 << 20, oom_kills=1, cpu_s=2.5)
    got = account(before, usage)
    assert got.stop_reason is after and got.cpu_s == 2.5 and got.memory_peak_bytes == 64 << 20
    assert account(before, dataclasses.replace(usage, oom_kills=0)).stop_reason is before.stop_reason


def test_a_real_sandbox_run_joins_is_read_and_cleaned_up_through_the_fake_tree(tmp_path):
    """A real bwrap run with the fake tree: bwrap's pid is what was written into the run's cgroup, the kernel's
    counts reach the result (CPU seconds of every process, the memory peak, an oom_kill as a memory stop), and no
    cgroup stays."""
    cgroups = FakeKernel(fake_tree(tmp_path), peak=7 << 20, oom_kills=1)
    limits = Limits(memory_bytes=200 << 20, tmp_bytes=10 << 20, workdir_bytes=30 << 20)
    with BwrapSandbox(cgroups=cgroups, limits=limits) as sb:
        ok = sb.run("echo hi")
        oom = sb.run("kill -9 $$")
    tmpfs = (10 << 20) + ((30 << 20) if sb.kernel_capped else 0)  # /tmp, and the working dir where it is a tmpfs
    assert [v["memory.max"] for v in cgroups.removed.values()] == [str((200 << 20) + tmpfs)] * 2
    assert ok.ok and ok.stdout == "hi\n" and ok.memory_peak_bytes == 7 << 20 and ok.cpu_s >= 1.234567
    assert oom.stop_reason is StopReason.MEMORY_LIMIT and oom.signal == signal.SIGKILL, oom
    assert len(cgroups.removed) == 2 and all(v["cgroup.procs"].isdigit() for v in cgroups.removed.values())
    assert list((tmp_path / "own").glob("sandbox-*")) == []


def test_the_start_up_sweep_removes_only_a_dead_trainers_sandbox_cgroups(tmp_path):
    base = fake_tree(tmp_path)
    dead = subprocess.Popen(["true"])
    dead.wait()
    cgroups = FakeKernel(base)
    for owner in (dead.pid, os.getpid(), 1):
        cgroups._mkdir(base / f"sandbox-{owner}-0")
    assert cgroups.status() == (base, None)
    assert {p.name for p in base.glob("sandbox-*")} == {f"sandbox-{os.getpid()}-0", "sandbox-1-0"}
    assert cgroups.removed[f"sandbox-{dead.pid}-0"]["cgroup.kill"] == "1"


@pytest.mark.skipif(cgroup_v2_missing() is None, reason="this host has a cgroup v2 with the memory controller")
def test_on_a_host_without_the_controllers_nothing_changes():
    """This repo's host: no cgroup v2 memory/cpu controller. The default cgroups are off without a warning, a
    sandbox runs as before, and the start-up line says the caps are per process only."""
    cgroups = SandboxCgroups()
    assert cgroups.status() == (None, cgroup_v2_missing())
    with BwrapSandbox(cgroups=cgroups) as sb:
        result = sb.run("echo hi; exit 3")
    assert result.stdout == "hi\n" and result.exit_code == 3 and result.memory_peak_bytes is None
    line = caps_report(cgroups).line()
    assert f"memory/CPU: per-process only ({cgroup_v2_missing()})" in line and "totals" not in line
