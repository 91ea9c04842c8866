"""The agent endpoint: an OpenAI-compatible chat API over our engines whose calls become exact step samples.

An agent program (any loop over an OpenAI client) talks to `/s/{session}/v1/chat/completions`; each call is
sampled from ids, and when the program echoes the history back as text, the replay matcher (matching.py) maps the
echoed turns back to the ids this server sampled, so the next prompt extends them exactly as the agent loop does.
A session is one trajectory; closing it yields the same TrajectoryResult / StepSample the generator produces.
"""

from skyrl_stepwise.gateway.config import GatewayConfig
from skyrl_stepwise.gateway.protocol import GatewayError
from skyrl_stepwise.gateway.service import Gateway

__all__ = ["Gateway", "GatewayConfig", "GatewayError"]
