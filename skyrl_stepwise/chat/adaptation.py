"""One start-up line saying how the model's chat template was adapted to multi-turn tool use, so a user of their
own model sees that a template without a system role, a tool format or a tool role was worked around (and how)
instead of finding it out from rollouts."""

from __future__ import annotations


def describe_chat_adaptation(renderer) -> str:
    """`chat format of MODEL: ...` naming the system role, the tool-call format and the observation role the
    generator uses; library renderers are named as such (they render their family's own format)."""
    model = getattr(getattr(renderer, "tokenizer", None), "name_or_path", "") or "the model"
    roles = getattr(renderer, "roles", None)
    if roles is None or not hasattr(renderer, "renders_tools"):
        return f"chat format of {model}: renderer {getattr(renderer, 'name', type(renderer).__name__)!r}"
    parser = renderer.tool_parser.name
    if renderer.renders_tools:
        tools = f"tool schemas where the template puts them, calls parsed as {parser}"
    else:
        place = "a system block" if roles.system else "a block in the first user turn"
        tools = f"ADAPTED: the template renders no tools, so the schemas go in {place} asking for {parser} calls"
    system = "system role kept" if roles.system else \
        "ADAPTED: no system role, the system prompt (tools block included) opens the first user turn"
    if roles.tool_after_call and roles.tool_without_call:
        observations = "observations as `tool` messages"
    elif roles.tool_after_call:
        observations = f"observations as `tool` messages after a call, as `{roles.fallback_role}` otherwise"
    else:
        observations = f"ADAPTED: no tool role, observations as `{roles.fallback_role}` messages"
    return f"chat format of {model}: {system}; {tools}; {observations}"
