"""The one place a sandbox is opened: `environment.sandbox` picks the backend, `open_sandbox` builds it, and
`check_backend_available` refuses at start-up, naming the key and the real cause, where it cannot run.

Backends: `bwrap` (default, Linux: bubblewrap namespaces + rlimits, bwrap.py), `docker` / `podman` (one container
per trajectory, container.py). A remote backend (E2B, Modal, Daytona) plugs in by implementing base.Sandbox and
adding a branch here; envs and tools only ever call `open_sandbox`, so they cannot tell backends apart.

Env classes are built with no arguments (plugins: one instance per trajectory), so the run's choice is held here
for the process: `configure_sandbox(environment.sandbox)` at start-up (envs/builtin.build_env_registry) sets it
and checks a container backend right away; a later `open_sandbox()` without a backend uses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from skyrl_stepwise.sandbox.base import Limits, Sandbox, SandboxMetrics

BACKENDS = ("bwrap", "docker", "podman")


@dataclass
class SandboxConfig:
    """`environment.sandbox`: which backend runs the code of every sandboxed env/tool of the run."""

    backend: str = "bwrap"  # bwrap | docker | podman
    image: str = "python:3.11-slim"  # docker/podman only: must already be on the host (runs never pull)
    cpus: float = 1.0  # docker/podman only: `--cpus` of each trajectory's container

    def __post_init__(self) -> None:
        """A wrong value fails at start-up naming its key (never a silent fallback to another backend)."""
        if self.backend not in BACKENDS:
            raise ValueError(f"environment.sandbox.backend: {self.backend!r} is not a sandbox backend; "
                             f"one of {list(BACKENDS)}")
        if not isinstance(self.image, str) or not self.image.strip():
            raise ValueError(f"environment.sandbox.image must name an image, got {self.image!r}")
        if not self.cpus > 0:
            raise ValueError(f"environment.sandbox.cpus must be > 0, got {self.cpus!r}")


_configured = SandboxConfig()


def configure_sandbox(config: SandboxConfig | None, check: bool = True) -> SandboxConfig:
    """Make `config` the process's sandbox choice (re-validated: a config object built without its constructor,
    e.g. by OmegaConf, still fails on a bad value); a container backend is checked now, at start-up. bwrap is
    checked by the first tool that needs it, as before (a run without sandboxed envs needs no sandbox)."""
    global _configured
    config = SandboxConfig(**{k: getattr(config, k) for k in ("backend", "image", "cpus")}) if config \
        else SandboxConfig()
    if check and config.backend != "bwrap":
        check_backend_available(config.backend, config.image)
    _configured = config
    return config


def sandbox_config() -> SandboxConfig:
    """The process's sandbox choice (the default, bwrap, until configure_sandbox ran)."""
    return _configured


def check_backend_available(backend: str | None = None, image: str | None = None) -> str:
    """Refuse with SandboxUnavailable (naming environment.sandbox.backend and why) where the backend cannot run
    here; cached per backend/image. Returns what runs the sandboxes (the bwrap / CLI path)."""
    backend = backend or _configured.backend
    if backend == "bwrap":
        from skyrl_stepwise.sandbox.bwrap import check_sandbox_available

        return check_sandbox_available()
    if backend in ("docker", "podman"):
        from skyrl_stepwise.sandbox.container import check_container_available

        return check_container_available(backend, image or _configured.image)
    raise ValueError(f"environment.sandbox.backend: {backend!r} is not a sandbox backend; one of {list(BACKENDS)}")


def open_sandbox(backend: str | None = None, *, files_from: Path | None = None, limits: Limits | None = None,
                 network: bool = False, metrics: SandboxMetrics | None = None, image: str | None = None) -> Sandbox:
    """A started sandbox of `backend` (default: the configured one); use it as a context manager or close it."""
    backend = backend or _configured.backend
    if backend == "bwrap":
        from skyrl_stepwise.sandbox.bwrap import BwrapSandbox

        return BwrapSandbox(files_from=files_from, limits=limits, network=network, metrics=metrics)
    if backend in ("docker", "podman"):
        from skyrl_stepwise.sandbox.container import ContainerSandbox

        return ContainerSandbox(backend, image or _configured.image, files_from=files_from, limits=limits,
                                network=network, metrics=metrics, cpus=_configured.cpus)
    raise ValueError(f"environment.sandbox.backend: {backend!r} is not a sandbox backend; one of {list(BACKENDS)}")
