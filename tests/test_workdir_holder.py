"""The working dir's holder (sandbox/workdir_holder.py): a tmpfs mounted in a user + mount namespace of its own, the
non-root trainer's kernel cap. Tested here directly, by whoever runs the tests (root or not: any user may make the
holder); the sandbox's use of it as uid 65534 is in test_sandbox_security's LAPTOP_CASE."""

from __future__ import annotations

import errno
import os
import subprocess

import pytest

from skyrl_stepwise.sandbox import workdir_holder
from skyrl_stepwise.sandbox.workdir_holder import WorkdirHolder

if not workdir_holder.available():
    pytest.skip("no user + mount namespace can be made here (user namespaces off or restricted)",
                allow_module_level=True)


@pytest.fixture
def workdir(tmp_path):
    path = tmp_path / "work"
    path.mkdir()
    return path


def test_the_holders_tmpfs_caps_what_the_host_writes_through_its_view(workdir):
    holder = WorkdirHolder(workdir, 1 << 20)
    try:
        assert os.path.ismount(holder.view) and not os.path.ismount(workdir)
        (holder.view / "a").write_bytes(b"x" * (512 << 10))
        assert os.listdir(holder.view) == ["a"] and os.listdir(workdir) == []  # the host dir itself stays empty
        with pytest.raises(OSError) as full:
            (holder.view / "b").write_bytes(b"x" * (1 << 20))
        assert full.value.errno == errno.ENOSPC
        holder.resize(4 << 20)
        (holder.view / "b").write_bytes(b"x" * (1 << 20))  # fits now
        holder.resize(1 << 20)  # below what it holds: capped at what it holds, so full
        st = os.statvfs(holder.view)
        assert st.f_bavail == 0, st
    finally:
        holder.close()
    assert not os.path.exists(holder.view)  # the namespace, and its tmpfs, went with the holder
    assert os.listdir(workdir) == []


def test_a_command_entered_into_the_holder_sees_the_tmpfs_not_a_host_path(workdir):
    holder = WorkdirHolder(workdir, 1 << 20)
    try:
        (holder.view / "f").write_text("from the host")
        out = subprocess.run([*holder.enter_argv(), "sh", "-c", f"cat {workdir}/f; echo; grep ' {workdir} ' "
                              "/proc/self/mountinfo"], capture_output=True, text=True, timeout=30)
    finally:
        holder.close()
    assert out.returncode == 0, out.stderr
    text, mount = out.stdout.split("\n", 1)
    assert text == "from the host"
    assert mount.split()[3] == "/" and " - tmpfs " in mount and "size=1024k" in mount, mount  # its root: no host path


def test_a_holder_that_cannot_mount_says_why(tmp_path):
    with pytest.raises(OSError, match="the working dir's holder could not cap"):
        WorkdirHolder(tmp_path / "missing", 1 << 20)


def test_a_holder_that_never_answers_is_given_up_on(tmp_path, monkeypatch):
    monkeypatch.setattr(workdir_holder, "HOLDER_SCRIPT", "exec sleep 60")
    monkeypatch.setattr(workdir_holder, "_START_TIMEOUT_S", 0.5)
    with pytest.raises(OSError, match=r"no answer within 0.5 s"):
        WorkdirHolder(tmp_path, 1 << 20)
