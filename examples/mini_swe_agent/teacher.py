"""A teacher for mini-swe-agent on the repo-fixing tasks: writes the bash calls a good model would make, for the warm
start recorded through the endpoint (`sft.data=agent_demos`, `experiment=repo_fix_mini_swe_agent_warm_tiny`,
`skyrl-stepwise data agent-demos --teacher examples.mini_swe_agent.teacher:teach`).

`teach(messages, row)` gets mini-swe-agent's request (its own prompts and its one `bash` tool, messages in SFT shape)
and the dataset row, and returns the next assistant turn, in mini-swe-agent's recommended workflow: run the failing
test; for each bug, read its module (`nl -ba`) and replace the buggy text with a `python3` heredoc; run the test again;
submit with mini-swe-agent's own marker. The bugs are taken from the row's `extra_info.bugs` (the site ids the
generator injected, skyrl_stepwise/data/repo_fix.py): the fix itself is not in an agent row's extras.
"""

from __future__ import annotations

from typing import Any

from skyrl_stepwise.data.repo_fix import Site

SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"  # mini-swe-agent's own end-of-task marker (examples/.../agent.py)


def edit_command(path: str, old: str, new: str) -> str:
    """A shell command replacing the one occurrence of `old` by `new` in `path` (fails loudly if `old` is absent)."""
    return (f"python3 - <<'EOF'\nimport pathlib\np = pathlib.Path({path!r})\ntext = p.read_text()\n"
            f"assert text.count({old!r}) == 1, 'the text to replace is not there exactly once'\n"
            f"p.write_text(text.replace({old!r}, {new!r}))\nEOF")


def plan(row: dict[str, Any]) -> list[tuple[str, str]]:
    """The whole demonstration: (reasoning text, bash command) per model call, the submit last."""
    info, spec = row.get("extra_info") or {}, row.get("reward_spec") or {}
    package, test = info["package"], spec["test_command"]
    steps = [("I will run the failing test first to see what breaks.", test)]
    for bug in info["bugs"]:
        module, function, index = bug["site"].rsplit(".", 2)
        site = Site(module, function, int(index))
        path = f"{package}/{module}.py"
        steps.append((f"The failure points to `{function}` in `{path}`; let me read that module.", f"nl -ba {path}"))
        steps.append((f"`{function}` has a {site.bug.kind} bug. I will fix that line.",
                      edit_command(path, site.bug.buggy, site.bug.correct)))
    steps.append(("Now I run the test again to check the fix.", test))
    steps.append(("The test passes, so I submit my changes.", f"echo {SUBMIT}"))
    return steps


def teach(messages: list[dict], row: dict[str, Any]) -> dict[str, Any]:
    """The next call of the plan: the one after as many assistant turns as the request already holds."""
    done = sum(1 for m in messages if m.get("role") == "assistant")
    steps = plan(row)
    text, command = steps[min(done, len(steps) - 1)]
    return {"role": "assistant", "content": text,
            "tool_calls": [{"type": "function", "function": {"name": "bash", "arguments": {"command": command}}}]}
