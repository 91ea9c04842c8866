"""Template-exact turn deltas: the tokens a chat template puts between two model turns.

BPE decode -> re-encode is not a bijection, so we never re-tokenize what the model sampled. Instead we
ask the model's own chat template what comes *after* an assistant turn (for ChatML: the `\\n` after
`<|im_end|>`, the observation message and `<|im_start|>assistant\\n`) by rendering a fixed prefix
conversation with and without the new messages and keeping the token suffix.
"""

from __future__ import annotations

from dataclasses import dataclass

from skyrl_stepwise.envs.base import Message

# A fixed conversation that ends with an assistant turn; its own content never reaches a sample.
_BASE_CONVERSATION: list[Message] = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "U"},
    {"role": "assistant", "content": "A"},
]


@dataclass
class Bridge:
    """Ids to append after an assistant turn's EOS, or None when the template cannot be extended."""

    ids: list[int] | None
    reason: str = ""


class ChatTemplateBridge:
    """Renders and tokenizes with the tokenizer's chat template, and computes exact turn bridges."""

    def __init__(self, tokenizer) -> None:
        if tokenizer.eos_token_id is None:
            raise ValueError("tokenizer has no eos_token_id; the generator needs one to close assistant turns")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("tokenizer has no chat_template; multi-turn rollouts need one")
        self.tokenizer = tokenizer
        self.eos_id: int = tokenizer.eos_token_id
        self._base_ids = self.encode(self.render(_BASE_CONVERSATION, add_generation_prompt=False))
        eos_positions = [i for i, t in enumerate(self._base_ids) if t == self.eos_id]
        if not eos_positions:
            raise ValueError("the chat template does not close an assistant turn with the tokenizer's EOS "
                             f"({tokenizer.eos_token!r}); exact history needs it")
        # The bridge starts right after the assistant's EOS: anything the template puts there
        # (ChatML's "\n") belongs to the bridge, not to the model's response.
        self._cut = eos_positions[-1] + 1

    def render(self, messages: list[Message], add_generation_prompt: bool) -> str:
        """The chat template as text; the single place templates are applied."""
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        """Tokenize rendered template text the way apply_chat_template(tokenize=True) does."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        """Decode keeping special tokens and spacing, so text comparisons are faithful."""
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def prompt_ids(self, messages: list[Message]) -> list[int]:
        """First-turn prompt: the template with a generation prompt, tokenized once."""
        return self.encode(self.render(messages, add_generation_prompt=True))

    def bridge(self, new_messages: list[Message]) -> Bridge:
        """Ids that follow an assistant EOS when `new_messages` arrive, checked to extend the prefix."""
        full = self.encode(self.render(_BASE_CONVERSATION + list(new_messages), add_generation_prompt=True))
        if full[: len(self._base_ids)] != self._base_ids:
            return Bridge(None, "template re-renders earlier turns when a message is added")
        return Bridge(full[self._cut:])
