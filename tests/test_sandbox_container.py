"""The container backend (environment.sandbox.backend: docker | podman) and the backend factory.

What these tests prove, and what they do not: the lifecycle tests drive ContainerSandbox against a FAKE `docker`
executable (tests/fake_container_cli.py, put first on PATH here) that records its argv and emulates `run -d`,
`exec` and `rm` by running the command ON THE HOST in the working dir. They test OUR PLUMBING (every limit flag
on the command line, start/run/timeout/output cap/OOM mapping/file confinement/close/sweep, the same RunResult and
metrics as bwrap), NOT container isolation: that needs a Docker daemon, which this machine lacks. The refusal test
uses the real CLI: with no daemon, the start-up check must refuse naming environment.sandbox.backend and the CLI's
own reason (skipped only where no docker CLI is installed, or where a daemon answers).
"""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from sandbox_helpers import FAKE_IMAGE, fake_calls, install_fake_docker, processes_with
from skyrl_stepwise.sandbox import (
    ContainerSandbox,
    Limits,
    RunResult,
    Sandbox,
    SandboxConfig,
    SandboxMetrics,
    SandboxPathError,
    SandboxUnavailable,
    StopReason,
    check_backend_available,
    configure_sandbox,
    open_sandbox,
    sandbox_config,
)
from skyrl_stepwise.sandbox import backends as backends_module
from skyrl_stepwise.sandbox import container as container_module
from skyrl_stepwise.sandbox.container import (
    OWNER_LABEL,
    check_container_available,
    container_exec_argv,
    container_run_argv,
    sweep_stale_containers,
)

REPO = Path(__file__).resolve().parents[1]
IMAGE = FAKE_IMAGE


@pytest.fixture(autouse=True)
def _restore_backend():
    """Every test starts and ends with the default backend and an empty availability cache."""
    check_container_available.cache_clear()
    yield
    backends_module._configured = SandboxConfig()
    check_container_available.cache_clear()


@pytest.fixture
def fake_docker(tmp_path, monkeypatch) -> Path:
    """A fake `docker` first on PATH; returns its state dir (argv.jsonl, containers/)."""
    return install_fake_docker(tmp_path, monkeypatch)


calls = fake_calls


def flag(argv: list[str], name: str) -> list[str]:
    """Every value of `name` in an argv."""
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == name]


def test_run_argv_has_every_limit_and_no_network_by_default(fake_docker, tmp_path):
    limits = Limits(memory_bytes=300 << 20, tmp_bytes=20 << 20, processes=17)
    argv = container_run_argv("docker", IMAGE, tmp_path, limits, False, 0.5, (1234, 1234))
    assert argv[1:4] == ["run", "-d", "--pull"] and flag(argv, "--pull") == ["never"]
    assert flag(argv, "--network") == ["none"] and "--read-only" in argv and "--init" in argv
    [tmpfs] = flag(argv, "--tmpfs")
    assert tmpfs.startswith("/tmp:") and f"size={20 << 20}" in tmpfs
    assert flag(argv, "--memory") == flag(argv, "--memory-swap") == [str((300 + 20) << 20)]  # total, no swap
    assert flag(argv, "--pids-limit") == ["21"] and flag(argv, "--cpus") == ["0.5"]
    assert flag(argv, "--cap-drop") == ["ALL"] and flag(argv, "--security-opt") == ["no-new-privileges"]
    [user] = flag(argv, "--user")
    assert user.split(":")[0] not in ("0", "root", "1234")  # the keeper: non-root, not the commands' uid
    assert flag(argv, "--mount") == [f"type=bind,source={tmp_path},target=/work"]  # the only writable host path
    assert flag(argv, "--label")[0].startswith(f"{OWNER_LABEL}=") and argv[-3:] == [IMAGE, "sleep", "infinity"]
    assert "--network" not in container_run_argv("docker", IMAGE, tmp_path, limits, True, 1.0, (1, 1))
    run = container_exec_argv("docker", "cid", "echo hi", Limits(cpu_s=3, memory_bytes=1 << 30, open_files=99),
                              (1234, 1234))
    assert run[1:3] == ["exec", "-i"] and flag(run, "--user") == ["1234:1234"] and run[-2:] == ["sh", "echo hi"]
    wrapper = run[-3]
    for part in ("ulimit -H -t 4", "ulimit -S -t 3", "ulimit -v 1048576", "ulimit -n 99", "kill -KILL -1"):
        assert part in wrapper


