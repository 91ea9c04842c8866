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
