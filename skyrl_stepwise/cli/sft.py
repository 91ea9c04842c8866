"""`skyrl-stepwise sft [hydra overrides]`: supervised warm start of the policy, cached as a model folder.

A Hydra application over conf/ like `train` (`--help`, `--cfg job`); the work is loop/warm_start.py's
`sft_model`, which the main job also calls. Prints the model folder.
"""

from __future__ import annotations

import sys

from skyrl_stepwise.loop.warm_start import (COMPLETE, cache_key, export_hf_config,  # noqa: F401
                                               sft_model)


def run(cfg) -> str:
    """The warm-started model folder for this config (cached, or trained now)."""
    from skyrl_stepwise.inference.vllm_engine import ensure_ray
    from skyrl_stepwise.models import resolve_model_path

    if not cfg.sft.data:
        raise ValueError("sft.data is not set: give a parquet of `messages` (README \"Your own task\") or "
                         "sft.data=embedded for the Search-R1 demonstrations")
    cfg.trainer.model_path = str(resolve_model_path(cfg.model_path))
    ensure_ray()
    out = str(sft_model(cfg))
    print(out, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    """CLI entry: `skyrl-stepwise sft experiment=search_r1_tiny sft.epochs=3`; prints the model folder. Nothing is
    written but the cached model: no run dir, no .hydra record (unless hydra.run.dir / hydra.output_subdir say so)."""
    from skyrl_stepwise.run.app_config import hydra_entry

    args = list(sys.argv[1:] if argv is None else argv)
    extra = []  # before the user's words: argparse takes no override after a flag like `--cfg job`
    if not any(a.startswith(("hydra.run.dir=", "logging.output_dir=")) for a in args):
        extra.append("hydra.run.dir=.")
    if not any(a.startswith("hydra.output_subdir=") for a in args):
        extra.append("hydra.output_subdir=null")
    return hydra_entry(run, extra + args)


if __name__ == "__main__":
    sys.exit(main())
