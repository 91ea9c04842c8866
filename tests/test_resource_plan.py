"""The run's memory plan (resource_plan.py): sized to what is in flight, clamped to what the engine will accept on a
host whose NUMA node looks small (a freshly booted VM), doubled on a CPU without bf16, refused before any model
loads when it cannot fit, naming the knob and a number that fits."""

from __future__ import annotations

import pytest

from skyrl_stepwise.run.resource_plan import (GIB, MemoryView, ResourcePlanError, engine_node_memory, make_plan,
                                          longest_prompt_tokens)

# SmolLM2-135M: 30 layers x 3 KV heads x 64 dims x K and V
SMOLLM2_PARAMS = 134_515_008
BIG_HOST = MemoryView("host", 24 * GIB, 22 * GIB)
FRESH_VM_NODE = MemoryView("the engine's NUMA node 0", int(9.46 * GIB), int(6.46 * GIB))  # the VM


def _recipe(model_path, monkeypatch, native_bf16: bool):
    from skyrl_stepwise.cli.train import load_config

    monkeypatch.setattr("skyrl_stepwise.host.hardware.cpu_bf16_is_native", lambda: native_bf16)
    monkeypatch.setattr("skyrl_stepwise.run.config._has_cuda", lambda: False)
    cfg = load_config(["experiment=search_r1_tiny"])
    cfg.engine.model_path = cfg.trainer.model_path = str(model_path)
    return cfg


def _plan(cfg, host=BIG_HOST, node=FRESH_VM_NODE, longest=300, eval_rows=200):
    return make_plan(cfg, longest, eval_rows, needs_search=True, host=host, engine_view=node, params=SMOLLM2_PARAMS)


def test_a_fresh_vm_small_node_gets_a_cache_the_engine_accepts_on_a_cpu_without_bf16(model_path, monkeypatch):
    cfg = _recipe(model_path, monkeypatch, native_bf16=False)
    assert cfg.engine.dtype == "float32" and cfg.engine.cpu_kvcache_gib is None
    plan = _plan(cfg)
    # 128 eval trajectories at 300 + 3 x 128 generated + 2 x 256 observed tokens = 1196 each would take 6.6 GiB in
    # float32 (46,080 bytes a token): more than node 0 offers; the cache is cut to what it accepts
    assert plan.kv_bytes_per_token == 46_080 and plan.demand.tokens_each == 1196 and plan.demand.trajectories == 128
    assert plan.kv_tokens < plan.demand.tokens
    granted = cfg.engine.cpu_kvcache_gib * GIB
    # what vLLM checks after loading its weights: the explicit cache size against the node's available memory
    assert granted + plan.engine_weights <= FRESH_VM_NODE.available
    assert 0 < plan.trajectories_at_once() < 128
    line = plan.describe()
    assert "vLLM queues the other" in line and "NUMA node 0: 6.5 of 9.5 GiB available" in line


def test_with_native_bf16_the_same_run_keeps_every_trajectory_in_flight(model_path, monkeypatch):
    cfg = _recipe(model_path, monkeypatch, native_bf16=True)
    plan = _plan(cfg)
    assert plan.kv_bytes_per_token == 23_040  # bf16: half the bytes
    assert plan.trajectories_at_once() == 128 and plan.kv_tokens >= plan.demand.tokens
    assert "queues" not in plan.describe()


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_real_prompt_lengths_not_the_maximum_size_the_cache(model_path, monkeypatch):
    short = _plan(_recipe(model_path, monkeypatch, native_bf16=True), longest=100)
    long = _plan(_recipe(model_path, monkeypatch, native_bf16=True), longest=600)
    assert short.demand.tokens_each == 100 + 3 * 128 + 2 * 256
    # never past the input limit + one generation
    assert long.demand.tokens_each == min(600 + 896, 1536 + 128)
    assert short.kv_tokens < long.kv_tokens


def test_a_node_too_small_for_one_request_is_refused_naming_max_model_len(model_path, monkeypatch):
    cfg = _recipe(model_path, monkeypatch, native_bf16=False)
    tiny_node = MemoryView("the engine's NUMA node 0", int(3.0 * GIB), int(2.6 * GIB))
    with pytest.raises(ResourcePlanError) as refused:
        _plan(cfg, node=tiny_node)
    message = str(refused.value)
    assert "engine.max_model_len=2048" in message and "set engine.max_model_len=" in message
    assert "NUMA node 0: 2.6 of 3.0 GiB" in message


def test_an_explicit_cache_that_does_not_fit_is_refused_with_the_size_that_would(model_path, monkeypatch):
    cfg = _recipe(model_path, monkeypatch, native_bf16=False)
    cfg.engine.cpu_kvcache_gib = 9.19  # the size
    with pytest.raises(ResourcePlanError, match=r"engine.cpu_kvcache_gib=9.19 does not fit.*set "
                                                r"engine.cpu_kvcache_gib=\d+(\.\d+)? or less"):
        _plan(cfg)
    cfg.engine.cpu_kvcache_gib = 2.0  # fits: kept as given
    plan = _plan(cfg)
    assert cfg.engine.cpu_kvcache_gib == 2.0 and plan.kv_tokens == 2 * GIB // 46_080


