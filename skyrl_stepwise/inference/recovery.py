"""Restart dead inference engines instead of failing the run.

An engine actor can die mid-run (OOM-killed, a segfault in a kernel, a node lost): every request to it fails, a
step's rollouts fail with it, and the run used to stop. Here an engine whose health check fails is restarted in
place (same config, same placement) by its own `restart()`; the caller then loads the current weights into it and
verifies them with the probe before any rollout uses it (loop/engine_recovery.py).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """An engine is dead and cannot be restarted (it has no `restart`)."""


def engines_of(engine) -> list:
    """The engines behind a pool, or the engine itself."""
    return list(engine.engines) if hasattr(engine, "engines") else [engine]


async def is_healthy(engine) -> bool:
    """The engine's own health check; one that raises is dead, one without a check is taken as alive."""
    check = getattr(engine, "health", None)
    if check is None:
        return True
    try:
        return bool(await check())
    except Exception:  # noqa: BLE001 - a health check that cannot even answer is a dead engine
        return False


async def restart_dead_engines(engine) -> list[int]:
    """Restart every engine (of a pool) that fails its health check; returns their indices (empty: all alive).
    The restarted engines hold their checkpoint's weights, not the trainer's: sync before sampling from them."""
    restarted = []
    for index, member in enumerate(engines_of(engine)):
        if await is_healthy(member):
            continue
        if not hasattr(member, "restart"):
            raise EngineDeadError(f"inference engine {index} ({type(member).__name__}) is dead and cannot be restarted")
        logger.warning("inference engine %d (%s) is dead: restarting it", index, type(member).__name__)
        await member.restart()
        if not await is_healthy(member):
            raise EngineDeadError(f"inference engine {index} ({type(member).__name__}) is still dead after a restart")
        restarted.append(index)
    return restarted
