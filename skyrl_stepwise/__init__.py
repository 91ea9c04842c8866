"""skyrl_stepwise: token-exact, step-wise multi-turn agent RL."""

__version__ = "0.1.0"
