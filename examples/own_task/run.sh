#!/usr/bin/env bash
# README "Your own task", step 5, as written: data, then training with the env and the tool of this folder, then
# the decoded rollouts of the last step. Run from the repository root; extra arguments go to `train`
# (e.g. sft.data=outputs/own_task_data/sft.parquet for the warm start, total_steps=1 for a quick look).
set -euo pipefail
python examples/own_task/make_data.py outputs/own_task_data
PYTHONPATH=examples/own_task${PYTHONPATH:+:$PYTHONPATH} skyrl-stepwise train experiment=tool_task_tiny \
    data.train_path=outputs/own_task_data/train.parquet data.val_path=outputs/own_task_data/val.parquet \
    environment.tool.tools_path=examples/own_task/tools.yaml +environment.env_classes.guess=guess:GuessEnv \
    logging.output_dir=runs/own "$@"
skyrl-stepwise show runs/own
