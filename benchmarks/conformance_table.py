"""What the conformance trajectory costs on each family's real template: the README's family table, regenerated.

tests/test_conformance.py checks the invariants (trained ids = sampled ids, no observation lost); this prints
what they cost for both `generator.thinking_retention` policies: how many turns had to be re-rendered (a new
step chain, with the reasons), and the samples and forward tokens step-wise -> after the prefix-aware merge.
Offline: the family tokenizers of tests/family_tokenizers.py and the scripted engine of the test.

    python benchmarks/conformance_table.py            # every family
    python benchmarks/conformance_table.py qwen3      # one
"""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the conformance test and tokenizers

from family_tokenizers import FAMILIES  # noqa: E402
from test_conformance import PROMPT, _generator  # noqa: E402

from skyrl_stepwise.generator import TrajectoryID  # noqa: E402
from skyrl_stepwise.generator.merge import merge_stepwise_output  # noqa: E402

PREFIX = "generate/bridge_fallbacks/"


def forward_tokens(output) -> int:
    """Tokens a forward pass reads: every sample's prompt + response."""
    return sum(len(p) + len(r) for p, r in zip(output.prompt_token_ids, output.response_ids))


def measure(family: str, retention: str) -> tuple[str, str]:
    """Two table cells ('re-renders (reasons) | samples, tokens step-wise -> merged') and the renderer's name."""
    generator, chat, _ = _generator(family, retention)
    out = asyncio.run(generator.generate([PROMPT], ["conformance"], [{}], [TrajectoryID("q", 0)]))
    metrics = out.rollout_metrics
    if metrics["generate/failed_trajectories"]:
        raise RuntimeError(f"{family} ({retention}): the trajectory failed: {metrics}")
    reasons = ", ".join(k[len(PREFIX):] for k, v in metrics.items() if k.startswith(PREFIX) and v)
    fallbacks = int(metrics["generate/bridge_fallbacks"])
    merged = merge_stepwise_output(out)
    rerenders = f"{fallbacks} ({reasons})" if fallbacks else "0"
    return f"{rerenders} | {len(merged)}, {forward_tokens(out)} -> {forward_tokens(merged)}", chat.name


def main() -> None:
    logging.basicConfig(level=logging.ERROR)
    families = sys.argv[1:] or sorted(FAMILIES)
    print("| family | backend | `template`: re-renders (reason) | `template`: samples, tokens | "
          "`all`: re-renders | `all`: samples, tokens |")
    print("|---|---|---|---|---|---|")
    for family in families:
        template_cells, backend = measure(family, "template")
        all_cells, _ = measure(family, "all")
        print(f"| {family} | {backend.split(':')[0]} | {template_cells} | {all_cells} |")


if __name__ == "__main__":
    main()
