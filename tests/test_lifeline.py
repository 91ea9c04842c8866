"""Children die with the trainer (host/lifeline.py), also when it is SIGKILLed: the mechanism on plain processes, then
a real `skyrl-stepwise train` with its retriever and Ray; engines' adapter folders of dead owners are removed
(inference/adapter_files.py)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from skyrl_stepwise.host.lifeline import (LIFELINE_ENV, ProcessIdentity, lifeline_tokens, marked_processes,
                                         process_identity)
from skyrl_stepwise.inference.adapter_files import (ADAPTER_FILE_NAMES, FOLDER_PREFIX, AdapterFiles, AdapterFolders,
                                                    remove_orphaned_folders)

REPO = Path(__file__).resolve().parents[1]

# A stand-in trainer: arms its lifeline, then starts what a trainer starts: a program (exec'd), a child forked
# without exec, and a daemon whose parent exits at once (re-parented to PID 1, its ancestry gone, as Ray's agents are
# once the raylet dies). It prints their identities and waits to be killed.
TRAINER = textwrap.dedent("""
    import os, subprocess, sys, time
    sys.path.insert(0, {repo!r})
    from skyrl_stepwise.host.lifeline import arm, process_identity
    arm()
    program = subprocess.Popen(["sleep", "60"])
    forked = os.fork()
    if forked == 0:
        time.sleep(60)
        os._exit(0)
    daemon = subprocess.run(["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True)
    print(*(process_identity(p).tag for p in (program.pid, forked, int(daemon.stdout))), flush=True)
    {then}
""")


def _identities(tags: str) -> list[ProcessIdentity]:
    return [ProcessIdentity.from_tag(tag) for tag in tags.split()]


def _wait_gone(identities: list[ProcessIdentity], timeout_s: float) -> list[ProcessIdentity]:
    """The identities still alive after up to `timeout_s` (a zombie counts as gone: it holds no memory, no port)."""
    deadline = time.monotonic() + timeout_s
    alive = identities
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [i for i in alive if i.is_alive()]
    return alive


def _command_line(pid: int) -> str:
    """The process's command line ("" once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _pids_whose_command_line_holds(text: str) -> list[int]:
    return [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit() and text in _command_line(int(e.name))]


def _start_trainer(then: str) -> tuple[subprocess.Popen, list[ProcessIdentity]]:
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER.format(repo=str(REPO), then=then)],
                               stdout=subprocess.PIPE, text=True)
    return trainer, _identities(trainer.stdout.readline())


def test_every_child_of_a_sigkilled_trainer_dies_with_it_and_nothing_else_does():
    import psutil

    bystander = subprocess.Popen(["sleep", "60"])  # started by the test, not by the trainer: must survive
    trainer, children = _start_trainer(then="time.sleep(60)")
    try:
        token = lifeline_tokens(children[0].pid)[-1]
        assert all(token in lifeline_tokens(c.pid) for c in children[:1] + children[2:])  # the marked ones
        assert token not in lifeline_tokens(children[1].pid)  # forked without exec: it watches the pipe instead
        assert token not in lifeline_tokens(bystander.pid)
        keepers = [process_identity(pid) for pid in _pids_whose_command_line_holds(token)]
        assert len(keepers) == 1  # one keeper, detached: whoever waits for the trainer's descendants never waits on it
        assert keepers[0].pid not in [c.pid for c in psutil.Process(trainer.pid).children(recursive=True)]
        trainer.kill()
        trainer.wait()
        assert _wait_gone(children + keepers, timeout_s=4) == []  # the keeper too, once its sweep is done
        assert bystander.poll() is None
    finally:
        for child in children:  # only if the test failed: stop what it started
            if child.is_alive():
                os.kill(child.pid, signal.SIGKILL)
        bystander.kill()
        bystander.wait()


def test_a_trainer_that_ends_normally_leaves_no_child_behind():
    trainer, children = _start_trainer(then="assert arm() == arm()")  # one lifeline a process; then it just exits
    try:
        assert trainer.wait(30) == 0
        assert _wait_gone(children, timeout_s=4) == []
    finally:
        for child in children:
            if child.is_alive():
                os.kill(child.pid, signal.SIGKILL)


