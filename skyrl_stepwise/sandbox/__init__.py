"""Sandboxed code execution for agents that run code (issue #47): a per-trajectory bubblewrap sandbox with
limits, confined file access and counters. Nothing here runs code on the host: where the sandbox cannot start,
`check_sandbox_available()` says why."""

from skyrl_stepwise.sandbox.base import (
    Limits,
    RunResult,
    Sandbox,
    SandboxMetrics,
    SandboxPathError,
    SandboxUnavailable,
    StopReason,
)
from skyrl_stepwise.sandbox.bwrap import WORKDIR_IN_SANDBOX, BwrapSandbox, check_sandbox_available

__all__ = [
    "BwrapSandbox", "Limits", "RunResult", "Sandbox", "SandboxMetrics", "SandboxPathError", "SandboxUnavailable",
    "StopReason", "WORKDIR_IN_SANDBOX", "check_sandbox_available",
]
