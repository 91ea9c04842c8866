"""Sandboxed code execution for agents that run code (issue #47): a per-trajectory sandbox (bubblewrap by default,
docker/podman by `environment.sandbox.backend`) with limits, confined file access and counters. Envs and tools open
one with `open_sandbox` (backends.py), never a backend class. Nothing here runs code on the host: where the chosen
backend cannot start, `check_backend_available()` says why."""

from skyrl_stepwise.sandbox.base import (
    Limits,
    RunResult,
    Sandbox,
    SandboxMetrics,
    SandboxPathError,
    SandboxUnavailable,
    StopReason,
)
from skyrl_stepwise.sandbox.backends import (
    BACKENDS,
    SandboxConfig,
    check_backend_available,
    configure_sandbox,
    open_sandbox,
    sandbox_config,
)
from skyrl_stepwise.sandbox.bwrap import WORKDIR_IN_SANDBOX, BwrapSandbox, check_sandbox_available
from skyrl_stepwise.sandbox.container import ContainerSandbox

__all__ = [
    "BACKENDS", "BwrapSandbox", "ContainerSandbox", "Limits", "RunResult", "Sandbox", "SandboxConfig",
    "SandboxMetrics", "SandboxPathError", "SandboxUnavailable", "StopReason", "WORKDIR_IN_SANDBOX",
    "check_backend_available", "check_sandbox_available", "configure_sandbox", "open_sandbox", "sandbox_config",
]
