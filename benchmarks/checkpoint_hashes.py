"""What the checkpoint manifest's content hashes cost per save and per resume, on a SmolLM2-135M-sized checkpoint.

A randomly initialised model of SmolLM2-135M's config (fp32) with AdamW moments after one step: ~0.5 GB of weights
and ~1.1 GB of optimizer state, saved through checkpoint/store.save_checkpoint (one rank). Reported: the save
and the driver's verify_checkpoint, each in total and the part spent hashing (sha256 over every file, from the page
cache, as right after a save; a resume from a cold disk also pays the read, which the load itself pays anyway).

    python benchmarks/checkpoint_hashes.py [--dir /tmp/ckpt_bench] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path
from unittest import mock

import torch


def main() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from skyrl_stepwise.models import resolve_model_path
    from skyrl_stepwise.checkpoint import store as checkpoint
    from skyrl_stepwise.checkpoint.verify import verify_checkpoint

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/tmp/ckpt_hash_bench")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(resolve_model_path("smollm2")),
                                             dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    x = torch.randint(0, 1000, (1, 8))
    model(x, labels=x).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    hashing = []
    real_digest = checkpoint.file_digest

    def timed_digest(path):
        start = time.perf_counter()
        try:
            return real_digest(path)
        finally:
            hashing[-1] += time.perf_counter() - start

    save, save_hash, verify, verify_hash = [], [], [], []
    with mock.patch.object(checkpoint, "file_digest", timed_digest), \
            mock.patch("skyrl_stepwise.checkpoint.verify.file_digest", timed_digest):
        for step in range(1, args.reps + 1):
            hashing.append(0.0)
            start = time.perf_counter()
            path = checkpoint.save_checkpoint(root, step, model, optimizer, max_to_keep=-1)
            save.append(time.perf_counter() - start)
            save_hash.append(hashing[-1])
            hashing.append(0.0)
            start = time.perf_counter()
            verify_checkpoint(path)
            verify.append(time.perf_counter() - start)
            verify_hash.append(hashing[-1])
            size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            shutil.rmtree(path)
    med = statistics.median
    mb = size / 1e6
    print(json.dumps({"checkpoint_mb": round(mb), "params": sum(p.numel() for p in model.parameters()),
                      "save_s": round(med(save), 2), "save_hash_s": round(med(save_hash), 2),
                      "verify_s": round(med(verify), 2), "verify_hash_s": round(med(verify_hash), 2),
                      "hash_mb_per_s": round(mb / med(verify_hash)), "reps": args.reps}, indent=1))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
