"""`gateway.*`: the agent endpoint's own settings (sampling comes from generator.sampling, never from a request)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GatewayConfig:
    """How the endpoint is served and how agent programs are run as rollouts."""

    enabled: bool = False  # rows naming an `agent` run through the endpoint only when this is on
    # model names a request may ask for; empty: the tokenizer's name_or_path and "policy"
    model_names: list[str] = field(default_factory=list)
    api_key: str = "skyrl"  # handed to agent programs; the endpoint serves only this process, so it is not a secret
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port picked at start-up
    agent_timeout_s: float = 600.0  # an agent program running longer fails its trajectory (counted)

    def validate(self) -> None:
        """Fail at start-up naming the key, not at the first rollout."""
        if self.agent_timeout_s <= 0:
            raise ValueError(f"gateway.agent_timeout_s must be > 0, got {self.agent_timeout_s}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"gateway.port must be in [0, 65535], got {self.port}")
