#!/usr/bin/env bash
# One `growtrain stopping` call on the full Fashion-MNIST for one seed, appending to a log:
#   experiments/full_stopping.sh LOG SEED [growtrain overrides...]     (OUT: output dir, runs/stopping_full)
# Used by full_growth.sh and full_table.sh; rows resume from runs.jsonl and their epoch checkpoints.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export OMP_NUM_THREADS=1
log=$1; seed=$2; shift 2
out=${OUT:-runs/stopping_full}
growtrain stopping --config configs/fmnist/stopping.yaml \
  --data.init_args.dataset=fashion-mnist --data.init_args.root=/usr/share/datasets/fashion-mnist \
  --seeds="[$seed]" --output_dir=$out --trainer.default_root_dir=$out "$@" >> $out/${log}_seed${seed}.log 2>&1
