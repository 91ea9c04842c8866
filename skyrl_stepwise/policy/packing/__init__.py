"""Packing per architecture: what keeps packed samples apart (masks, windows, recurrent boundaries) and the start-up
self-check that proves it on the run's own model. The worker asks this package for model inputs and never looks at
the architecture itself."""

from skyrl_stepwise.policy.packing.layout import (AttentionLayout, attention_layout, refuse_inexact_attention,
                                                   resolve_packing)
from skyrl_stepwise.policy.packing.masks import row_model_inputs

__all__ = ["AttentionLayout", "attention_layout", "refuse_inexact_attention", "resolve_packing", "row_model_inputs"]
