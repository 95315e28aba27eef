#!/usr/bin/env bash
# Table 1 (Growth vs Scratch at convergence, paired by seed) on the embedded Fashion-MNIST
# subset: the run behind docs/results.md's Table 1 section. One training at a time on one
# thread (about 30 minutes on a shared core). Seeds run one after another, so an interrupted run
# has every depth for the seeds it finished; rerunning resumes (finished trainings are skipped)
# and the last command only gathers the table (compare.md/.csv/.json) over all seeds.
#   bash experiments/table1_fmnist.sh
#   OUT=runs/x bash experiments/table1_fmnist.sh --compute_matched=true   # overrides are passed on
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-runs/results/table1}
export OMP_NUM_THREADS=1   # torch uses one thread: other jobs share the machine
for seeds in "[0]" "[1]" "[2]" "[0,1,2]"; do
  growtrain compare --config configs/fmnist/table1.yaml --seeds="$seeds" \
    --output_dir="$OUT" --trainer.default_root_dir="$OUT" --trainer.enable_progress_bar=false "$@"
done
