"""What the conformance trajectory costs on each family's real template: the README's family table, regenerated.

tests/test_conformance.py checks the invariants (trained ids = sampled ids, no observation lost); this prints
what they cost for both `generator.thinking_retention` policies: how many turns had to be re-rendered (a new
step chain, with the reasons), and the samples and forward tokens step-wise -> after the prefix-aware merge; and of
the tool-calling trajectory (one call, parallel calls, text then a call, three malformed calls, an answer): how many
malformed calls were answered and how many turns were re-rendered.
Offline: the family tokenizers of tests/family_tokenizers.py and the scripted engine of the test.

    python benchmarks/conformance_table.py            # every family
    python benchmarks/conformance_table.py qwen3      # one
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the conformance test and tokenizers

from family_tokenizers import FAMILIES, family_tokenizer  # noqa: E402
from test_conformance import PROMPT, _generator, observation_text, run_tool_trajectory  # noqa: E402
from test_tool_call_formats import CALLS, SINGLE_CALL, TOOLS, UNRENDERED, _renderer, _sampled_call_turn  # noqa: E402

from skyrl_stepwise.generator import TrajectoryID  # noqa: E402
from skyrl_stepwise.generator.merge import merge_stepwise_output  # noqa: E402

PREFIX = "generate/bridge_fallbacks/"


def forward_tokens(output) -> int:
    """Tokens a forward pass reads: every sample's prompt + response."""
    return sum(len(p) + len(r) for p, r in zip(output.prompt_token_ids, output.response_ids))


def measure(family: str, retention: str) -> tuple[str, str]:
    """Two table cells ('re-renders (reasons) | samples, tokens step-wise -> merged') and the renderer."""
    generator, chat, _ = _generator(family, retention)
    out = asyncio.run(generator.generate([PROMPT], ["conformance"], [{}], [TrajectoryID("q", 0)]))
    metrics = out.rollout_metrics
    if metrics["generate/failed_trajectories"]:
        raise RuntimeError(f"{family} ({retention}): the trajectory failed: {metrics}")
    reasons = ", ".join(k[len(PREFIX):] for k, v in metrics.items() if k.startswith(PREFIX) and v)
    fallbacks = int(metrics["generate/bridge_fallbacks"])
    merged = merge_stepwise_output(out)
    rerenders = f"{fallbacks} ({reasons})" if fallbacks else "0"
    return f"{rerenders} | {len(merged)}, {forward_tokens(out)} -> {forward_tokens(merged)}", chat


def calls_parsed(family: str, backend) -> str:
    """'parsed/emitted format' over one call and two parallel calls exactly as the family's template renders them
    (tests/test_tool_call_formats.py), read by `backend` (the `auto` renderer: the library's parser, or ours in the
    format the template's rendering selects)."""
    chat, tok = _renderer(family), family_tokenizer(family)
    emitted = parsed = 0
    for n in (1,) if family in SINGLE_CALL else (1, 2):
        if chat.renders_tool_calls:
            ids = _sampled_call_turn(family, chat, CALLS[:n])
        else:
            ids = tok(UNRENDERED[chat.tool_parser.name][n - 1], add_special_tokens=False)["input_ids"] + [chat.close_id]
        turn = backend.parse(ids, [], TOOLS)
        got = [(c.name, json.loads(c.arguments) if isinstance(c.arguments, str) else c.arguments)
               for c in turn.tool_calls if c.error is None]
        emitted += n
        parsed += sum(1 for call in CALLS[:n] if call in got)
    return f"{parsed}/{emitted} {getattr(backend, 'tool_parser', chat.tool_parser).name}"


MALFORMED = ("invalid_json", "unknown_tool", "invalid_arguments")


def tool_cells(family: str) -> str:
    """Two cells of the tool-calling trajectory (tests/test_conformance.py::test_family_tool_calls): malformed calls
    answered (an error in the next prompt, the trajectory going on) out of emitted, and its re-renders under
    `template` / `all` (with reasons)."""
    answered, rerenders = {}, []
    for retention in ("template", "all"):
        out, chat, _, kinds, _ = asyncio.run(run_tool_trajectory(family, retention))
        metrics = out.rollout_metrics
        if metrics["generate/failed_trajectories"]:
            raise RuntimeError(f"{family} ({retention}): the tool trajectory failed: {metrics}")
        for i, kind in enumerate(kinds[:-1]):
            prev, nxt = out.prompt_token_ids[i] + out.response_ids[i], out.prompt_token_ids[i + 1]
            new_text = chat.decode(nxt[len(prev):] if nxt[:len(prev)] == prev else nxt)
            if kind in MALFORMED:
                answered[retention] = answered.get(retention, 0) + any(t in new_text for t in observation_text("Error: "))
        reasons = ", ".join(k[len(PREFIX):] for k, v in metrics.items() if k.startswith(PREFIX) and v)
        count = int(metrics["generate/bridge_fallbacks"])
        rerenders.append(f"{count} ({reasons})" if count else "0")
    return f"{min(answered.values())}/{len(MALFORMED)} | {rerenders[0]} / {rerenders[1]}"


def main() -> None:
    logging.basicConfig(level=logging.ERROR)
    families = sys.argv[1:] or sorted(FAMILIES)
    print("| family | backend | calls parsed | malformed answered | tool calls: re-renders `template` / `all` | "
          "`template`: re-renders (reason) | `template`: samples, tokens | `all`: re-renders | `all`: samples, tokens |")
    print("|---|---|---|---|---|---|---|---|---|")
    for family in families:
        template_cells, backend = measure(family, "template")
        all_cells, _ = measure(family, "all")
        print(f"| {family} | {backend.name.split(':')[0]} | {calls_parsed(family, backend)} | {tool_cells(family)} | "
              f"{template_cells} | {all_cells} |")


if __name__ == "__main__":
    main()
