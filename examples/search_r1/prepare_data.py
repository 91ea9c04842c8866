"""Convert Search-R1 parquet files you already have into skyrl_stepwise's dataset format.

    python examples/search_r1/prepare_data.py --train nq_hotpotqa/train.parquet \
        --validation nq_hotpotqa/test.parquet --out-dir ~/data/searchR1

Input rows need `data_source`, `prompt`, `reward_model.ground_truth.target` and `extra_info`
(the layout of Search-R1's `qa_search_*_merge.py` and the `PeterJinGo/nq_hotpotqa_train` files).
Each row gets SkyRL's prompt (system "You are a helpful and harmless assistant." + the Search-R1
instruction + the question), `env_class="search"`, `reward_spec` and an `instance_id`; every other
column is kept. The logic lives in `skyrl_stepwise.data.dataset` (tested); this is only the CLI.
No corpus/index is needed for this step; for an offline demo use `skyrl-stepwise data prepare` instead.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from skyrl_stepwise.data.dataset import convert_search_r1_file


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train", type=Path, help="Search-R1 train parquet -> OUT_DIR/train.parquet")
    p.add_argument("--validation", type=Path, help="Search-R1 test parquet -> OUT_DIR/validation.parquet")
    p.add_argument("--out-dir", type=Path, required=True)
    args = p.parse_args(argv)
    if args.train is None and args.validation is None:
        p.error("give --train and/or --validation")
    for src, name in ((args.train, "train"), (args.validation, "validation")):
        if src is not None:
            dst = args.out_dir.expanduser() / f"{name}.parquet"
            n = convert_search_r1_file(src.expanduser(), dst)
            print(f"{src} -> {dst} ({n} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
