#!/usr/bin/env bash
# Growth rows of the full Fashion-MNIST stopping experiment, one run at a time (resumable: a
# finished row is skipped, a cut one resumes from its last epoch checkpoint).
#   experiments/full_growth.sh SEED [extra growtrain overrides...]
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export OMP_NUM_THREADS=1
seed=$1; shift
out=${OUT:-runs/stopping_full}
growtrain stopping --config configs/fmnist/stopping.yaml \
  --data.init_args.dataset=fashion-mnist --data.init_args.root=/usr/share/datasets/fashion-mnist \
  --skip_scratch=true --seeds="[$seed]" --output_dir=$out --trainer.default_root_dir=$out "$@" \
  >> $out/growth_seed${seed}.log 2>&1
