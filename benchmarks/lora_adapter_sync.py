"""What one LoRA sync moves (trainer.lora.sync=adapter vs merged), on SmolLM2-135M, rank 8 on every linear module,
fp32: the peft adapter folder written to /dev/shm and read back, against the merged full-model file the merged sync
writes; and, for the transformers engine, peft's load_adapter from the folder against copying tensors in memory
(set_peft_model_state_dict into an adapter already loaded). vLLM 0.32 has no in-memory path (LoRARequest takes a
path), so only the file is measured there.

Then what carrying the adapter as bytes costs (inference/adapter_files.py: an engine on any node loads it): rank 0
reading its folder back into bytes, and a Ray actor (an engine's stand-in, in its own process, as on another node)
receiving the bytes as a method argument and writing them into its own /dev/shm folder, against the same call
carrying only the folder's path (what a same-node engine read before).

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
        ray_bytes_cost(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        if os.path.exists(merged):
            os.remove(merged)


def ray_bytes_cost(folder: str) -> None:
    """The bytes' added cost per sync: rank 0 reads its folder back and returns the bytes to the driver (an actor's
    return value), the driver sends them to an engine actor that writes them into a folder of its own; against
    calls that carry the path alone."""
    import ray

    from skyrl_stepwise.inference.adapter_files import AdapterFiles, AdapterFolders
    from skyrl_stepwise.inference.vllm_engine import ensure_ray

    @ray.remote(num_cpus=0)
    class Engine:
        """Stands in for an engine actor: writes what it receives into its own folders, one per version."""

        def __init__(self) -> None:
            self.folders, self.version = AdapterFolders(), 0

        def load_bytes(self, adapter: AdapterFiles) -> int:
            self.version += 1
            self.folders.write(self.version, adapter)
            self.folders.remove(self.version - 1)
            return adapter.nbytes

        def load_path(self, path: str) -> int:
            return len(path)

        def export(self, path: str) -> AdapterFiles:
            """Policy rank 0's side: the folder it wrote, read back and returned to the driver as bytes."""
            return AdapterFiles.read(path)

        def close(self) -> None:
            self.folders.remove_all()

    ensure_ray()
    engine = Engine.remote()
    ray.get(engine.load_path.remote(folder))  # the actor is up
    read = median_s(lambda: AdapterFiles.read(folder))
    adapter = AdapterFiles.read(folder)
    exported = median_s(lambda: ray.get(engine.export.remote(folder)))
    by_bytes = median_s(lambda: ray.get(engine.load_bytes.remote(adapter)))
    by_path = median_s(lambda: ray.get(engine.load_path.remote(folder)))
    ray.get(engine.close.remote())
    added = exported + by_bytes - 2 * by_path
    print(f"adapter as bytes through Ray: {adapter.nbytes / 2**20:.2f} MiB per hop; read back {read * 1e3:.0f} ms; "
          f"rank 0's actor -> driver {exported * 1e3:.0f} ms, driver -> an engine actor + written in its own folder "
          f"{by_bytes * 1e3:.0f} ms, a call carrying the path only {by_path * 1e3:.0f} ms: {added * 1e3:.0f} ms "
          f"added per sync (one engine)")


if __name__ == "__main__":
    main()
