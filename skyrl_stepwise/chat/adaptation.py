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
    # the template decides how a `tool` observation renders; which role an env returns is the env's (an env that
    # answers in `user` messages is never rendered as a tool): the agent loop names it per env class at its first
    # observations (generator/agent_loop.py)
    if roles.tool_after_call and roles.tool_without_call:
        observations = "an env's `tool` observations as `tool` messages, `user` ones as `user`"
    elif roles.tool_after_call:
        observations = (f"an env's `tool` observations as `tool` messages after a call, as "
                        f"`{roles.fallback_role}` otherwise; `user` ones as `user`")
    else:
        observations = f"ADAPTED: no tool role, observations as `{roles.fallback_role}` messages"
    line = f"chat format of {model}: {system}; {tools}; {observations}"
    injected = injected_system_prompt(getattr(renderer, "tokenizer", None))
    if injected is not None:
        line += (f"; NOTE: the template adds its default system prompt {shorten(injected)!r} to every prompt without "
                 "a system message (a recipe's \"no system prompt\" gets this one)")
    return line


def shorten(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


_PROBE_SYSTEM, _PROBE_USER = "SKYRLSYSTEMPROBE", "SKYRLUSERPROBE"


def injected_system_prompt(tokenizer) -> str | None:
    """The system prompt a chat template adds to a conversation that has none (SmolLM2: "You are a helpful AI
    assistant named SmolLM, trained by Hugging Face"), or None. Found by rendering: where a system message's text
    sits between its header and what follows it, a conversation without one must show nothing there; a template
    that folds the system prompt into the user turn (Gemma) shows no header of its own, so nothing is found."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return None
    user = {"role": "user", "content": _PROBE_USER}
    try:
        with_system = tokenizer.apply_chat_template([{"role": "system", "content": _PROBE_SYSTEM}, user],
                                                    tokenize=False)
        without = tokenizer.apply_chat_template([user], tokenize=False)
    except Exception:  # noqa: BLE001 - a template that refuses a system role injects none
        return None
    if not isinstance(with_system, str) or _PROBE_SYSTEM not in with_system or _PROBE_USER not in with_system:
        return None
    head, rest = with_system.split(_PROBE_SYSTEM, 1)
    between = rest.split(_PROBE_USER, 1)[0]  # the system turn's end and the user turn's header
    start = without.find(head) if head else -1
    if start < 0 or not between:
        return None
    end = without.find(between, start + len(head))
    injected = without[start + len(head):end].strip() if 0 <= end < without.find(_PROBE_USER) else ""
    return injected or None
