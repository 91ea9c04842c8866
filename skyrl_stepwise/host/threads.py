"""The environment a CPU-computing process of ours starts its OpenMP thread pool with.

Why: torch's OpenMP threads (libgomp) spin on a barrier for a while after each parallel region before they sleep.
That is cheap on cores nobody else wants. On a CPU host the vLLM engine core, the policy ranks and the driver share
the same few cores, so a spinning thread holds the core the next process needs. Measured on a 2-core AMD EPYC (AVX2,
no native bf16) with another process busy on one core: the three SmolLM2 rollout tests (tests/test_rollouts_vllm.py)
took 332 s wall and 362 CPU-s with the default policy, 183 s and 181 CPU-s with OMP_WAIT_POLICY=PASSIVE; the engine
core alone spent 295 CPU-s vs 125. So our CPU processes sleep at once when they wait, unless the user's environment
chooses a policy (a dedicated many-core engine node may prefer ACTIVE).
"""

from __future__ import annotations

import os

WAIT_POLICY = "OMP_WAIT_POLICY"


def cpu_thread_env(threads: int) -> dict[str, str]:
    """Env vars for a Ray actor computing on the CPU with `threads` OpenMP threads: read by libgomp when torch loads,
    so they must be in the actor's environment before it starts, not set inside it."""
    return {"OMP_NUM_THREADS": str(threads), WAIT_POLICY: os.environ.get(WAIT_POLICY, "PASSIVE")}
