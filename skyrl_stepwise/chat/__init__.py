"""Rendering and parsing per model family: the only place the generator meets chat templates."""

from __future__ import annotations

import logging
from typing import Any

from skyrl_stepwise.chat.base import (ChatRenderer, ConversationTurn, Message, NextPrompt, ParsedTurn, RenderError,
                                      RoleSupport, ToolCallRequest, check_observations_kept, conversation_turn,
                                      developer_as_system, observations_in_roles)
from skyrl_stepwise.chat.library import LibraryRenderer, library_renderer_name, renderer_matching_template
from skyrl_stepwise.chat.template import TemplateRenderer

THINKING_RETENTION = ("template", "all")
logger = logging.getLogger(__name__)


def create_renderer(tokenizer, renderer: str = "auto", chat_template_kwargs: dict[str, Any] | None = None,
                    thinking_retention: str = "template", tool_parser: str = "auto") -> ChatRenderer:
    """`generator.renderer`: `template` (the model's own chat template), a `renderers` name (`qwen3`, `llama-3`,
    `gpt-oss`, ...), or `auto`: the library where it has a renderer for this model, the template otherwise.
    `generator.tool_parser`: the template backend's call format, `auto` = the one its template renders."""
    if thinking_retention not in THINKING_RETENTION:
        raise ValueError(f"generator.thinking_retention must be one of {THINKING_RETENTION}, got {thinking_retention!r}")
    name = None if renderer == "template" else library_renderer_name(tokenizer, renderer)
    if name is None:
        template = TemplateRenderer(tokenizer, chat_template_kwargs, thinking_retention, tool_parser)
        # auto, for a model the library does not know by name: the library renderer that renders what the
        # template renders, so a local folder gets the renderer its hub name would
        name = renderer_matching_template(tokenizer, template, template.tool_parser.name) \
            if renderer == "auto" and tool_parser == "auto" else None
        if name is None:
            return template
        logger.info("renderers' %r renderer renders what the chat template of %s renders: using it", name,
                    tokenizer.name_or_path)
    try:
        return LibraryRenderer(tokenizer, name, chat_template_kwargs, thinking_retention)
    except Exception as e:
        if renderer != "auto":
            raise ValueError(f"generator.renderer={renderer!r} cannot be built for {tokenizer.name_or_path!r}: "
                             f"{type(e).__name__}: {e}") from e
        # e.g. gpt-oss's harmony encoder downloads its vocabulary on first use: offline, the template still works
        logger.warning("renderers' %r renderer is unavailable for %s (%s: %s); using the chat template",
                       name, tokenizer.name_or_path, type(e).__name__, e)
        return TemplateRenderer(tokenizer, chat_template_kwargs, thinking_retention, tool_parser)


def renderer_names() -> list[str]:
    """Every value generator.renderer accepts."""
    from renderers.base import RENDERER_REGISTRY, _populate_registry

    _populate_registry()
    return ["auto", "template", *sorted(RENDERER_REGISTRY)]


__all__ = ["ChatRenderer", "ConversationTurn", "LibraryRenderer", "Message", "NextPrompt", "ParsedTurn", "RenderError",
           "RoleSupport", "TemplateRenderer", "ToolCallRequest", "check_observations_kept", "conversation_turn",
           "developer_as_system", "observations_in_roles", "create_renderer", "renderer_names"]
