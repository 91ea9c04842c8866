"""The main job's agent programs (gateway.enabled): one endpoint for training rollouts and one for evals.

Evals must run the agents too, or the eval would measure our own agent loop on rows written for someone else's
program. Each stage gets its own Gateway because the endpoint's sampling is the run's, fixed per gateway and never
taken from a request: the training one samples with generator.sampling, the eval one greedily with the eval
config (trainer.loop.eval_config), so an agent that restates its sampling is checked against the right settings
and the eval counters (`gateway/*`) never mix into a training step's.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

from skyrl_stepwise.gateway.rollout import AgentProgramGenerator, AgentServer
from skyrl_stepwise.gateway.service import Gateway

logger = logging.getLogger("skyrl_stepwise.cli.train")


class AgentPrograms:
    """`await start()` builds both stages and binds their ports (a port that cannot be bound fails start-up);
    `train` and `eval` are the generators the trainer gets, each serving its endpoint from its first rollout on
    (announced then, when it answers: the start-up that follows blocks the event loop for minutes); `stop()` shuts
    the servers down (safe to call after a failed start)."""

    def __init__(self, tokenizer, engine, generator_cfg, eval_generator_cfg, gateway_cfg, registry,
                 renderer=None) -> None:
        eval_gateway_cfg = dataclasses.replace(gateway_cfg, port=0)  # gateway.port is the training endpoint's
        self._stages = {"train": Gateway(tokenizer, engine, generator_cfg, gateway_cfg, renderer=renderer),
                        "eval": Gateway(tokenizer, engine, eval_generator_cfg, eval_gateway_cfg, renderer=renderer)}
        self.registry = registry
        self._servers: list[AgentServer] = []
        self.train: AgentProgramGenerator | None = None
        self.eval: AgentProgramGenerator | None = None

    async def start(self) -> "AgentPrograms":
        for name, gateway in self._stages.items():
            server = AgentServer(gateway, announce=functools.partial(_announce, name, gateway.model_names))
            self._servers.append(server)
            setattr(self, name, AgentProgramGenerator(gateway, server, self.registry))
        return self

    async def stop(self) -> None:
        while self._servers:
            await self._servers.pop().__aexit__(None, None, None)


def _announce(stage: str, models: list[str], url: str) -> None:
    logger.info(f"agent endpoint ({stage}): {url}/s/{{session}}/v1 (models {models})")
