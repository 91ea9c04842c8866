"""SFT warm start: samples built by the rollout path train exactly the assistant tokens; a step lowers the loss."""

from __future__ import annotations

import json

import pytest
from family_tokenizers import FAMILIES, family_tokenizer
from test_generator import canonical

from skyrl_stepwise.generator import GeneratorConfig, GeneratorSamplingConfig
from skyrl_stepwise.loop.sft import conversation_samples, sft_batches, split_turns

CONVERSATION = [
    {"role": "system", "content": "You are a search agent."},
    {"role": "user", "content": "Who painted the Mona Lisa?"},
    {"role": "assistant", "content": "<think> I should search. </think>\n<search> Mona Lisa painter </search>"},
    {"role": "user", "content": "\n\n<information>Doc 1(Title: Mona Lisa) painted by Leonardo</information>\n\n"},
    {"role": "assistant", "content": "<answer> Leonardo da Vinci </answer>"},
]


@pytest.mark.parametrize("stop", [[], ["</search>", "</answer>"]])
def test_sft_samples_train_exactly_the_assistant_tokens(tokenizer, stop):
    cfg = GeneratorConfig(sampling=GeneratorSamplingConfig(stop=stop))
    out = conversation_samples(tokenizer, [CONVERSATION, CONVERSATION[:3]], cfg)
    assert len(out) == 2  # one chain per conversation
    eos = tokenizer.eos_token_id
    for sample, conversation in zip(range(2), (CONVERSATION, CONVERSATION[:3])):
        assistants = split_turns(conversation)[1]
        trained = [t for t, m in zip(out.response_ids[sample], out.loss_masks[sample]) if m]
        # with stop strings the engine stops at "</search>" and the closing EOS is ours (untrained), as in RL
        expected = [t for a in assistants for t in canonical(tokenizer, a["content"]) + ([] if stop else [eos])]
        assert trained == expected
        text = tokenizer.decode(out.prompt_token_ids[sample] + out.response_ids[sample])
        # the same tokens the chat template renders for the whole conversation (its final newline aside)
        assert text == tokenizer.apply_chat_template(conversation, tokenize=False).rstrip("\n")
    assert out.rollout_logprobs is None


def test_sft_batches_cover_every_conversation_each_epoch(tokenizer):
    out = conversation_samples(tokenizer, [CONVERSATION] * 5, GeneratorConfig())
    batches = sft_batches(out, batch_size=2, epochs=2, seed=0)
    assert [len(b) for b in batches] == [2, 2, 1, 2, 2, 1]
    assert sorted(i for b in batches[:3] for i in b.instance_ids) == [str(i) for i in range(5)]


@pytest.mark.integration
def test_an_sft_step_lowers_the_loss_on_its_batch(tokenizer, tiny_smollm2):
    """The SFT step's loss and its masks: SmolLM2's tiny twin, same tokenizer and template, so the same batch."""
    from skyrl_stepwise.policy.config import FSDPConfig, OptimConfig, TrainerConfig
    from skyrl_stepwise.policy.fsdp_worker import PolicyWorker

    batch = sft_batches(conversation_samples(tokenizer, [CONVERSATION] * 2, GeneratorConfig()), 2, 1, 0)[0]
    worker = PolicyWorker(TrainerConfig(model_path=str(tiny_smollm2), optim=OptimConfig(lr=1e-3),
                                        fsdp=FSDPConfig(world_size=1, mixed_precision=False)))
    first = worker.train_step(batch, "sft")
    second = worker.train_step(batch, "sft")
    assert first["train/loss_tokens"] == sum(sum(m) for m in batch.loss_masks) > 0
    assert 0 < second["sft/loss"] < first["sft/loss"]


class _InProcessPolicy:
    """PolicyGroup's interface over one in-process PolicyWorker (1 gloo rank)."""

    def __init__(self, worker) -> None:
        self.worker = worker

    def call(self, method: str, *args):
        return getattr(self.worker, method)(*args)


