"""SFT warm start: samples built by the rollout path train exactly the assistant tokens; a step lowers the loss."""

from __future__ import annotations

import pytest
from test_generator import canonical

from skyrl_stepwise.generator import GeneratorConfig, GeneratorSamplingConfig
from skyrl_stepwise.trainer.sft import conversation_samples, sft_batches, split_turns

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
def test_an_sft_step_lowers_the_loss_on_its_batch(tokenizer, model_path):
    from skyrl_stepwise.trainer.config import FSDPConfig, OptimConfig, TrainerConfig
    from skyrl_stepwise.trainer.fsdp_worker import PolicyWorker

    batch = sft_batches(conversation_samples(tokenizer, [CONVERSATION] * 2, GeneratorConfig()), 2, 1, 0)[0]
    worker = PolicyWorker(TrainerConfig(model_path=str(model_path), optim=OptimConfig(lr=1e-4),
                                        fsdp=FSDPConfig(world_size=1, mixed_precision=False)))
    first = worker.train_step(batch, "sft")
    second = worker.train_step(batch, "sft")
    assert first["train/loss_tokens"] == sum(sum(m) for m in batch.loss_masks) > 0
    assert 0 < second["sft/loss"] < first["sft/loss"]
