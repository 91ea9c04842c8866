"""A FAKE `docker` CLI for the container-backend tests (tests/test_sandbox_container.py puts a `docker` launcher of
this script first on PATH). It records every argv and emulates `version`, `image inspect`, `run -d`, `exec`, `ps`,
`inspect` and `rm -f` by running the exec'd command ON THE HOST, in the container's bind-mounted working dir.

It isolates NOTHING (no namespaces, no cgroup, no read-only root): it tests our plumbing (argv, lifecycle, stop
reasons, cleanup, sweep), not container isolation, which needs a daemon this machine lacks.

"Processes of a container" are those whose environment holds FAKE_CONTAINER=<id>; the sandbox's `kill -KILL -1`
(which on the host would kill every process the caller may signal) is rewritten to kill only those, and any other
`kill ... -1` is refused, so a test can never signal the host's processes.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from pathlib import Path

# container.py's strings, copied so that each fake call starts fast (the tests check they are the same)
KILL_ALL = "kill -KILL -1 2>/dev/null"
OOM_PROBE = "cat /sys/fs/cgroup/memory.events 2>/dev/null || cat /sys/fs/cgroup/memory/memory.oom_control"

STATE = Path(os.environ.get("DOCKER_FAKE_STATE", "/nonexistent"))  # set by the test (not inside "containers")
IMAGE = "fake/python:3"
VALUED = {"--pull", "--label", "--network", "--tmpfs", "--memory", "--memory-swap", "--pids-limit", "--cpus",
          "--cap-drop", "--security-opt", "--ulimit", "--user", "--mount", "--workdir", "-e", "--filter", "--format",
          "-f"}  # (`rm -f` is read apart: there -f takes no value)


def options(args: list[str]) -> tuple[dict[str, list[str]], list[str]]:
    """Leading options (flag -> values) and the positional rest."""
    opts: dict[str, list[str]] = {}
    i = 0
    while i < len(args) and args[i].startswith("-"):
        if args[i] in VALUED:
            opts.setdefault(args[i], []).append(args[i + 1])
            i += 2
        else:
            opts.setdefault(args[i], []).append("")
            i += 1
    return opts, args[i:]


def container(cid: str) -> dict | None:
    path = STATE / "containers" / f"{cid}.json"
    return json.loads(path.read_text()) if path.exists() else None


def kill_all(cid: str) -> None:
    """SIGKILL every process of container `cid` but this one and its parent (kill -1's caller), and return once
    they are gone. A SIGKILLed process dies when it next runs: on a saturated 2-core host (`make test` keeps both
    cores busy) one stayed runnable, still listed, after the sweeps had returned, and a test that looked at once
    found it (`status='running'`)."""
    import time

    import psutil

    spare = {os.getpid(), os.getppid()}
    killed = []
    for _ in range(3):
        for proc in psutil.process_iter():
            try:
                if proc.pid not in spare and proc.environ().get("FAKE_CONTAINER") == cid:
                    proc.kill()
                    killed.append(proc)
            except (psutil.Error, OSError):
                continue
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(proc) for proc in killed):
        time.sleep(0.01)


def _alive(proc) -> bool:
    """Still running (a zombie holds nothing: it waits for its parent to read its exit status)."""
    import psutil

    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:  # gone
        return False


def fail(message: str, code: int = 1) -> None:
    sys.stderr.write(message + "\n")
    sys.exit(code)


def main(argv: list[str]) -> None:
    if argv[:1] == ["_killall"]:
        kill_all(argv[1])
        return
    with open(STATE / "argv.jsonl", "a") as log:
        log.write(json.dumps(argv) + "\n")
    if (STATE / "no-daemon").exists():
        fail("Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the docker daemon running?")
    verb, rest = argv[0], argv[1:]
    if verb == "version":
        print("fake 1.0")
    elif verb == "image":
        if rest[-1] != IMAGE:
            fail(f"Error: No such image: {rest[-1]}")
        print("[{}]")
    elif verb == "run":
        opts, positional = options(rest)
        if positional[0] != IMAGE:
            fail(f"Unable to find image '{positional[0]}' locally", 125)
        mount = dict(kv.split("=", 1) for kv in opts["--mount"][0].split(","))
        label = opts["--label"][0].split("=", 1)[1]
        cid = uuid.uuid4().hex
        (STATE / "containers").mkdir(exist_ok=True)
        (STATE / "containers" / f"{cid}.json").write_text(json.dumps({"workdir": mount["source"], "label": label}))
        print(cid)
    elif verb == "ps":
        for path in sorted((STATE / "containers").glob("*.json")):
            print(path.stem)
    elif verb == "inspect":
        info = container(rest[-1])
        if info is None:
            fail(f"Error: No such object: {rest[-1]}")
        print(info["label"] if "Labels" in rest[-2] else "false")
    elif verb == "rm":
        for cid in [a for a in rest if not a.startswith("-")]:
            if container(cid) is None:
                fail(f"Error response from daemon: No such container: {cid}")
            kill_all(cid)
            (STATE / "containers" / f"{cid}.json").unlink()
            print(cid)
    elif verb == "exec":
        opts, positional = options(rest)
        cid, command = positional[0], positional[1:]
        info = container(cid)
        if info is None:
            fail(f"Error response from daemon: No such container: {cid}")
        killer = f"{sys.executable} -I {__file__} _killall {cid}"
        oom = f"cat {STATE / (cid + '.memory.events')}"
        command = [arg.replace(KILL_ALL, killer).replace(OOM_PROBE, oom) for arg in command]
        if any("kill -KILL -1" in arg or "kill -9 -1" in arg for arg in command):
            fail("fake docker: refusing a kill of every process (it would hit the host's)", 99)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "FAKE_CONTAINER": cid}
        env.update(kv.split("=", 1) for kv in opts.get("-e", []))
        os.chdir(info["workdir"])
        os.execve(command[0], command, env)
    else:
        fail(f"fake docker: unknown command {verb!r}", 2)


if __name__ == "__main__":
    main(sys.argv[1:])