def _tiny_sft_batches() -> list:
    import torch

    from skyrl_stepwise.policy.batching import TrainBatch

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 128, (12,), generator=g).tolist() for _ in range(6)]
    responses = [torch.randint(1, 128, (8,), generator=g).tolist() for _ in range(6)]
    masks = [[1] * 4 + [0] * 2 + [1] * 2 for _ in range(6)]  # an observation in the middle, untrained
    batch = TrainBatch(prompt_ids=prompts, response_ids=responses, loss_masks=masks,
                       instance_ids=[str(i) for i in range(6)])
    return [batch.select([i, (i + 1) % 6]) for i in range(5)]


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_a_resumed_sft_run_ends_with_the_weights_of_an_uninterrupted_one(tiny_model_dir, tmp_path):
    from skyrl_stepwise.checkpoint.store import complete_checkpoints
    from skyrl_stepwise.policy.config import TrainerConfig
    from skyrl_stepwise.policy.fsdp_worker import PolicyWorker
    from skyrl_stepwise.loop.sft import train_sft

    def policy(ckpt_dir):
        cfg = TrainerConfig(model_path=str(tiny_model_dir), ckpt_dir=str(ckpt_dir), max_ckpts_to_keep=1)
        cfg.fsdp.mixed_precision = False
        cfg.optim.lr = 1e-2  # AdamW moments matter: a resume that lost them would land elsewhere
        return _InProcessPolicy(PolicyWorker(cfg))

    batches = _tiny_sft_batches()
    straight = policy(tmp_path / "straight")
    expected = train_sft(straight, batches)
    expected_weights = straight.worker.weights_checksum()

    class Crash(Exception):
        pass

    def crash_after_step_3(step, metrics):
        if step == 3:
            raise Crash

    with pytest.raises(Crash):
        train_sft(policy(tmp_path / "ckpts"), batches, ckpt_interval=2, ckpt_dir=str(tmp_path / "ckpts"),
                  on_step=crash_after_step_3)
    assert [p.name for p in complete_checkpoints(tmp_path / "ckpts")] == ["step_2"]  # step 3 was not saved
    resumed = policy(tmp_path / "ckpts")
    ran = []
    history = train_sft(resumed, batches, ckpt_interval=2, ckpt_dir=str(tmp_path / "ckpts"),
                        on_step=lambda step, m: ran.append(step))
    assert ran == [3, 4, 5]
    assert resumed.worker.weights_checksum() == expected_weights != policy(tmp_path / "fresh").worker.weights_checksum()
    assert [h["sft/loss"] for h in history] == pytest.approx([h["sft/loss"] for h in expected], rel=1e-6)
    assert [p.name for p in complete_checkpoints(tmp_path / "ckpts")] == ["step_4"]  # older ones pruned


@pytest.mark.parametrize("ctx", [dict(policy="summarize", summarize_threshold=40),
                                 dict(policy="sliding_window", window=1), dict(policy="truncate",
                                                                              max_observation_tokens=4)])
def test_sft_replays_demonstrations_as_written_whatever_the_context_policy(tokenizer, ctx):
    """A context policy edits what the model sees in RL; a demonstration is replayed as the demonstrator wrote it
    (summarize used to take the next scripted turn for a summary and fail the row), so every policy of a comparison
    starts from the same warm start."""
    from skyrl_stepwise.generator.config import ContextConfig

    plain = conversation_samples(tokenizer, [CONVERSATION], GeneratorConfig())
    edited = conversation_samples(tokenizer, [CONVERSATION], GeneratorConfig(context=ContextConfig(**ctx)))
    assert (edited.prompt_token_ids, edited.response_ids, edited.loss_masks) == \
        (plain.prompt_token_ids, plain.response_ids, plain.loss_masks)
    assert edited.rollout_metrics["context/fires_per_trajectory"] == 0


@pytest.mark.parametrize("change", [
    "trainer.optim.weight_decay=0.1", "trainer.optim.max_grad_norm=0.5", "trainer.optim.betas=[0.8,0.99]",
    "trainer.optim.eps=1e-6", "generator.history=retokenize", "generator.use_conversation_multi_turn=false",
    "generator.thinking_retention=all", "generator.sampling.stop=[]", "sft.lr=1e-4", "trainer.seed=7",
    "trainer.fsdp.mixed_precision=false", "trainer.keep_dropout=true", "weights", "chat_template"])
