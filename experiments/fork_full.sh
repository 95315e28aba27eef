#!/usr/bin/env bash
# Stage-fork growth runs on the full Fashion-MNIST (configs/fmnist/periodic.yaml: decision="stage_fork",
# K = 8), one per call: experiments/fork_full.sh OUT SEED[:SPLIT] [growtrain overrides...]
# Rows resume from OUT/split<S>/runs.jsonl and their epoch checkpoints; the log is OUT/growth_split<S>_seed<N>.log.
#   experiments/fork_full.sh runs/stage_k8 0
#   experiments/fork_full.sh runs/stage_k4 0 --trainer.callbacks.init_args.schedule.every_n_epochs=4
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export OMP_NUM_THREADS=${THREADS:-1}   # THREADS=2: the same run on two threads
out=$1; job=$2; shift 2
seed=${job%%:*}; split=0
[[ $job == *:* ]] && split=${job#*:}
mkdir -p "$out"
growtrain stopping --config configs/fmnist/periodic.yaml --skip_scratch=true \
  --data.init_args.dataset=fashion-mnist --data.init_args.root=/usr/share/datasets/fashion-mnist \
  --data.init_args.seed=$split --seeds="[$seed]" --output_dir=$out/split$split \
  --trainer.default_root_dir=$out/split$split "$@" \
  >> $out/growth_split${split}_seed${seed}.log 2>&1
