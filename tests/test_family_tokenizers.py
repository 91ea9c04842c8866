"""The offline family tokenizers (tests/family_tokenizers.py) render their real chat templates and keep
every template marker one token, so conformance tests built on them mean what they say. No model engine."""

from __future__ import annotations

import re

import pytest
from family_tokenizers import FAMILIES, QWEN_FIRST_ADDED_ID, family_tokenizer

NAMES = list(FAMILIES)

# marker-looking literals: <|x|>, <｜x｜>, [X] / [/X], and the XML-ish tool/think tags
_MARKER = re.compile(r"<\|[A-Za-z_]+\|>|<｜[^｜>]+｜>|\[/?[A-Z_]+\]|</?(?:tool_call|tool_response|tools|think)>")
_JINJA_COMMENT = re.compile(r"\{#.*?#\}", re.S)


def _conversation(spec, *, final_assistant: bool = False) -> list[dict]:
    msgs = [{"role": "system", "content": "Be brief."}] if spec.accepts_system else []
    msgs += [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]
    if not final_assistant:
        msgs.append({"role": "user", "content": "What is 2+2?"})
    return msgs


def _render(tok, spec, messages, *, add_generation_prompt: bool, **kwargs) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                   **{**spec.render_kwargs, **kwargs})


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("name", NAMES)
def test_identity_and_template(name):
    from renderers.base import MODEL_RENDERER_MAP

    spec, tok = FAMILIES[name], family_tokenizer(name)
    assert tok.chat_template == spec.template_path.read_text(encoding="utf-8")
    assert tok.name_or_path == spec.hf_model_id
    # what renderers.create_renderer(tok) resolves by name (None: not mapped -> DefaultRenderer)
    assert MODEL_RENDERER_MAP.get(spec.hf_model_id) == spec.renderer
    assert tok.bos_token == spec.bos_token and tok.pad_token == spec.pad_token
    assert tok.pad_token_id is not None
    # tokenizer(text) prepends BOS exactly where the real tokenizer does
    assert (tok("Hi")["input_ids"][0] == tok.bos_token_id) == spec.adds_bos
    assert _ids(tok, "Hi")[0] != tok.bos_token_id
    # the spec names every marker the template writes
    literals = set(_MARKER.findall(_JINJA_COMMENT.sub("", spec.template)))
    assert literals <= set(spec.template_tokens) | set(spec.multi_token_markers), literals


@pytest.mark.parametrize("name", NAMES)
def test_every_marker_is_one_token(name):
    spec, tok = FAMILIES[name], family_tokenizer(name)
    singles = {t for t, _ in spec.vocab_tokens} | set(spec.template_tokens)
    singles |= set(spec.turn_terminators) | {spec.eos_token, spec.pad_token, spec.history_turn_end}
    singles |= {spec.bos_token} - {None}
    for token in sorted(singles):
        token_id = tok.convert_tokens_to_ids(token)
        assert token_id is not None and tok.convert_ids_to_tokens(token_id) == token, token  # not unk
        assert _ids(tok, token) == [token_id], token
        assert _ids(tok, f"a{token}b") == _ids(tok, "a") + [token_id] + _ids(tok, "b"), token
    for token, special in spec.vocab_tokens:
        token_id = tok.convert_tokens_to_ids(token)
        assert tok.decode([token_id], skip_special_tokens=True) == ("" if special else token), token
    if spec.vocab == "qwen":  # the real ids, in the real order
        assert [tok.convert_tokens_to_ids(t) for t, _ in spec.vocab_tokens] == list(
            range(QWEN_FIRST_ADDED_ID, QWEN_FIRST_ADDED_ID + len(spec.vocab_tokens)))
        assert len(tok) == QWEN_FIRST_ADDED_ID + len(spec.vocab_tokens)
    for marker in spec.multi_token_markers:  # not a token in the real vocabulary either
        assert len(_ids(tok, marker)) > 1, marker


@pytest.mark.parametrize("name", NAMES)
def test_rendered_prompt_round_trips(name):
    spec, tok = FAMILIES[name], family_tokenizer(name)
    text = _render(tok, spec, _conversation(spec), add_generation_prompt=True)
    assert "Hi there" in text and "What is 2+2?" in text and "Hello!" in text
    ids = _ids(tok, text)
    assert tok.decode(ids) == text
    assert _ids(tok, tok.decode(ids)) == ids
    for token in spec.template_tokens:  # every rendered marker became its one id, never BPE pieces
        assert ids.count(tok.convert_tokens_to_ids(token)) == text.count(token), token