def test_tokens_accumulate_so_a_child_that_arms_keeps_its_parents_mark(monkeypatch):
    from skyrl_stepwise.host import lifeline

    monkeypatch.setitem(os.environ, LIFELINE_ENV, "parent")
    monkeypatch.setattr(lifeline, "_armed", {})
    token = lifeline.arm()
    try:
        assert os.environ[LIFELINE_ENV] == f"parent:{token}"
        child = subprocess.Popen(["sleep", "60"])
        deadline = time.monotonic() + 2  # Popen returns inside exec, before the new environment is readable
        while not lifeline_tokens(child.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert lifeline_tokens(child.pid) == ["parent", token]
        child.kill()
        child.wait()
    finally:
        line = lifeline._armed.pop(os.getpid())
        os.close(line.write_end)  # the keeper reads EOF and ends, as at this process's exit
        os.close(line.read_end)


def test_a_process_identity_tells_a_recycled_pid_apart():
    me = process_identity()
    assert me is not None and ProcessIdentity.from_tag(me.tag) == me and me.is_alive()
    assert not ProcessIdentity(me.namespace, me.pid, me.start_ticks + 1).is_alive()  # same pid, another process
    assert ProcessIdentity(me.namespace + 1, 1, 0).is_alive()  # another pid namespace: cannot tell, never swept
    assert ProcessIdentity.from_tag("1a2b3c4d") is None


def _adapter() -> AdapterFiles:
    return AdapterFiles({name: name.encode() for name in ADAPTER_FILE_NAMES})


def test_adapter_folders_of_an_engine_killed_outright_are_removed_by_the_next_engine(tmp_path, monkeypatch):
    """An engine process SIGKILLed with an adapter loaded leaves its folder; the next engine on the node removes it,
    and never a live engine's folder or one that names no owner."""
    from skyrl_stepwise.inference import adapter_files

    engine = subprocess.Popen(["sleep", "60"])  # stands for the engine's process: it owns the folder
    owner = process_identity(engine.pid)
    with monkeypatch.context() as m:
        m.setattr(adapter_files, "process_identity", lambda: owner)
        dead_engines = AdapterFolders(tmp_path).write(3, _adapter())
    live_folders = AdapterFolders(tmp_path)  # this process: alive
    live = live_folders.write(1, _adapter())
    unnamed = _adapter().write(tmp_path / f"{FOLDER_PREFIX}1a2b3c4d_v2")  # the old naming: owner unknown
    assert remove_orphaned_folders(tmp_path) == []  # its owner still runs
    engine.kill()
    engine.wait()
    assert dead_engines.parent == tmp_path and dead_engines.is_dir() and owner.tag in dead_engines.name
    AdapterFolders(tmp_path)  # an engine starts on the node
    assert not dead_engines.exists() and live.is_dir() and unnamed.is_dir()
    assert remove_orphaned_folders(tmp_path) == []
    live_folders.remove_all()
    assert not live.exists()


# Ray's agents, by their title or (before they set it) their script
RAY_AGENTS = (("ray::DashboardAgent", "dashboard/agent.py"), ("ray::RuntimeEnvAgent", "runtime_env/agent/main.py"))


def _descendants_once_ray_and_the_retriever_run(trainer: subprocess.Popen, console: Path, timeout_s: float):
    """The trainer's descendants once its retriever answers and Ray's agents run (the processes that outlived a
    SIGKILLed trainer before the lifeline), with the retriever's port."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert trainer.poll() is None, console.read_text()[-3000:]
        found = re.search(r"retriever up at http://127\.0\.0\.1:(\d+)/", console.read_text())
        children = psutil.Process(trainer.pid).children(recursive=True)
        with contextlib.suppress(psutil.Error):
            running = " ".join(" ".join(c.cmdline()) for c in children)
            if found and all(any(n in running for n in agent) for agent in RAY_AGENTS):
                return children, int(found.group(1))
        time.sleep(1)
    raise AssertionError(f"no retriever and Ray agents within {timeout_s:.0f} s: {console.read_text()[-3000:]}")


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_a_sigkilled_trainer_leaves_no_retriever_and_no_ray_process_behind(tmp_path, tiny_smollm2):
    """The issue's case, for real: `skyrl-stepwise train` of the main recipe, killed by SIGKILL once its retriever
    and Ray are up. Before the lifeline the retriever (PPID 1, its port held) and Ray's DashboardAgent and
    RuntimeEnvAgent were still up minutes later. On SmolLM2's tiny twin: the processes are the recipe's, and its
    resource plan fits beside the other integration tests (with the real model it needs 7.1 GiB before any KV cache,
    and a CI run on 2 cores once had 6.7 free while the other worker's job ran)."""
    console = tmp_path / "console.log"
    corpus = tmp_path / "corpus.jsonl"  # a small one: no index of the 10,033 embedded summaries to build or load
    corpus.write_text("".join(json.dumps({"id": str(i), "contents": f'"Title {i}"\nPassage {i}.'}) + "\n"
                              for i in range(64)))
    cmd = [sys.executable, "-m", "skyrl_stepwise.cli.train", "experiment=search_r1_tiny", "sft.enabled=false",
           "model_path=smollm2-tiny", f"environment.retriever.corpus={corpus}", "engine.dtype=float32",
           f"logging.output_dir={tmp_path / 'run'}",
           "logging.wandb_mode=offline"]
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    with open(console, "w") as out:
        trainer = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    children = []
    try:
        children, port = _descendants_once_ray_and_the_retriever_run(trainer, console, timeout_s=400)
        identities = [i for i in (process_identity(c.pid) for c in children) if i is not None]
        session = re.search(rf"session_[0-9_-]+_{trainer.pid}\b", " ".join(
            _command_line(i.pid) for i in identities))  # Ray's session, named after the driver's pid
        assert session, "no Ray session of the trainer's among its children's command lines"
        inherited = set(os.environ.get(LIFELINE_ENV, "").split(":"))  # this test process's own, if it armed one
        tokens = {t for i in identities for t in lifeline_tokens(i.pid)} - inherited
        trainer.kill()
        trainer.wait()
        left = _wait_gone(identities, timeout_s=30)
        assert left == [], [(i.pid, _command_line(i.pid)[:80]) for i in left]
        assert len(tokens) == 1, tokens  # the trainer's own mark on what it started
        assert not marked_processes(tokens.pop())  # none started later either, whoever its parent is now
        assert not _pids_whose_command_line_holds(session.group(0))  # nothing of its Ray session either
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # the retriever's port is free again
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        for child in children:  # only if the test failed: what the trainer started, by pid
            with contextlib.suppress(Exception):
                child.kill()
