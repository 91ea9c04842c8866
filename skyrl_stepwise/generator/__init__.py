"""Step-wise agent_loop generator: token-exact multi-turn rollouts and prefix-aware merging."""

from skyrl_stepwise.generator.config import GeneratorConfig, GeneratorSamplingConfig
from skyrl_stepwise.generator.generator import StepwiseGenerator
from skyrl_stepwise.generator.merge import merge_stepwise_output
from skyrl_stepwise.generator.output import GeneratorOutput, TrajectoryID

__all__ = ["GeneratorConfig", "GeneratorSamplingConfig", "GeneratorOutput", "StepwiseGenerator",
           "TrajectoryID", "merge_stepwise_output"]