@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_the_sft_cache_key_changes_with_every_input_of_the_warm_start(change, tiny_model_dir, tmp_path, monkeypatch):
    """A setting that changes the SFT samples or the optimizer, or the base model's content (weights, chat
    template) under the same file names and sizes, must miss the cache: a stale warm start was reused silently."""
    import shutil

    # the recipe as written (bf16 mixed precision), whatever this host computes: on a CPU without native bf16 the
    # recipe already runs float32 and `trainer.fsdp.mixed_precision=false` would change nothing to key on
    monkeypatch.setattr("skyrl_stepwise.host.hardware.cpu_bf16_is_native", lambda: True)

    from skyrl_stepwise.loop.warm_start import cache_key
    from skyrl_stepwise.cli.train import load_config

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    memo = tmp_path / "digests.json"
    base = ["experiment=search_r1_tiny"]
    overrides = base if change in ("weights", "chat_template") else base + [change]
    cfg = load_config(base)
    cfg.trainer.model_path = str(model)
    before = cache_key(cfg, "data", memo_path=memo)
    assert cache_key(cfg, "data", memo_path=memo) == before  # deterministic (and the memo of weight digests agrees)
    changed = load_config(overrides)
    changed.trainer.model_path = str(model)
    if change == "weights":  # same name, same size, other values
        weights = model / "model.safetensors"
        raw = bytearray(weights.read_bytes())
        raw[-1] ^= 0xFF
        weights.write_bytes(bytes(raw))
    if change == "chat_template":
        (model / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}\n{% endfor %}")
    assert cache_key(changed, "data", memo_path=memo) != before
    # what cannot change the weights leaves the key alone: the cache still serves every other run
    same = load_config(base + ["trainer.fsdp.gradient_checkpointing=true", "total_steps=9",
                               "generator.n_samples_per_prompt=3", "generator.context.policy=summarize"])
    same.trainer.model_path = str(model)
    if change not in ("weights", "chat_template"):
        assert cache_key(same, "data", memo_path=memo) == before


