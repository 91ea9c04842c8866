"""LoRA on the FSDP2 policy (trainer.lora, policy/lora.py): only the adapter trains and holds AdamW state, the
reference is the base with the adapter off (no second copy), the engines receive merged weights that score like the
trained policy, a checkpoint resumes bitwise, and the packing self-check holds with the adapter trained. Tiny random
models, one gloo rank in-process."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from arch_zoo import conformance_batch, tiny_model

from skyrl_stepwise.policy.config import LoRAConfig, TrainerConfig

ARCHS = ["llama", "qwen2", "gpt2"]


def _save_tiny(model_type: str, path) -> str:
    if model_type == "gpt2":  # Conv1D projections and a fused c_attn: peft's fan_in_fan_out path
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=96, n_positions=256,
                                           bos_token_id=1, eos_token_id=2))
    else:
        model = tiny_model(model_type)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return {arch: _save_tiny(arch, tmp_path_factory.mktemp(arch)) for arch in ARCHS}


def _cfg(model_path: str, ckpt_dir, **lora) -> TrainerConfig:
    cfg = TrainerConfig(model_path=model_path, micro_batch_tokens=64, ckpt_dir=str(ckpt_dir))
    cfg.fsdp.mixed_precision = False
    cfg.algorithm.tis_ratio_clip_high = None
    cfg.algorithm.use_kl_loss = False
    cfg.optim.lr = 1e-2  # big enough that one step visibly moves a tiny adapter
    cfg.lora = LoRAConfig(enabled=True, rank=4, alpha=8.0, **{"lr": cfg.optim.lr, **lora})  # as measured before the 10x default
    return cfg


def _batch():
    batch = conformance_batch()
    adv = [1.0, -1.0, 0.5, -0.5, 1.0, -1.0]
    batch.advantages = [[a] * len(r) for a, r in zip(adv, batch.response_ids)]
    return batch


def _worker(cfg, **kw):
    from skyrl_stepwise.policy.fsdp_worker import PolicyWorker

    return PolicyWorker(cfg, **kw)


def _full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _params(worker) -> dict[str, torch.Tensor]:
    return {n: _full(p) for n, p in worker.model.named_parameters()}


# ------------------------------------------------------------------------------------------------ config

@pytest.mark.parametrize("key, value, message", [
    ("rank", 0, "trainer.lora.rank must be >= 1"),
    ("rank", -4, "trainer.lora.rank must be >= 1"),
    ("alpha", 0.0, "trainer.lora.alpha must be > 0"),
    ("alpha", -16.0, "trainer.lora.alpha must be > 0"),
    ("dropout", 0.1, "trainer.lora.dropout=0.1 but the engines sample without dropout"),
    ("target_modules", [], "trainer.lora.target_modules is empty"),
])
def test_lora_config_errors_name_the_key(key, value, message):
    cfg = TrainerConfig()
    cfg.lora = replace(LoRAConfig(enabled=True), **{key: value})
    with pytest.raises(ValueError, match=message):
        cfg.validate()


def test_lora_is_off_by_default_and_dropout_needs_keep_dropout():
    assert TrainerConfig().lora.enabled is False
    cfg = TrainerConfig(keep_dropout=True)
    cfg.lora = LoRAConfig(enabled=True, dropout=0.1)
    cfg.validate()  # kept knowingly


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_one_override_turns_lora_on_in_the_composed_run_config():
    from skyrl_stepwise.run.app_config import load_config

    cfg = load_config(["trainer.lora.enabled=true", "trainer.lora.target_modules=[q_proj,v_proj]"])
    assert cfg.trainer.lora == LoRAConfig(enabled=True, target_modules=["q_proj", "v_proj"])
    assert load_config([]).trainer.lora.enabled is False
    with pytest.raises(ValueError, match="trainer.lora.dropout"):
        load_config(["trainer.lora.enabled=true", "trainer.lora.dropout=0.05"])


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_a_lora_warm_start_is_cached_apart_from_a_full_one():
    """SFT with LoRA (sft.lora=true) trains another model than full SFT: the warm-start cache must not hand one to
    the other. LoRA RL alone (the one-line override) warm-starts from the full SFT: the same key."""
    from skyrl_stepwise.run.app_config import load_config
    from skyrl_stepwise.loop.warm_start import cache_key

    full = cache_key(load_config(["experiment=search_r1_tiny"]), "digest")
    assert cache_key(load_config(["experiment=search_r1_tiny", "trainer.lora.enabled=true"]), "digest") == full
    lora = cache_key(load_config(["experiment=search_r1_tiny", "trainer.lora.enabled=true", "sft.lora=true"]),
                     "digest")
    assert lora != full
    assert cache_key(load_config(["experiment=search_r1_tiny", "trainer.lora.rank=4"]), "digest") == full  # off
    assert cache_key(load_config(["experiment=search_r1_tiny", "trainer.lora.enabled=true", "sft.lora=true",
                                  "trainer.lora.rank=4"]), "digest") != lora


def test_a_target_module_the_model_lacks_is_refused_naming_the_key_and_the_modules(model_dirs, tmp_path):
    listed = "'down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', 'v_proj'"
    with pytest.raises(ValueError, match=rf"trainer.lora.target_modules: 'query_key_value' names no linear module.*"
                                         rf"{listed}"):
        _worker(_cfg(model_dirs["llama"], tmp_path, target_modules=["q_proj", "query_key_value"]))


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
@pytest.mark.parametrize("lora", [True, False])
def test_flex_attention_that_cannot_train_on_cpu_is_refused_at_start_naming_the_key(lora, model_dirs, tmp_path):
    """FlexAttention has no CPU backward: a trainable policy (LoRA or full) stops at start-up, not at its first step;
    a frozen flex model (scoring only) still starts."""
    cfg = _cfg(model_dirs["llama"], tmp_path)
    cfg = cfg if lora else replace(cfg, lora=LoRAConfig())
    cfg.attn_implementation = "flex_attention"
    what = "a LoRA adapter" if lora else "the policy"
    with pytest.raises(ValueError, match=f"trainer.attn_implementation=flex_attention cannot train {what} on CPU"):
        _worker(cfg)
    assert _worker(cfg, trainable=False).model.config._attn_implementation == "skyrl_packed_flex"


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_target_modules_resolve_by_suffix_within_the_decoder_layers(model_dirs, tmp_path):
    worker = _worker(_cfg(model_dirs["llama"], tmp_path, target_modules=["q_proj", "mlp.down_proj"]))
    assert sorted(worker.lora_layers) == [f"model.layers.{i}.{m}" for i in (0, 1)
                                          for m in ("mlp.down_proj", "self_attn.q_proj")]
    everything = _worker(_cfg(model_dirs["llama"], tmp_path))  # all-linear: 7 projections per layer, no lm_head
    assert len(everything.lora_layers) == 14 and not any("lm_head" in n for n in everything.lora_layers)


# ------------------------------------------------------------------------------------- training, reference

@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_only_the_adapter_trains_and_holds_optimizer_state(model_dirs, tmp_path):
    worker = _worker(_cfg(model_dirs["llama"], tmp_path))
    adapter = {n for n, p in worker.model.named_parameters() if p.requires_grad}
    assert adapter and all(".lora_A." in n or ".lora_B." in n for n in adapter)
    held = {id(p) for group in worker.optimizer.param_groups for p in group["params"]}
    assert held == {id(p) for n, p in worker.model.named_parameters() if n in adapter}
    before = _params(worker)
    for _ in range(2):  # B starts at 0, so A first moves in the second step
        worker.train_step(_batch())
    after = _params(worker)
    named = dict(worker.model.named_parameters())
    assert {n for n, p in named.items() if p in worker.optimizer.state} == adapter
    assert all(p.grad is None for p in named.values())
    for name in before:
        if name in adapter:
            assert not torch.equal(before[name], after[name]), f"adapter weight {name} did not train"
        else:
            assert torch.equal(before[name], after[name]), f"base weight {name} changed"


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_the_lora_reference_is_the_base_model_without_a_second_copy(model_dirs, tmp_path):
    cfg = _cfg(model_dirs["llama"], tmp_path)
    cfg.algorithm.use_kl_loss, cfg.algorithm.kl_loss_coef = True, 0.1
    batch = _batch()
    base = _worker(replace(cfg, lora=LoRAConfig()), trainable=False).compute_logprobs(batch)
    worker = _worker(cfg, with_reference=True)
    assert worker.reference is None  # no second model
    assert worker.compute_ref_logprobs(batch) == base == worker.compute_logprobs(batch)  # B = 0 at the start
    batch.ref_logprobs = worker.compute_ref_logprobs(batch)
    trainable = {n for n, p in worker.model.named_parameters() if p.requires_grad}
    worker.train_step(batch)
    worker.train_step(batch)
    assert worker.compute_logprobs(batch) != base
    assert worker.compute_ref_logprobs(batch) == base
    assert {n for n, p in worker.model.named_parameters() if p.requires_grad} == trainable  # adapter back on


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_gradient_checkpointing_with_lora_recomputes_and_changes_no_number(model_dirs, tmp_path):
    """The adapter inside a checkpointed decoder layer still gets its gradient (non-reentrant checkpointing: the
    layer's input from the frozen embedding needs no grad), and the step is the same as without checkpointing."""
    results = []
    for checkpointing in (False, True):
        cfg = _cfg(model_dirs["llama"], tmp_path)
        cfg.fsdp.gradient_checkpointing = checkpointing
        worker = _worker(cfg)
        calls = []
        worker.model.model.layers[0].self_attn.register_forward_pre_hook(lambda *args: calls.append(1))
        metrics = [worker.train_step(_batch()) for _ in range(2)][-1]
        results.append((len(calls), metrics["policy/loss"], metrics["train/grad_norm"], worker.weights_checksum()))
    (plain_calls, *plain), (ckpt_calls, *ckpt) = results
    assert ckpt_calls == 2 * plain_calls > 0
    assert plain[1] > 0 and ckpt[:2] == pytest.approx(plain[:2], rel=1e-5) and ckpt[2] == plain[2]


# ------------------------------------------------------------------------------------------- weight export

@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
@pytest.mark.parametrize("arch", ARCHS)
def test_exported_merged_weights_score_like_the_trained_lora_policy(arch, model_dirs, tmp_path):
    from transformers import AutoModelForCausalLM

    from skyrl_stepwise.policy.fsdp_worker import weights_checksum

    plain = AutoModelForCausalLM.from_pretrained(model_dirs[arch], dtype=torch.float32)
    worker = _worker(_cfg(model_dirs[arch], tmp_path))
    assert worker.weights_checksum() == weights_checksum(plain.named_parameters())  # B = 0: the base's weights
    batch = _batch()
    for _ in range(2):
        worker.train_step(batch)
    trained = worker.compute_logprobs(batch)
    state = worker.full_state_dict()
    assert set(state) == set(plain.state_dict())  # the base model's names, nothing of the adapter
    plain.load_state_dict(state, strict=True)
    assert worker.weights_checksum() == weights_checksum(plain.named_parameters())
    assert [(e["name"], e["shape"]) for bucket in _manifest(worker) for e in bucket] == \
        [(n, list(t.shape)) for n, t in plain.state_dict().items()]
    from safetensors.torch import load_file

    written = worker.export_weights(str(tmp_path / "sync.safetensors"), "float32")  # the engines' file sync
    synced = load_file(next(iter(written["paths"].values())))
    assert synced.keys() == state.keys() and all(torch.equal(synced[n], state[n]) for n in state)
    folder = tmp_path / "merged"
    plain.save_pretrained(folder)
    engine_like = _worker(replace(worker.cfg, model_path=str(folder), lora=LoRAConfig()), trainable=False)
    exported = engine_like.compute_logprobs(batch)
    diff = max(abs(a - b) for x, y in zip(trained, exported) for a, b in zip(x, y))
    assert diff < 1e-5, diff
    before = worker.compute_logprobs(batch)
    assert trained == before


def _manifest(worker):
    """The broadcast plan's (name, shape) entries, bucket by bucket."""
    from skyrl_stepwise.inference.weight_broadcast import manifest_from_wire

    return [[{"name": s.name, "shape": list(s.shape)} for s in bucket]
            for bucket in manifest_from_wire(worker.weight_manifest("float32", 1 << 20))]


def test_the_merge_is_peft_s_own_merge(model_dirs, tmp_path):
    """merged_items on gathered tensors equals peft's merge_and_unload of the same adapter (Conv1D included)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from skyrl_stepwise.policy.lora import adapted_layers, merged_items

    model = AutoModelForCausalLM.from_pretrained(model_dirs["gpt2"], dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"],
                                                  fan_in_fan_out=True, init_lora_weights=False))
    inner = peft_model.base_model.model
    ours = dict(merged_items(inner.state_dict(), adapted_layers(inner)))
    theirs = peft_model.merge_and_unload().state_dict()
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=1e-6, msg=name)


# ------------------------------------------------------------------------------ checkpoints and packing

@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_bitwise_resume_with_lora(model_dirs, tmp_path):
    batch = _batch()
    cfg = _cfg(model_dirs["qwen2"], tmp_path / "ckpt")
    cfg.optim.scheduler, cfg.optim.num_training_steps = "linear", 10
    straight = _worker(cfg)
    for _ in range(2):
        straight.train_step(batch)
    path = straight.save_checkpoint(2, {"step": 2})
    third = straight.train_step(batch)
    fresh = _worker(cfg)  # a restarted job: a new random adapter until the checkpoint is loaded
    assert fresh.weights_checksum() != straight.weights_checksum()
    assert fresh.load_checkpoint(path)["step"] == 2
    resumed = fresh.train_step(batch)
    assert resumed == {**third, "train/step_time_s": resumed["train/step_time_s"]}
    assert fresh.weights_checksum() == straight.weights_checksum()
    assert all(torch.equal(_full(a), _full(b)) for a, b in zip(fresh.model.parameters(), straight.model.parameters()))


def _dcp_bytes(path) -> int:
    return sum(f.stat().st_size for f in (path / "dcp").rglob("*") if f.is_file())


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_a_lora_checkpoint_holds_the_adapter_alone_and_resumes_bitwise_on_the_base(model_dirs, tmp_path):
    """The checkpoint shrinks by about the frozen base (re-read from model_path at resume), the resumed run
    continues bitwise, and the base's identity is recorded."""
    batch = _batch()
    cfg = _cfg(model_dirs["qwen2"], tmp_path / "lora")
    straight = _worker(cfg)
    straight.train_step(batch)
    path = straight.save_checkpoint(1, {"step": 1})
    full_cfg = replace(_cfg(model_dirs["qwen2"], tmp_path / "full"), lora=LoRAConfig())
    full = _worker(full_cfg)
    full_path = full.save_checkpoint(1, {"step": 1})
    base_bytes = sum(p.numel() * 4 for p in full.model.parameters())
    adapter_bytes = sum(p.numel() * 4 for n, p in straight.model.named_parameters() if ".lora_" in n)
    from torch.distributed.checkpoint import FileSystemReader

    held = [k for k in FileSystemReader(str(path / "dcp")).read_metadata().state_dict_metadata
            if k.startswith("model.")]
    assert held and all(".lora_" in k for k in held), held[:5]  # the adapter's tensors alone
    assert _dcp_bytes(path) < 3 * adapter_bytes + 400 * 1024  # adapter + its AdamW moments (+ DCP's per-item headers)
    assert _dcp_bytes(full_path) - _dcp_bytes(path) > 0.7 * base_bytes  # shrinks by about the base
    import json

    saved = json.loads((path / "trainer_state.json").read_text())["model"]
    assert saved["adapter_only"] and saved["base_weights"] and saved["lora"]["rank"] == 4
    second = straight.train_step(batch)
    fresh = _worker(cfg)
    fresh.load_checkpoint(path)
    resumed = fresh.train_step(batch)
    assert resumed == {**second, "train/step_time_s": resumed["train/step_time_s"]}
    assert all(torch.equal(_full(a), _full(b)) for a, b in zip(fresh.model.parameters(), straight.model.parameters()))


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_a_lora_checkpoint_refuses_a_base_whose_weights_differ_naming_the_path(model_dirs, tmp_path):
    straight = _worker(_cfg(model_dirs["qwen2"], tmp_path / "ckpt"))
    straight.train_step(_batch())
    path = straight.save_checkpoint(1, {"step": 1})
    from transformers import AutoModelForCausalLM

    other = AutoModelForCausalLM.from_pretrained(model_dirs["qwen2"], dtype=torch.float32)
    with torch.no_grad():
        other.model.layers[0].mlp.up_proj.weight[0, 0] += 1.0
    other.save_pretrained(tmp_path / "other")
    moved = _worker(_cfg(str(tmp_path / "other"), tmp_path / "ckpt"))
    with pytest.raises(ValueError, match=rf"trainer.model_path='{tmp_path / 'other'}'.*not the base the LoRA "
                                         rf"checkpoint {path}"):
        moved.load_checkpoint(path)
    full = _worker(replace(_cfg(model_dirs["qwen2"], tmp_path / "ckpt"), lora=LoRAConfig()))
    with pytest.raises(ValueError, match="holds a LoRA adapter but trainer.lora.enabled=False"):
        full.load_checkpoint(path)


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_packing_self_check_and_tree_packing_hold_with_a_trained_adapter(model_dirs, tmp_path):
    from skyrl_stepwise.policy.packing.selfcheck import check_packing_precisely

    worker = _worker(replace(_cfg(model_dirs["llama"], tmp_path), packing="tree"))
    assert worker.cfg.packing == "tree" and worker.packing_check.passed
    for _ in range(2):
        worker.train_step(_batch())
    for packing in ("tree", "rows"):
        check = check_packing_precisely(worker.model, worker.layout, packing, worker.device, torch.float32, seed=0)
        assert check.passed, check.describe()


# ------------------------------------------------------------------------------------ two gloo ranks

def _lora_rank(rank: int, port: int, model_path: str, tmp: str) -> None:
    import json
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    cfg = _cfg(model_path, os.path.join(tmp, "ckpt"))
    cfg.fsdp.world_size = 2
    worker = _worker(cfg, with_reference=True)
    batch = _batch()
    base = worker.compute_ref_logprobs(batch)
    for _ in range(2):
        worker.train_step(batch)
    trained, ref = worker.compute_logprobs(batch), worker.compute_ref_logprobs(batch)
    checksum = worker.weights_checksum()
    state = worker.full_state_dict()  # merged, gathered on rank 0
    if rank == 0:
        torch.save(state, os.path.join(tmp, "merged.pt"))
        with open(os.path.join(tmp, "result.json"), "w") as f:
            json.dump({"trained": trained, "ref": ref, "base": base, "checksum": checksum}, f)
    worker.shutdown()


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_lora_on_two_sharded_gloo_ranks_exports_the_trained_policy(model_dirs, tmp_path):
    """FSDP2 really shards the adapter (A, B split over 2 ranks with the frozen base in the same groups): the
    merged export gathered from the shards scores what the sharded LoRA policy scores, and the reference is the base."""
    import json
    import socket

    import torch.multiprocessing as mp
    from arch_zoo import logprobs_alone
    from transformers import AutoModelForCausalLM

    from skyrl_stepwise.policy.fsdp_worker import weights_checksum

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_lora_rank, args=(port, model_dirs["llama"], str(tmp_path)), nprocs=2, join=True)
    r = json.loads((tmp_path / "result.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(model_dirs["llama"], dtype=torch.float32)
    batch = _batch()
    with torch.no_grad():
        base = logprobs_alone(model, batch)
        model.load_state_dict(torch.load(tmp_path / "merged.pt"), strict=True)
        merged = logprobs_alone(model, batch)
    flat = lambda rows: torch.tensor([v for row in rows for v in row])  # noqa: E731
    assert r["ref"] == r["base"]
    torch.testing.assert_close(flat(r["base"]), base, rtol=0, atol=1e-5)
    assert (flat(r["trained"]) - base).abs().max() > 1e-3  # the adapter moved the policy
    torch.testing.assert_close(flat(r["trained"]), merged, rtol=0, atol=1e-5)
    assert r["checksum"] == weights_checksum(model.named_parameters())


def test_a_garbled_lora_checkpoint_is_still_reported_corrupt_naming_the_file(model_dirs, tmp_path):
    """The identity check reads trainer_state.json first; a garbled one must still be the CorruptCheckpoint that
    resume=auto quarantines, not a LoRA-setting mismatch."""
    from skyrl_stepwise.checkpoint.store import CorruptCheckpoint

    worker = _worker(_cfg(model_dirs["llama"], tmp_path))
    path = worker.save_checkpoint(1, {"step": 1})
    (path / "trainer_state.json").write_text("{garbled")
    with pytest.raises(CorruptCheckpoint, match=r"trainer_state.json cannot be read"):
        worker.load_checkpoint(path)


RECIPES = sorted(p.stem for p in (Path(__file__).parent.parent / "conf" / "experiment").glob("*.yaml"))
RECIPE_NEEDS = {"tool_task_tiny": ["data.train_path=rows.parquet"]}  # the task-neutral recipe names its rows


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_one_line_override_turns_lora_on_for_every_recipe(recipe):
    """`trainer.lora.enabled=true` is all a recipe needs (its SFT, if any, trains every weight; sft.lora=true an
    adapter): no recipe sets something LoRA refuses."""
    from skyrl_stepwise.run.app_config import load_config

    overrides = [f"experiment={recipe}", *RECIPE_NEEDS.get(recipe, [])]
    assert not load_config(overrides).trainer.lora.enabled
    cfg = load_config(overrides + ["trainer.lora.enabled=true"])
    assert cfg.trainer.lora == LoRAConfig(enabled=True)