def test_no_daemon_is_refused_at_start_up_naming_the_key_and_the_cli_reason():
    """The real docker CLI of this machine, whose daemon is not running: a refusal, never a fallback."""
    cli = shutil.which("docker")
    if cli is None:
        pytest.skip("no docker CLI installed here")
    if subprocess.run([cli, "version"], capture_output=True, timeout=60).returncode == 0:
        pytest.skip("a docker daemon answers here: nothing to refuse")
    with pytest.raises(SandboxUnavailable, match=r"environment\.sandbox\.backend=docker.*(daemon|connect)"):
        check_backend_available("docker", "python:3.11-slim")
    with pytest.raises(SandboxUnavailable, match=r"environment\.sandbox\.backend=docker"):
        configure_sandbox(SandboxConfig(backend="docker"))
    assert sandbox_config().backend == "bwrap"  # the refused choice was not taken
    with pytest.raises(SandboxUnavailable, match="Cannot connect to the Docker daemon"):
        open_sandbox("docker")  # even past the check: `run -d` fails, nothing runs on the host


def test_a_wrong_backend_value_fails_naming_the_key():
    with pytest.raises(ValueError, match=r"environment\.sandbox\.backend: 'dockr'"):
        SandboxConfig(backend="dockr")
    with pytest.raises(ValueError, match=r"environment\.sandbox\.backend"):
        open_sandbox("firecracker")
    from omegaconf import OmegaConf

    from skyrl_stepwise.run.config import RunConfig

    composed = OmegaConf.structured(RunConfig)
    composed.environment.sandbox.backend = "dockr"
    with pytest.raises(ValueError, match=r"environment\.sandbox\.backend"):
        OmegaConf.to_object(composed)


def test_the_fake_daemon_refusals_name_the_key_and_the_cause(fake_docker):
    with pytest.raises(SandboxUnavailable, match=r"environment\.sandbox\.image.*docker pull nope"):
        check_backend_available("docker", "nope")
    (fake_docker / "no-daemon").write_text("")
    check_container_available.cache_clear()
    with pytest.raises(SandboxUnavailable, match=r"backend=docker.*Cannot connect to the Docker daemon"):
        check_backend_available("docker", IMAGE)


def test_lifecycle_start_run_close(fake_docker, tmp_path):
    task = tmp_path / "task"
    task.mkdir()
    (task / "given.txt").write_text("from the task\n")
    metrics = SandboxMetrics()
    sb = open_sandbox("docker", files_from=task, metrics=metrics, image=IMAGE)
    assert isinstance(sb, ContainerSandbox) and isinstance(sb, Sandbox)
    [run_d] = calls(fake_docker, "run")
    assert flag(run_d, "--mount") == [f"type=bind,source={sb.workdir},target=/work"]
    assert flag(run_d, "--network") == ["none"]
    result = sb.run("cat given.txt; echo oops >&2; exit 3")
    assert result == RunResult(stdout="from the task\n", stderr="oops\n", exit_code=3, signal=None,
                               stop_reason=StopReason.EXITED, wall_s=result.wall_s, cpu_s=result.cpu_s,
                               truncated=False)
    assert sb.run("python3 -", stdin="print(6 * 7)").stdout == "42\n"
    sb.write_file("sub/a.txt", "written by the host")
    assert sb.run("cat sub/a.txt").stdout == "written by the host"
    sb.run("echo model > out.txt")
    assert sb.read_file("out.txt") == "model\n"
    workdir, cid = sb.workdir, sb.container_id
    sb.close()
    sb.close()
    assert not workdir.exists() and ["rm", "-f", cid] in calls(fake_docker, "rm")
    assert not (fake_docker / "containers" / f"{cid}.json").exists()
    assert (metrics.started, metrics.closed, metrics.runs) == (1, 1, 4)


def test_timeout_output_cap_and_leftovers_are_killed(fake_docker):
    with open_sandbox("docker", image=IMAGE) as sb:
        start = time.monotonic()
        slow = sb.run("setsid sleep 27.1828 >/dev/null 2>&1 & sleep 31.4159", limits=Limits(wall_s=1.0))
        assert slow.stop_reason is StopReason.TIMEOUT and time.monotonic() - start < 8, slow
        assert not processes_with("31.4159") and not processes_with("27.1828")  # the escaped one too
        left = sb.run("setsid sleep 23.1406 & echo done")  # a normal exit: the wrapper kills what is left
        assert (left.stop_reason, left.stdout, left.wall_s < 8) == (StopReason.EXITED, "done\n", True), left
        assert not processes_with("23.1406")
        loud = sb.run("yes", limits=Limits(output_bytes=1000))
        assert loud.stop_reason is StopReason.OUTPUT_LIMIT and loud.truncated and len(loud.stdout) <= 1000
        assert sb.metrics.stops == {"timeout": 1, "exited": 1, "output_limit": 1}


def test_sigkill_is_an_oom_kill_only_when_the_cgroup_counted_one(fake_docker):
    with open_sandbox("docker", image=IMAGE) as sb:
        plain = sb.run("kill -KILL $$")
        (fake_docker / f"{sb.container_id}.memory.events").write_text("low 0\noom 1\noom_kill 1\n")
        oom = sb.run("kill -KILL $$")
        again = sb.run("kill -KILL $$")  # the same count: not a new OOM kill
    assert (plain.stop_reason, plain.signal) == (StopReason.KILLED, 9)
    assert oom.stop_reason is StopReason.MEMORY_LIMIT and again.stop_reason is StopReason.KILLED


