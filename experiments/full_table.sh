#!/usr/bin/env bash
# Table 1 on the full Fashion-MNIST, built on the stopping sweep's own networks.
#   experiments/full_table.sh SEED [extra overrides, e.g. --compute_matched=false]
# Needs the sweep's scratch rows added=0..4 of SEED in runs/stopping_full/runs.jsonl, each with its
# final checkpoint (new rows: final.ckpt; older rows: the newest checkpoints/*.ckpt; seed 0's rows
# were trained earlier (2026-12-02), their networks are ../shared/data/fmnist-full-scratch/:
#   for v in 0 1 2 3 4; do mkdir -p runs/stopping_full/scratch_added${v}_seed0/checkpoints &&
#     cp ../shared/data/fmnist-full-scratch/seed0_blocks$((3+v)).ckpt runs/stopping_full/scratch_added${v}_seed0/checkpoints/; done
# Every checkpoint is loaded and must reproduce its row's test loss, else the row is refused.)
# Resumable: finished arms are rows of runs.jsonl; a cut training resumes from its epoch checkpoint.
exec "$(dirname "${BASH_SOURCE[0]}")/full_stopping.sh" table "$1" --skip_growth=true --depths=0..4 --table=1..4 "${@:2}"