def test_a_host_too_small_for_the_policy_is_refused_naming_the_knob(model_path, monkeypatch):
    cfg = _recipe(model_path, monkeypatch, native_bf16=False)
    small_host = MemoryView("host", 6 * GIB, 4 * GIB)
    with pytest.raises(ResourcePlanError, match=r"trainer.micro_batch_tokens=1024"):
        _plan(cfg, host=small_host, node=MemoryView("node", 6 * GIB, 4 * GIB))


def test_the_engine_view_reads_a_nodes_meminfo_and_the_cgroup_as_vllm_does(tmp_path):
    node = tmp_path / "node" / "node0"
    node.mkdir(parents=True)
    (node / "meminfo").write_text("Node 0 MemTotal:  9920000 kB\nNode 0 MemFree:  5000000 kB\n"
                                  "Node 0 Active(file):  1000000 kB\nNode 0 Inactive(file):  500000 kB\n"
                                  "Node 0 SReclaimable:  100000 kB\nNode 0 MemUsed:  4920000 kB\n")
    view = engine_node_memory(tmp_path / "node", cgroup=(None, None))
    assert view.total == 9_920_000 * 1024 and view.available == 6_600_000 * 1024
    limited = engine_node_memory(tmp_path / "node", cgroup=(4 * GIB, 1 * GIB))
    assert limited.total == 4 * GIB and limited.available == 3 * GIB and "cgroup" in limited.name


@pytest.mark.integration
def test_our_node_view_is_vllms_on_this_host():
    from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info

    theirs = get_memory_node_info(get_allowed_cpu_list()[0].numa_node)
    ours = engine_node_memory()
    assert ours.total == theirs.total_memory
    assert abs(ours.available - theirs.available_memory) < 256 << 20  # read a moment apart


def test_the_longest_prompt_is_measured_rendered(tokenizer):
    from skyrl_stepwise.data.dataset import PromptRow

    rows = [PromptRow(prompt=[{"role": "user", "content": text}], env_class="search", reward_spec={}, data_source="t")
            for text in ("Hi?", "What is the capital of France, and which river runs through it?", "Why?")]
    rendered = tokenizer.apply_chat_template(rows[1].prompt, tokenize=False, add_generation_prompt=True)
    assert longest_prompt_tokens(tokenizer, rows) == len(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    assert longest_prompt_tokens(tokenizer, rows, candidates=1) == longest_prompt_tokens(tokenizer, rows)


def test_fewer_validation_rows_than_max_eval_prompts_are_what_is_in_flight(model_path, monkeypatch):
    cfg = _recipe(model_path, monkeypatch, native_bf16=True)
    assert _plan(cfg, eval_rows=20).demand.trajectories == 20  # > 4 prompts x 4 samples, < 128


def test_lora_plans_the_frozen_base_and_a_bounded_adapter_not_adamw_on_every_weight(model_path, monkeypatch):
    """With trainer.lora the policy holds fp32 base weights (no gradients, no moments) and a small adapter: the plan
    says so, and a host too small for full fine-tuning's policy fits LoRA's."""
    from transformers import AutoConfig

    from skyrl_stepwise.run.resource_plan import lora_params_bound

    hf_config = AutoConfig.from_pretrained(model_path)
    bound = lora_params_bound(SMOLLM2_PARAMS, hf_config, rank=8)
    assert 2_442_240 <= bound < SMOLLM2_PARAMS // 10  # above the adapter peft builds (2,442,240 parameters)
    full = _recipe(model_path, monkeypatch, native_bf16=False)
    lora = _recipe(model_path, monkeypatch, native_bf16=False)
    lora.trainer.lora.enabled = True
    full_plan, lora_plan = _plan(full), _plan(lora)
    assert 4 * SMOLLM2_PARAMS < lora_plan.policy < full_plan.policy - 10 * SMOLLM2_PARAMS
    # a host that holds LoRA's components but not full fine-tuning's, before any KV cache
    fixed = lambda plan: plan.total - plan.num_engines * plan.kv_bytes  # noqa: E731
    between = (fixed(lora_plan) + fixed(full_plan)) // 2
    host = MemoryView("host", between, between)
    with pytest.raises(ResourcePlanError, match="before any KV cache"):
        _plan(full, host=host, node=BIG_HOST)
    with pytest.raises(ResourcePlanError) as refused:  # LoRA passes that check and only lacks room for a KV cache
        _plan(lora, host=host, node=BIG_HOST)
    assert "before any KV cache" not in str(refused.value)


def test_accumulating_unsharded_plans_each_ranks_whole_gathered_model_and_gradient(model_path, monkeypatch):
    """trainer.fsdp.accumulate_unsharded keeps every layer gathered and its fp32 gradient whole through a step: the
    plan counts both on every rank (4 bytes each a parameter), so a host it does not fit is refused at start-up."""
    held = _recipe(model_path, monkeypatch, native_bf16=True)
    held.trainer.fsdp.accumulate_unsharded = True
    plain = _recipe(model_path, monkeypatch, native_bf16=True)
    plain.trainer.fsdp.accumulate_unsharded = False
    assert _plan(held).policy - _plan(plain).policy == 8 * SMOLLM2_PARAMS
    held.trainer.fsdp.world_size = plain.trainer.fsdp.world_size = 2
    assert _plan(held).policy - _plan(plain).policy == 2 * 8 * SMOLLM2_PARAMS
