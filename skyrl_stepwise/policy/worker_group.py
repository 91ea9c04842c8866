"""The policy's FSDP2 ranks as Ray actors: one actor per rank, every call broadcast to all of them.

Every PolicyWorker method is a collective, so the group calls it on all ranks with the same
arguments (put once in the object store) and returns rank 0's answer.

A rank that dies (OOM killer, SIGKILL, `ray.kill`, its node lost) ends the run: the others cannot finish a collective
without it, and a group of FSDP shards with one missing has no weights to continue from. Ray's get raises as soon as
one rank's call fails, so the driver never waits on the survivors (who may sit in a collective until its timeout);
the group then raises PolicyWorkerDied naming the rank, the call and Ray's reason, and the latest complete
checkpoint a relaunch with trainer.resume=auto continues from, bitwise. From then on the group refuses every call
but `shutdown`, which gives the survivors a few seconds to leave and then kills them: it never hangs on a stuck
collective and never raises over the error that stopped the run.
"""

from __future__ import annotations

import logging
import os

import ray
import torch

from skyrl_stepwise.checkpoint.store import find_latest_complete
from skyrl_stepwise.host.threads import cpu_thread_env
from skyrl_stepwise.policy.config import TrainerConfig

logger = logging.getLogger(__name__)
SHUTDOWN_GRACE_S = 10.0  # how long survivors of a dead rank get to leave their process group before being killed


class PolicyWorkerDied(RuntimeError):
    """A policy rank's process is gone: the run cannot go on; the message says where to resume from."""


@ray.remote(num_cpus=0)
class _PolicyRank:
    """Holds one PolicyWorker; env vars tell torch.distributed which rank it is."""

    def address(self) -> tuple[str, int, str]:
        from skyrl_stepwise.policy.fsdp_worker import _free_port

        return ray.util.get_node_ip_address(), _free_port(), ray.get_runtime_context().get_node_id()

    def start(self, cfg: TrainerConfig, rank: int, master: tuple[str, int], threads: int, trainable: bool,
              with_reference: bool) -> bool:
        from skyrl_stepwise.policy.fsdp_worker import PolicyWorker

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
        self.cfg, self.died = cfg, None  # died: why the group stopped (PolicyWorkerDied), once a rank is gone
        world = cfg.fsdp.world_size
        gpus = 1 if torch.cuda.is_available() and cfg.fsdp.backend != "gloo" else 0
        threads = cfg.fsdp.threads_per_rank()
        # before torch starts its pools in the actor; on a CPU its threads sleep when they wait (host/threads.py)
        env = {"OMP_NUM_THREADS": str(threads)} if gpus else cpu_thread_env(threads)
        placed = actor_options or [{"num_gpus": gpus}] * world
        self.ranks = [_PolicyRank.options(runtime_env={"env_vars": env}, **placed[i]).remote() for i in range(world)]
        addresses = ray.get([r.address.remote() for r in self.ranks])
        master = addresses[0][:2]
        self.node_id = addresses[0][2]  # rank 0's node
        self.node_ids = [a[2] for a in addresses]  # a policy rank on a node can write weight files there
        ray.get([r.start.remote(cfg, i, master, threads, trainable, with_reference)
                 for i, r in enumerate(self.ranks)])

    def call(self, method: str, *args):
        if self.died is not None:
            raise PolicyWorkerDied(f"{self.died} (the group was stopped; no more calls)")
        refs = [ray.put(a) for a in args]  # one copy in the object store, shared by all ranks
        futures = [r.call.remote(method, *refs) for r in self.ranks]
        try:
            return ray.get(futures)[0]  # raises as soon as any rank's call fails
        except Exception as e:
            dead = self._dead_ranks(futures)
            if not dead:
                raise  # an ordinary error of the call itself (e.g. a bad batch): the group is intact
            self.died = self._death_message(method, dead)
            raise PolicyWorkerDied(self.died) from e

    def _dead_ranks(self, futures: list, grace_s: float = 2.0) -> dict[int, str]:
        """The ranks whose process is gone, with Ray's reason. A dead rank's call fails at once; a rank still
        running (e.g. waiting in a collective for the dead one) is not waited on beyond `grace_s`."""
        ready, _ = ray.wait(futures, num_returns=len(futures), timeout=grace_s)
        dead = {}
        for rank, future in enumerate(futures):
            if future not in ready:
                continue
            try:
                ray.get(future)
            except ray.exceptions.RayActorError as e:
                lines = [line.strip() for line in str(e).splitlines()]
                why = " ".join(line for line in lines if line.startswith(("pid:", "ip:", "The actor is dead")))
                dead[rank] = why.split(" Some common causes")[0]  # Ray's generic advice is cut, the exit detail kept
            except Exception:  # this rank raised itself (e.g. its collective lost the dead peer): alive
                pass
        return dead

    def _death_message(self, method: str, dead: dict[int, str]) -> str:
        latest = find_latest_complete(self.cfg.ckpt_dir) if self.cfg.ckpt_dir else None
        who = "; ".join(f"policy rank {r} of {len(self.ranks)} ({why[:400]})" for r, why in sorted(dead.items()))
        resume = (f"The latest complete checkpoint is {latest}: relaunch with trainer.resume=auto to continue from "
                  "it, bit for bit") if latest else \
            f"No complete checkpoint in trainer.ckpt_dir={self.cfg.ckpt_dir!r} yet"
        return (f"{who} died during {method!r}; the run stops (an FSDP group cannot continue without a rank). "
                f"{resume}. If the process was killed for memory (OOM), lower the per-rank memory first "
                "(trainer.micro_batch_tokens, more ranks, trainer.fsdp.offload_during_rollout)")

    def shutdown(self) -> None:
        """Leave the process groups and end the actors. Bounded: a rank that does not answer within
        SHUTDOWN_GRACE_S (stuck in a collective with a dead or hung peer) is killed with the rest, and a dead rank
        is logged, not raised (this runs in the `finally` of a run that may be stopping for that very reason)."""
        try:
            futures = [r.call.remote("shutdown") for r in self.ranks]
            ready, pending = ray.wait(futures, num_returns=len(futures), timeout=SHUTDOWN_GRACE_S)
            if pending:
                logger.warning(f"policy ranks {[futures.index(f) for f in pending]} did not leave their process "
                               f"group within {SHUTDOWN_GRACE_S:.0f} s: killed")
            for future in ready:
                try:
                    ray.get(future)
                except ray.exceptions.RayActorError as e:
                    logger.warning(f"policy rank {futures.index(future)} was already dead at shutdown: "
                                   f"{str(e).splitlines()[0]}")
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
