#!/usr/bin/env bash
# The real-data runs behind docs/results.md: Fashion-MNIST (Debian's IDX files), 10,000 training
# images (train_subset), 2,000 probe images, the official 10,000 test images, width-8 ResNets.
# Budget chosen to finish in about 45 minutes on 2 CPU cores; every command is a plain `growtrain`
# call with overrides, so each can be rerun on its own (they resume finished rows).
#   bash experiments/fmnist_results.sh [table1|sweep|growth|gpt|all]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-runs/results}
COMMON_DATA="--data.init_args.train_subset=10000 --data.init_args.probe_size=2000"
what=${1:-all}

if [[ $what == sweep || $what == all ]]; then
  # Figure 1: depth N = 0..6 added blocks, trained from scratch, 3 seeds; AG_max and Γ̂ per depth.
  for seed in 0 1 2; do
    growtrain sweep --config configs/fmnist/figure1.yaml --depths=0..6 --seed=$seed \
      --model.init_args.width=8 $COMMON_DATA --trainer.max_epochs=6 \
      --model.init_args.lr_scheduler.init_args.milestones=[3,5] \
      --output_dir=$OUT/sweep_seed$seed --trainer.default_root_dir=$OUT/sweep_seed$seed
  done
fi

if [[ $what == table1 || $what == all ]]; then
  # Table 1 at convergence: ResNet-9..12, Growth vs Scratch, 3 paired seeds, on the
  # embedded Fashion-MNIST subset (800 train images); its own script and config.
  OUT=$OUT/table1 bash experiments/table1_fmnist.sh
fi

if [[ $what == growth || $what == all ]]; then
  # grow from ResNet-8 with each rule until it says saturated (checks every 2 epochs).
  # The config's callback block is the same for both rules but for `rule`; it stops at the
  # first "saturated" (on_saturated: stop) and may insert up to 6 blocks.
  for rule in paper crossfit; do
    mkdir -p $OUT/growth_$rule
    sed -e "s/rule: crossfit /rule: $rule /" -e "s/on_saturated: continue /on_saturated: stop     /" \
        -e "s/max_growths: 4 /max_growths: 6 /" configs/fmnist/growth.yaml > $OUT/growth_$rule/config.yaml
    for seed in 0 1 2; do
      growtrain fit --config $OUT/growth_$rule/config.yaml --seed_everything=$seed \
        --model.init_args.width=8 $COMMON_DATA --trainer.max_epochs=14 \
        --model.init_args.lr_scheduler.init_args.T_max=14 \
        --trainer.default_root_dir=$OUT/growth_$rule/seed$seed --trainer.enable_progress_bar=false
    done
  done
fi

if [[ $what == gpt || $what == all ]]; then
  # the decoder's Figure 1 analogue on the stdlib corpus (bytes): n_layer = 1..4 from
  # scratch, 400 optimizer steps each on the first 400k characters; loss, AG_max and Γ̂ per depth.
  growtrain sweep --config configs/gpt.yaml --depths=1..4 --trainer.max_epochs=4 \
    --data.init_args.max_chars=400000 \
    --output_dir=$OUT/gpt_sweep --trainer.default_root_dir=$OUT/gpt_sweep
fi
