"""`gateway.*`: the agent endpoint's own settings (sampling comes from generator.sampling, never from a request)."""

from __future__ import annotations

import dataclasses
import ipaddress
from dataclasses import dataclass, field

DEFAULT_API_KEY = "skyrl"


@dataclass
class GatewayConfig:
    """How the endpoint is served and how agent programs are run as rollouts."""

    enabled: bool = False  # rows naming an `agent` run through the endpoint only when this is on
    # model names a request may ask for; empty: the tokenizer's name_or_path and "policy"
    model_names: list[str] = field(default_factory=list)
    # handed to agent programs and checked on every route (`Authorization: Bearer <key>`); null: no check (loopback
    # hosts only). The default is public: a host other than loopback needs a key of your own.
    api_key: str | None = DEFAULT_API_KEY
    host: str = "127.0.0.1"  # a non-loopback address (0.0.0.0, a LAN IP) serves other machines: needs api_key
    port: int = 0  # 0: a free port picked at start-up
    agent_timeout_s: float = 600.0  # an agent program running longer fails its trajectory (counted)

    def validate(self) -> None:
        """Fail at start-up naming the key, not at the first rollout."""
        if self.agent_timeout_s <= 0:
            raise ValueError(f"gateway.agent_timeout_s must be > 0, got {self.agent_timeout_s}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"gateway.port must be in [0, 65535], got {self.port}")
        if not is_loopback(self.host) and (not self.api_key or self.api_key == DEFAULT_API_KEY):
            which = "no gateway.api_key" if not self.api_key else f"the built-in gateway.api_key={DEFAULT_API_KEY!r}"
            raise ValueError(f"gateway.host={self.host!r} serves the agent endpoint beyond this machine with {which}: "
                             "anyone who reaches the port could sample from the policy and post rewards. Set "
                             "gateway.api_key to a secret of your own, or gateway.host=127.0.0.1")


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only (localhost, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost may resolve to anything
        return False


# generator.context keys the endpoint applies: a session ended by the context limit (its last request refused as
# longer than generator.max_input_length) stops with `context_exhausted`, as in the agent loop
GATEWAY_CONTEXT_KEYS = ("mask_limit_stops",)


def check_generator_for_gateway(generator) -> None:
    """Refuse, naming the key, generator.context settings the endpoint cannot apply: an agent program builds its own
    context (the endpoint samples what it is sent, and editing it would break the chain it continues) and counts
    its own tokens, so a context policy or a token budget would be accepted and do nothing. The defaults pass."""
    from skyrl_stepwise.generator.config import ContextConfig

    default = ContextConfig()
    for f in dataclasses.fields(ContextConfig):
        value = getattr(generator.context, f.name)
        if f.name in GATEWAY_CONTEXT_KEYS or value == getattr(default, f.name):
            continue
        raise ValueError(f"generator.context.{f.name}={value!r} has no effect with gateway.enabled=true: an agent "
                         "program builds its own context and counts its own tokens (the endpoint samples exactly what "
                         f"it is sent). Remove the override (default {getattr(default, f.name)!r}); of "
                         f"generator.context only {', '.join(GATEWAY_CONTEXT_KEYS)} applies to agent programs")
