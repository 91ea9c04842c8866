"""What one LoRA sync moves (trainer.lora.sync=adapter vs merged), on SmolLM2-135M, rank 8 on every linear module,
fp32: the peft adapter folder written to /dev/shm and read back, against the merged full-model file the merged sync
writes; and, for the transformers engine, peft's load_adapter from the folder against copying tensors in memory
(set_peft_model_state_dict into an adapter already loaded). vLLM 0.32 has no in-memory path (LoRARequest takes a
path), so only the file is measured there.

    python benchmarks/lora_adapter_sync.py
"""

from __future__ import annotations

import os
import shutil
import statistics
import time

import torch


def median_s(fn, repeats: int = 5) -> float:
    """Median wall seconds of `fn` over `repeats` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from skyrl_stepwise.models.prepare import prepare_model
    from skyrl_stepwise.policy.config import LoRAConfig
    from skyrl_stepwise.policy.lora import adapted_layers, adapter_state, apply_lora, merged_items, save_adapter

    torch.set_num_threads(2)
    path = prepare_model()
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    apply_lora(policy, LoRAConfig(enabled=True, rank=8, alpha=16))
    with torch.no_grad():  # a trained adapter (B != 0)
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.01)
    folder, merged = "/dev/shm/skyrl_bench_adapter", "/dev/shm/skyrl_bench_merged.safetensors"
    try:
        write = median_s(lambda: save_adapter(policy, folder, adapter_state(policy)))
        size = os.path.getsize(f"{folder}/adapter_model.safetensors")
        read = median_s(lambda: load_file(f"{folder}/adapter_model.safetensors"))
        state, layers = dict(policy.state_dict()), adapted_layers(policy)
        merged_s = median_s(lambda: save_file({k: v.contiguous().clone() for k, v in merged_items(state, layers)},
                                              merged), 3)
        print(f"adapter folder: {size / 2**20:.2f} MiB, write {write * 1e3:.0f} ms, read {read * 1e3:.0f} ms; "
              f"merged full model: {os.path.getsize(merged) / 2**20:.0f} MiB, merge + write {merged_s * 1e3:.0f} ms")
        engine = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        count = [0]

        def from_folder():
            count[0] += 1
            engine.load_adapter(folder, adapter_name=f"v{count[0]}")
            engine.delete_adapter(f"v{count[0]}")

        from_file = median_s(from_folder)
        engine.load_adapter(folder, adapter_name="resident")
        tensors = {k.removeprefix("base_model.model."): v.clone() for k, v in adapter_state(policy).items()}
        in_memory = median_s(lambda: set_peft_model_state_dict(engine, tensors, adapter_name="resident"))
        print(f"transformers engine: load_adapter from the folder {from_file * 1e3:.0f} ms; in-memory copy into a "
              f"loaded adapter {in_memory * 1e3:.0f} ms")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        if os.path.exists(merged):
            os.remove(merged)


if __name__ == "__main__":
    main()
