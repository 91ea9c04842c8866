"""Shared helpers of the sandbox tests: skip where no sandbox can start, find leftover processes by marker."""

from __future__ import annotations

import psutil
import pytest

from skyrl_stepwise.sandbox import SandboxUnavailable, check_sandbox_available


def require_sandbox() -> None:
    """Skip the module (naming why) on a machine where bwrap cannot start; Linux CI runs every test."""
    try:
        check_sandbox_available()
    except SandboxUnavailable as exc:
        pytest.skip(f"no sandbox here: {exc}", allow_module_level=True)


def processes_with(marker: str) -> list[psutil.Process]:
    """Live host processes whose command line mentions `marker` (zombies excluded: they hold no resources)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and marker in " ".join(proc.info["cmdline"] or []):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


FAKE_IMAGE = "fake/python:3"  # the only image tests/fake_container_cli.py "has"


def install_fake_docker(tmp_path, monkeypatch):
    """Put a FAKE `docker` (tests/fake_container_cli.py) first on PATH and return its state dir (argv.jsonl,
    containers/). It runs exec'd commands on the host: it tests our plumbing, never container isolation."""
    import os
    import shutil
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    bindir, state = tmp_path / "fake-bin", tmp_path / "fake-state"
    bindir.mkdir()
    state.mkdir()
    launcher = bindir / "docker"
    launcher.write_text(f"#!/bin/sh\nexec {sys.executable} {repo / 'tests/fake_container_cli.py'} \"$@\"\n")
    launcher.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setenv("DOCKER_FAKE_STATE", str(state))
    assert shutil.which("docker") == str(launcher)  # never the real CLI (nor a real daemon)
    return state


def use_fake_docker_backend(tmp_path, monkeypatch):
    """`environment.sandbox.backend: docker` on the fake CLI for this test (restored after it); the state dir."""
    from skyrl_stepwise.sandbox import SandboxConfig, configure_sandbox
    from skyrl_stepwise.sandbox import backends
    from skyrl_stepwise.sandbox.container import check_container_available

    state = install_fake_docker(tmp_path, monkeypatch)
    check_container_available.cache_clear()
    monkeypatch.setattr(backends, "_configured", backends._configured)  # put back after the test
    configure_sandbox(SandboxConfig(backend="docker", image=FAKE_IMAGE))
    return state


def fake_calls(state, verb: str) -> list[list[str]]:
    """The fake CLI's recorded argvs whose verb is `verb`."""
    import json

    path = state / "argv.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [argv for argv in map(json.loads, lines) if argv[0] == verb]


NOBODY = 65534


def run_unprivileged(code: str, timeout: float = 180.0):
    """Run the Python `code` (the repo importable) as a user without privileges, as on a laptop: where the tests run
    as root (CI), as uid/gid 65534 via `setpriv` with no capability and the system python3 (this venv's interpreter
    may sit under root's 0700 home; its site-packages are put on the path); else as the current user. Skips where
    that cannot be arranged. Returns the CompletedProcess (text)."""
    import os
    import shutil
    import subprocess
    import sys
    import sysconfig
    import tempfile
    from pathlib import Path

    repo = str(Path(__file__).resolve().parents[1])
    site = sysconfig.get_paths()["purelib"]
    if os.geteuid() != 0:
        argv = [sys.executable, "-c", code]
    else:
        setpriv, python = shutil.which("setpriv"), "/usr/bin/python3"
        if setpriv is None or not os.path.exists(python):
            pytest.skip("no setpriv or /usr/bin/python3 to drop to an unprivileged uid")
        probe = subprocess.run([python, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                               text=True)
        if probe.stdout.strip() != str(tuple(sys.version_info[:2])):
            pytest.skip(f"/usr/bin/python3 is {probe.stdout.strip()}, this venv {sys.version_info[:2]}")
        argv = [setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--inh-caps=-all",
                "--bounding-set=-all", python, "-c", code]
    cwd = tempfile.mkdtemp(prefix="skyrl-unpriv-")
    os.chmod(cwd, 0o777)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": os.pathsep.join([repo, site]), "HOME": cwd, "TMPDIR": "/tmp"}
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
    finally:
        shutil.rmtree(cwd, ignore_errors=True)


def run_tests_unprivileged(node_ids: list[str], timeout: float = 420.0):
    """Run these pytest node ids as a user without privileges (see run_unprivileged): the tests whose defence
    depends on who the trainer is run once more as a laptop's trainer would. Returns the CompletedProcess."""
    code = ("import sys, pytest\n"
            f"sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-o', 'addopts=', *{list(node_ids)!r}]))\n")
    return run_unprivileged(code, timeout=timeout)