TOOL_DEMO = [
    {"role": "user", "content": "What is 6 * 7?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "id": "call_0", "function": {"name": "calculator", "arguments": '{"expression": "6 * 7"}'}}]},
    {"role": "tool", "content": "42"},
    {"role": "assistant", "content": "<answer>42</answer>"},
]


def test_tool_call_demonstrations_train_the_calls_the_parser_reads_under_the_rl_prompt(tokenizer):
    """OpenAI-shaped `tool_calls` become the hermes call text the renderer parses back into the same call, and the
    prompt shows the run's tool schemas exactly as the tool env's RL prompt does."""
    from skyrl_stepwise.chat import create_renderer
    from skyrl_stepwise.tools.config import configured_tool_schemas

    tools = configured_tool_schemas(None)
    cfg = GeneratorConfig(sampling=GeneratorSamplingConfig(stop=[]))
    out = conversation_samples(tokenizer, [TOOL_DEMO, [TOOL_DEMO[0], {"role": "assistant", "content": "42"}]], cfg,
                               tools)
    chat = create_renderer(tokenizer, cfg.renderer)
    assert out.prompt_token_ids[0] == chat.prompt_ids(TOOL_DEMO[:1], tools)  # what RL renders for a tool row
    assert out.prompt_token_ids[1] == chat.prompt_ids(TOOL_DEMO[:1])  # no tool use: no schemas, as before
    mask = out.loss_masks[0]
    first_turn_end = mask.index(0)  # the first untrained token: the tool result follows the call turn
    call_turn = out.response_ids[0][:first_turn_end]
    parsed = chat.parse(call_turn, out.prompt_token_ids[0], tools)
    assert [(c.name, c.arguments, c.error) for c in parsed.tool_calls] == [("calculator", {"expression": "6 * 7"},
                                                                           None)]
    observation = tokenizer.decode([t for t, m in zip(out.response_ids[0], mask) if not m])
    assert "42" in observation


# Granite 3.3's, LFM2's and Falcon-H1's templates render no `tool_calls` (they only instruct the model how to write a
# call), so there is no rendering of the call to train: refused, naming the renderer
CALLS_NOT_WRITABLE = {"granite-3.3", "lfm2", "falcon-h1"}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tool_call_demonstrations_are_written_in_each_familys_own_call_format(family):
    """On every family's real template, a demonstrated call is trained as the family renders it, and the renderer's
    parser reads the trained ids back into exactly that call; a family whose calls cannot be written is refused by
    name, never trained on a format its parser does not read."""
    from skyrl_stepwise.chat import create_renderer
    from skyrl_stepwise.tools.config import configured_tool_schemas

    tokenizer, tools = family_tokenizer(family), configured_tool_schemas(None)
    cfg = GeneratorConfig(sampling=GeneratorSamplingConfig(stop=[]),
                          chat_template_kwargs=dict(FAMILIES[family].render_kwargs))
    demo = [TOOL_DEMO[0], {**TOOL_DEMO[1], "tool_calls": [{**TOOL_DEMO[1]["tool_calls"][0], "id": "call00000"}]},
            {**TOOL_DEMO[2], "tool_call_id": "call00000"}, TOOL_DEMO[3]]
    try:
        out = conversation_samples(tokenizer, [demo], cfg, tools)
    except ValueError as e:
        assert family in CALLS_NOT_WRITABLE, f"{family}: {e}"
        assert "cannot be written in the call format of" in str(e)
        return
    assert family not in CALLS_NOT_WRITABLE
    chat = create_renderer(tokenizer, cfg.renderer, cfg.chat_template_kwargs)
    mask, response = out.loss_masks[0], out.response_ids[0]
    call_turn = response[:mask.index(0)] if 0 in mask else response  # a template that re-renders breaks the chain
    parsed = chat.parse(call_turn, out.prompt_token_ids[0], tools)
    arguments = [json.loads(c.arguments) if isinstance(c.arguments, str) else c.arguments for c in parsed.tool_calls]
    assert [(c.name, c.error) for c in parsed.tool_calls] == [("calculator", None)]
    assert arguments == [{"expression": "6 * 7"}]
    assert call_turn[-1] in chat.stop_ids  # the turn ends as a model ends it
    assert "42" not in tokenizer.decode(call_turn)  # never the tool's output as a target
    assert sum(sum(m) for m in out.loss_masks) == len(call_turn) + len(chat.encode("<answer>42</answer>")) + 1


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - CALLS_NOT_WRITABLE))
def test_tool_demonstrations_do_not_depend_on_their_call_ids(family):
    """Issue 36 item 5: the k-th tool message after a demonstrated turn answers the parsed turn's k-th call, as in
    RL; a demonstration's own ids (`toolu_...`, not the `call_0` gpt-oss's and Gemma 4's parsers assign) once had
    its tool result trained as a user turn there, a layout RL never produces."""
    from skyrl_stepwise.chat import create_renderer
    from skyrl_stepwise.tools.config import configured_tool_schemas

    tokenizer, tools = family_tokenizer(family), configured_tool_schemas(None)
    cfg = GeneratorConfig(sampling=GeneratorSamplingConfig(stop=[]),
                          chat_template_kwargs=dict(FAMILIES[family].render_kwargs))
    chat = create_renderer(tokenizer, cfg.renderer, cfg.chat_template_kwargs)

    def demo(call_id):
        return [TOOL_DEMO[0], {**TOOL_DEMO[1], "tool_calls": [{**TOOL_DEMO[1]["tool_calls"][0], "id": call_id}]},
                {**TOOL_DEMO[2], "tool_call_id": call_id}, TOOL_DEMO[3]]

    outs = [conversation_samples(tokenizer, [demo(i)], cfg, tools) for i in ("call00000", "toolu01AB")]
    if "toolu01AB" not in tokenizer.decode(outs[1].response_ids[0]):  # Mistral writes the id into the call itself
        assert outs[0].prompt_token_ids == outs[1].prompt_token_ids and outs[0].response_ids == outs[1].response_ids
    if chat.roles.tool_after_call:  # the result is rendered as what it is: a tool result
        assert all(o.rollout_metrics["generate/observation_role_fallbacks"] == 0 for o in outs), family