@pytest.mark.integration  # slow for the fast suite (a second of CPU on a loaded 2-core box), as bwrap's
def test_cpu_limit_comes_from_the_wrappers_rlimit(fake_docker):
    with open_sandbox("docker", image=IMAGE) as sb:
        result = sb.run("python3 -c 'while True: pass'", limits=Limits(cpu_s=1, wall_s=30))
    assert result.stop_reason is StopReason.CPU_LIMIT and result.signal is not None, result


def test_file_access_is_confined_to_the_working_dir(fake_docker):
    with open_sandbox("docker", image=IMAGE) as sb:
        sb.run("ln -s /etc/passwd leak")
        for bad in ("../x", "/etc/passwd", "leak"):
            with pytest.raises(SandboxPathError):
                sb.read_file(bad) if bad != "../x" else sb.write_file(bad, "x")
        assert sb.metrics.path_refusals == 3


def test_closed_on_exception_and_on_garbage_collection(fake_docker):
    with pytest.raises(KeyError):
        with open_sandbox("docker", image=IMAGE) as sb:
            workdir = sb.workdir
            raise KeyError("the trajectory failed")
    assert not workdir.exists() and not list((fake_docker / "containers").glob("*.json"))
    sb = open_sandbox("docker", image=IMAGE)
    workdir = sb.workdir
    del sb
    gc.collect()
    assert not workdir.exists() and not list((fake_docker / "containers").glob("*.json"))


def test_a_container_that_cannot_start_is_refused_and_leaves_nothing(fake_docker, tmp_path):
    ours = f"skyrl-sandbox-{os.getpid()}-*"  # this process's dirs: another xdist worker's sandboxes come and go
    before = set(Path(os.environ.get("TMPDIR", "/tmp")).glob(ours))
    with pytest.raises(SandboxUnavailable, match=r"backend=docker.*Unable to find image"):
        open_sandbox("docker", image="missing/image")
    assert set(Path(os.environ.get("TMPDIR", "/tmp")).glob(ours)) <= before


def test_sweep_removes_only_a_dead_trainers_containers(fake_docker, tmp_path):
    import socket

    host = socket.gethostname()
    dead = subprocess.Popen(["true"])
    dead.wait()
    docker = shutil.which("docker")
    ids = {}
    for name, owner in {"dead": f"{host}/{dead.pid}", "alive": f"{host}/{os.getpid()}",
                        "other_host": f"elsewhere/{dead.pid}"}.items():
        out = subprocess.run([docker, "run", "-d", "--label", f"{OWNER_LABEL}={owner}", "--mount",
                              f"type=bind,source={tmp_path},target=/work", IMAGE, "sleep", "infinity"],
                             capture_output=True, text=True, check=True)
        ids[name] = out.stdout.strip()
    assert sweep_stale_containers("docker") == [ids["dead"]]
    left = {p.stem for p in (fake_docker / "containers").glob("*.json")}
    assert left == {ids["alive"], ids["other_host"]}


def test_the_configured_backend_is_what_envs_and_tools_open(fake_docker):
    """configure_sandbox (start-up) checks the container backend; open_sandbox() then opens it by default."""
    configure_sandbox(SandboxConfig(backend="docker", image=IMAGE, cpus=2))
    assert calls(fake_docker, "version") and calls(fake_docker, "exec")  # checked at start-up: a probe ran `true`
    assert check_backend_available().endswith("/docker")
    with open_sandbox() as sb:
        assert isinstance(sb, ContainerSandbox) and sb.run("echo hi").stdout == "hi\n"
        assert flag(calls(fake_docker, "run")[-1], "--cpus") == ["2"]
    assert container_module.KILL_ALL in calls(fake_docker, "exec")[-1][-3]


def test_the_fake_rewrites_exactly_the_sandboxs_kill_and_probe():
    """The fake emulates `kill -KILL -1` and the OOM probe by their text: it must be the text the sandbox sends."""
    text = (REPO / "tests/fake_container_cli.py").read_text()
    assert repr(container_module.KILL_ALL).strip("'") in text and container_module.OOM_PROBE in text


def test_a_run_asking_for_docker_without_a_daemon_stops_at_start_up(fake_docker):
    """build_env_registry (the run's start-up) checks the configured container backend before anything runs."""
    from skyrl_stepwise.envs.builtin import build_env_registry
    from skyrl_stepwise.run.config import EnvironmentConfig

    (fake_docker / "no-daemon").write_text("")
    environment = EnvironmentConfig(sandbox=SandboxConfig(backend="docker", image=IMAGE))
    with pytest.raises(SandboxUnavailable, match=r"environment\.sandbox\.backend=docker.*Cannot connect"):
        build_env_registry(environment)
    assert sandbox_config().backend == "bwrap"
