#!/usr/bin/env bash
# The periodic protocol's study on the embedded subset (cheap before expensive): one growth run per
# VARIANT:SEED argument, one at a time, rows in runs/periodic_embedded/VARIANT/runs.jsonl (resumable).
# Variants (K = every_n_epochs, J = window):
#   k2j6 (the default)  k2j2  k2j4  k1j4  k3j9  k4j12  k2j10  k2g3 (min_gain 3 %)
#   k2trial (the block-only trial at a periodic check)  k2paper (the paper's Γ̂ against δ+t)  k2crossfit (its lower bound)
#   experiments/periodic_embedded.sh k2j6:0 k2j6:1 k1j4:0 ...
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export OMP_NUM_THREADS=1
out=${OUT:-runs/periodic_embedded}
cb=--trainer.callbacks.init_args
for job in "$@"; do
  variant=${job%%:*}; seed=${job#*:}
  case $variant in
    k2j6) extra="";;
    k1j4) extra="$cb.every_n_epochs=1 $cb.window=4";;
    k3j9) extra="$cb.every_n_epochs=3 $cb.window=9";;
    k2j10) extra="$cb.window=10";;
    k2j2) extra="$cb.window=2";;
    k2j4) extra="$cb.window=4";;
    k4j12) extra="$cb.every_n_epochs=4 $cb.window=12";;
    k2g3) extra="$cb.min_gain=0.03";;
    k2paper) extra="$cb.decision=rule $cb.rule=paper";;
    k2crossfit) extra="$cb.decision=rule $cb.rule=crossfit";;
    k2trial) extra="$cb.decision=trial $cb.trial_epochs=0.5";;  # trial_lr 0.001, 3 sites: constants since
    *) echo "unknown variant $variant"; exit 2;;
  esac
  mkdir -p $out/$variant
  growtrain stopping --config configs/fmnist/periodic.yaml --skip_scratch=true --seeds="[$seed]" \
    --output_dir=$out/$variant --trainer.default_root_dir=$out/$variant $extra >> $out/$variant/seed$seed.log 2>&1
done