EDIT_TOOL = {"type": "function", "function": {"name": "edit", "description": "Replace text.", "parameters": {
    "type": "object", "properties": {"old_str": {"type": "string"}, "new_str": {"type": "string"}},
    "required": ["old_str", "new_str"]}}}


@pytest.mark.parametrize("family", ["qwen3-coder", "qwen3.5", "glm-4.6", "minimax-m2", "seed-oss", "nemotron-3-nano"])
def test_a_demonstrated_call_is_trained_only_where_its_arguments_parse_back(family, monkeypatch):
    """Issue 36 item 2: the SFT parse-back check compares arguments, not only names: a call whose rendering the
    parser reads back with other arguments (a stripped `    return x\\n`) is never trained as that call."""
    from skyrl_stepwise.chat import create_renderer
    from skyrl_stepwise.chat.tool_formats import base as formats_base

    tokenizer = family_tokenizer(family)
    cfg = GeneratorConfig(sampling=GeneratorSamplingConfig(stop=[]),
                          chat_template_kwargs=dict(FAMILIES[family].render_kwargs))
    arguments = {"old_str": "    return x\n", "new_str": "\n    return y\n\n"}
    demo = [{"role": "user", "content": "Fix it."}, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "id": "call00000", "function": {"name": "edit", "arguments": arguments}}]},
            {"role": "tool", "content": "done", "tool_call_id": "call00000"}, {"role": "assistant", "content": "ok"}]
    out = conversation_samples(tokenizer, [demo], cfg, [EDIT_TOOL])
    chat = create_renderer(tokenizer, cfg.renderer, cfg.chat_template_kwargs)
    mask, response = out.loss_masks[0], out.response_ids[0]
    parsed = chat.parse(response[:mask.index(0)], out.prompt_token_ids[0], [EDIT_TOOL])
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("edit", arguments)]
    # a reader that loses whitespace: the demonstration is refused by name, not trained as another call
    real = formats_base.xml_call
    monkeypatch.setattr(formats_base, "xml_call", lambda name, pairs, *a: real(
        name, [(k, v.strip()) for k, v in pairs], *a))
    with pytest.raises(ValueError, match="cannot be written in the call format of"):
        conversation_samples(tokenizer, [demo], cfg, [EDIT_TOOL])


def test_sft_lora_picks_how_the_warm_start_trains_and_its_cache_key_follows(tiny_model_dir, tmp_path):
    """Full SFT under LoRA RL (the default, sft.lora=false) is the very warm start (cache key) a full run uses, so
    one cached SFT serves both arms of a comparison; sft.lora=true trains an adapter whatever RL does."""
    from skyrl_stepwise.cli.train import load_config
    from skyrl_stepwise.loop.warm_start import cache_key, sft_lora_config

    memo = tmp_path / "digests.json"

    def key_and_lora(*overrides):
        cfg = load_config(["experiment=search_r1_tiny", *overrides])
        cfg.trainer.model_path = str(tiny_model_dir)
        return cache_key(cfg, "data", memo_path=memo), sft_lora_config(cfg).enabled

    full, full_lora = key_and_lora()
    assert not full_lora
    lora_rl_full_sft, enabled = key_and_lora("trainer.lora.enabled=true", "sft.lora=false")
    assert (lora_rl_full_sft, enabled) == (full, False)
    assert key_and_lora("sft.lora=false") == (full, False)
    assert key_and_lora("trainer.lora.enabled=true") == (full, False)  # the one-line override: full SFT
    lora_sft, enabled = key_and_lora("trainer.lora.enabled=true", "sft.lora=true")
    assert enabled and lora_sft != full
    assert key_and_lora("sft.lora=true") == (lora_sft, True)  # the same adapter, whatever RL trains
    assert key_and_lora("trainer.lora.enabled=true", "sft.lora=true", "trainer.lora.rank=4")[0] not in (full, lora_sft)
