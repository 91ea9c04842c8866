"""Reasoning apart from the answer for the client's `reasoning_content`: template renderers keep a think block in
the turn's content (the template decides what a history keeps), but an OpenAI client expects it split out."""

from __future__ import annotations

THINK_TAGS = (("<think>", "</think>"), ("<seed:think>", "</seed:think>"))


def split_reasoning(content: str) -> tuple[str | None, str]:
    """(reasoning, answer) of a turn's text: a leading think block, or text before a closing tag where the
    generation prompt opened the block (Qwen3.5, DeepSeek R1); (None, content) where there is none."""
    for open_tag, close_tag in THINK_TAGS:
        end = content.find(close_tag)
        if end < 0:
            continue
        head = content[:end]
        start = head.find(open_tag)
        if start >= 0 and head[:start].strip():
            continue  # a tag in the middle of an answer is the answer's text
        reasoning = head[start + len(open_tag):] if start >= 0 else head
        return reasoning.strip("\n"), content[end + len(close_tag):].lstrip("\n")
    return None, content
