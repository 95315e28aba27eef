#!/usr/bin/env bash
# Periodic-protocol growth runs on the full Fashion-MNIST, one per argument (SEED or SEED:SPLIT),
# one at a time, appending to runs/periodic_full/*.log; rows resume from runs.jsonl and their epoch
# checkpoints. Extra growtrain overrides come from $EXTRA; the output folder from $OUT.
#   experiments/periodic_full.sh 0 1 2          # seeds 0-2 on split 0
#   experiments/periodic_full.sh 0:1 1:1        # a second split (data seed 1) for two seeds
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export OMP_NUM_THREADS=1
out=${OUT:-runs/periodic_full}
mkdir -p "$out"
for job in "$@"; do
  seed=${job%%:*}; split=0
  [[ $job == *:* ]] && split=${job#*:}
  growtrain stopping --config configs/fmnist/periodic.yaml --skip_scratch=true \
    --data.init_args.dataset=fashion-mnist --data.init_args.root=/usr/share/datasets/fashion-mnist \
    --data.init_args.seed=$split --seeds="[$seed]" --output_dir=$out/split$split \
    --trainer.default_root_dir=$out/split$split $EXTRA >> $out/growth_split${split}_seed${seed}.log 2>&1
done