@pytest.mark.parametrize("name", NAMES)
def test_eos_closes_the_assistant_turn(name):
    spec, tok = FAMILIES[name], family_tokenizer(name)
    assert tok.eos_token == spec.eos_token == spec.turn_terminators[0]
    assert set(spec.stop_tokens) <= set(spec.turn_terminators) and spec.eos_token in spec.stop_tokens
    assert tok.eos_token_id == tok.convert_tokens_to_ids(spec.eos_token)

    # an assistant turn with later messages: closed by history_turn_end (gpt-oss: <|end|>, all others: eos)
    history = _render(tok, spec, _conversation(spec), add_generation_prompt=True)
    sep = spec.turn_end_separator
    assert "Hello!" + sep + spec.history_turn_end in history
    if not spec.closes_final_turn:  # GLM: nothing follows the last turn; the model samples a stop token there
        return
    # the final assistant turn, as a trainer renders a finished episode: closed by eos
    final = _render(tok, spec, _conversation(spec, final_assistant=True), add_generation_prompt=False)
    assert "Hello!" + sep + spec.eos_token in final
    ids = _ids(tok, final)
    hello_end = _ids(tok, final[: final.index("Hello!" + sep + spec.eos_token) + len("Hello!" + sep)])
    assert ids[: len(hello_end)] == hello_end and ids[len(hello_end)] == tok.eos_token_id


def test_gpt_oss_tool_call_closes_with_call():
    spec, tok = FAMILIES["gpt-oss"], family_tokenizer("gpt-oss")
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "search", "arguments": {"q": "x"}}}]}
    text = _render(tok, spec, [{"role": "user", "content": "Find x"}, call,
                               {"role": "tool", "content": "found"}], add_generation_prompt=True)
    assert '<|start|>assistant to=functions.search<|channel|>commentary json<|message|>{"q": "x"}<|call|>' in text
    assert "<|start|>functions.search to=assistant<|channel|>commentary<|message|>" in text
    assert tok.convert_tokens_to_ids("<|call|>") in _ids(tok, text)


def test_llama_ipython_tool_call_closes_with_eom():
    spec, tok = FAMILIES["llama-3.1"], family_tokenizer("llama-3.1")
    call = {"role": "assistant",
            "tool_calls": [{"type": "function", "function": {"name": "brave_search", "arguments": {"query": "x"}}}]}
    text = _render(tok, spec, [{"role": "user", "content": "Find x"}, call], add_generation_prompt=False,
                   builtin_tools=["brave_search"])
    assert text.endswith('<|python_tag|>brave_search.call(query="x")<|eom_id|>')
    assert _ids(tok, text)[-1] == tok.convert_tokens_to_ids("<|eom_id|>")


def _reference(spec):
    """The family tokenizer built the slow, obvious way: the vocabulary loaded or parsed again, nothing shared."""
    from qwen_vocab import _bare_backend_json
    from tokenizers import AddedToken, Tokenizer, normalizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from skyrl_stepwise.models.prepare import prepare_model

    if spec.vocab == "qwen":
        backend = Tokenizer.from_str(_bare_backend_json())
        for content, special in spec.vocab_tokens:
            (backend.add_special_tokens if special else backend.add_tokens)(
                [AddedToken(content, special=special, normalized=False)])
        tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=spec.eos_token, pad_token=spec.pad_token,
                                      bos_token=spec.bos_token)
        tok.backend_tokenizer.normalizer = normalizers.NFC()
    else:
        tok = AutoTokenizer.from_pretrained(prepare_model())
        for content, special in spec.vocab_tokens:
            tok.add_tokens([AddedToken(content, special=special, normalized=False)], special_tokens=special)
        tok.eos_token, tok.bos_token, tok.pad_token = spec.eos_token, spec.bos_token, spec.pad_token
    tok.chat_template = spec.template
    if spec.adds_bos:
        tok.add_bos_token = True
    return tok


# one per way of building: smollm2 vocabulary (plain, BOS-adding) and Qwen vocabulary (with and without BOS token)
@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
@pytest.mark.parametrize("name", ["smollm2", "command-r7b", "qwen2.5", "deepseek-r1-distill-qwen"])
def test_shared_vocabulary_builds_the_same_tokenizer(name):
    """family_tokenizer shares one parsed BPE model between families (the suites' time was spent re-parsing it):
    the result must be the tokenizer the slow way builds, and building one must not change the next."""
    spec = FAMILIES[name]
    fast, ref = family_tokenizer(name), _reference(spec)
    assert fast.backend_tokenizer.to_str() == ref.backend_tokenizer.to_str()  # model, pipeline, added tokens
    for attr in ("eos_token_id", "bos_token_id", "pad_token_id", "all_special_ids", "added_tokens_decoder",
                 "special_tokens_map", "chat_template", "add_bos_token"):
        assert getattr(fast, attr) == getattr(ref, attr), attr
    text = "Hi <|im_start|> there 2+2 " + " ".join(t for t, _ in spec.vocab_tokens) + " naïve ｜ end"
    for add_special in (True, False):
        ids = fast(text, add_special_tokens=add_special)["input_ids"]
        assert ids == ref(text, add_special_tokens=add_special)["input_ids"]
        assert fast.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    messages = _conversation(spec)
    assert _render(fast, spec, messages, add_generation_prompt=True) == _render(ref, spec, messages,
                                                                                 add_generation_prompt=True)
    other = next(n for n in NAMES if FAMILIES[n].vocab == spec.vocab and n != name)
    assert len(family_tokenizer(other)) == len(_reference(FAMILIES[other]))  # no added token leaked across
