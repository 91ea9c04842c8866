"""The policy's FSDP2 ranks as Ray actors: one actor per rank, every call broadcast to all of them.

Every PolicyWorker method is a collective, so the group calls it on all ranks with the same
arguments (put once in the object store) and returns rank 0's answer.
"""

from __future__ import annotations

import os

import ray
import torch

from skyrl_stepwise.trainer.config import TrainerConfig


@ray.remote(num_cpus=0)
class _PolicyRank:
    """Holds one PolicyWorker; env vars tell torch.distributed which rank it is."""

    def address(self) -> tuple[str, int, str]:
        from skyrl_stepwise.trainer.fsdp_worker import _free_port

        return ray.util.get_node_ip_address(), _free_port(), ray.get_runtime_context().get_node_id()

    def start(self, cfg: TrainerConfig, rank: int, master: tuple[str, int], threads: int, trainable: bool,
              with_reference: bool) -> bool:
        from skyrl_stepwise.trainer.fsdp_worker import PolicyWorker

        os.environ.update(MASTER_ADDR=master[0], MASTER_PORT=str(master[1]), RANK=str(rank),
                          LOCAL_RANK=str(rank % max(1, torch.cuda.device_count())) if torch.cuda.is_available() else "0",
                          WORLD_SIZE=str(cfg.fsdp.world_size))
        torch.set_num_threads(threads)
        self.worker = PolicyWorker(cfg, trainable, with_reference)
        return True

    def call(self, method: str, *args):
        return getattr(self.worker, method)(*args)


class PolicyGroup:
    """`group.call("train_step", batch)` runs on every rank and returns rank 0's result."""

    def __init__(self, cfg: TrainerConfig, trainable: bool = True, actor_options: list[dict] | None = None,
                 with_reference: bool = False) -> None:
        """`actor_options[i]`: rank i's Ray `.options()` (its placement-group bundle and GPU share, placement.py);
        without them each rank asks for a whole GPU when CUDA is visible. `with_reference`: every rank also holds
        its shard of a frozen copy of the starting weights (`ReferenceOnPolicyRanks(group)` scores with it)."""
        world = cfg.fsdp.world_size
        gpus = 1 if torch.cuda.is_available() and cfg.fsdp.backend != "gloo" else 0
        threads = cfg.fsdp.threads_per_rank()
        env = {"OMP_NUM_THREADS": str(threads)}  # before torch starts its pools in the actor
        placed = actor_options or [{"num_gpus": gpus}] * world
        self.ranks = [_PolicyRank.options(runtime_env={"env_vars": env}, **placed[i]).remote() for i in range(world)]
        addresses = ray.get([r.address.remote() for r in self.ranks])
        master = addresses[0][:2]
        self.node_id = addresses[0][2]  # rank 0's node
        self.node_ids = [a[2] for a in addresses]  # a policy rank on a node can write weight files there
        ray.get([r.start.remote(cfg, i, master, threads, trainable, with_reference)
                 for i, r in enumerate(self.ranks)])

    def call(self, method: str, *args):
        refs = [ray.put(a) for a in args]  # one copy in the object store, shared by all ranks
        return ray.get([r.call.remote(method, *refs) for r in self.ranks])[0]

    def shutdown(self) -> None:
        try:
            ray.get([r.call.remote("shutdown") for r in self.ranks])
        finally:
            for r in self.ranks:
                ray.kill(r)


class ReferenceOnPolicyRanks:
    """The reference model as the trainer loop sees it (`call("compute_logprobs", batch)`), answered by the
    frozen copy inside the policy's own ranks (PolicyWorker(with_reference=True))."""

    def __init__(self, policy) -> None:
        self.policy = policy

    def call(self, method: str, *args):
        if method != "compute_logprobs":
            raise AttributeError(f"the reference only scores (compute_logprobs), got {method!r}")
        return self.policy.call("compute_ref_logprobs", *args)
