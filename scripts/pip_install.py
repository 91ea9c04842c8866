"""`pip install ARGS` for `make install`, done by uv where it can be: ~1 min instead of ~3.5 on a 2-core host.

Why: on the 2-core CI host, pip's serial unpack and byte-compile of torch, vLLM, Ray and transformers was ~3.5 min of
every CI run's time. uv installs the same pins in parallel. It does not read pip's configuration, so what pip would
use (`pip config list`: pip.conf and PIP_* variables, e.g. a machine's local mirror, its find-links, constraint files
and CA bundle) is handed to it, and it picks the best version across all indexes, as pip does. Where uv is missing or
fails, pip itself installs, after a line saying so: never a failed install that pip would have done.

Usage (the venv's python): python scripts/pip_install.py [pip install arguments ...]
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import subprocess
import sys

# pip key -> uv flag; a value may hold several entries separated by whitespace, as pip reads it
FLAGS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraint"}
# which setting pip uses when a key is set in several places: a PIP_* variable, then pip.conf's [install], [global]
PRECEDENCE = (":env:", "install", "global")


def pip_settings(pip_config_list: str) -> dict[str, list[str]]:
    """`global.find-links='/opt/wheels'`, `:env:.extra-index-url='a b'` lines -> {key: entries} of the setting pip
    itself would use for each key (the one highest in PRECEDENCE)."""
    found: dict[str, dict[str, str]] = {}
    for line in pip_config_list.splitlines():
        name, sep, value = line.partition("=")
        section, _, key = name.rpartition(".")
        if sep and section in PRECEDENCE and (key in FLAGS or key in ("cert", "no-index")):
            found.setdefault(key, {})[section] = shlex.split(value)[0] if value.strip() else ""
    return {key: by_section[next(s for s in PRECEDENCE if s in by_section)].split()
            for key, by_section in found.items()}


def uv_command(settings: dict[str, list[str]], args: list[str]) -> list[str]:
    command = [sys.executable, "-m", "uv", "pip", "install", "--python", sys.executable, "--quiet",
               "--compile-bytecode",  # as pip does: else every first import in the tests compiles (~15 s a process)
               "--index-strategy", "unsafe-best-match"]  # pip picks the best version across all indexes
    for key, entries in settings.items():
        command += [part for entry in entries for part in (FLAGS[key], entry)] if key in FLAGS else []
    if settings.get("no-index", ["false"])[0].lower() in ("1", "true", "yes", "on"):  # a machine offline but for
        command.append("--no-index")  # its find-links: uv must not look further than pip would
    return command + args


def main(args: list[str]) -> int:
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    settings = pip_settings(listed.stdout)
    env = dict(os.environ)
    if settings.get("cert"):  # pip's CA bundle (a proxy's, a mirror's): uv reads it from here
        env.setdefault("SSL_CERT_FILE", settings["cert"][0])
    if importlib.util.find_spec("uv") is None:
        print("uv is not installed in this environment: pip installs instead (slower)", file=sys.stderr)
    elif subprocess.run(uv_command(settings, args), env=env).returncode == 0:
        return 0
    else:
        print("uv could not install it (its error is above): pip installs it instead", file=sys.stderr)
    return subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", *args]).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
