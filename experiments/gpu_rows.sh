#!/usr/bin/env bash
# The stage-fork grid on one GPU machine (an H200 with 16 cores, lent for minutes): every job is the
# full-data stage-fork run of experiments/fork_full.sh (configs/fmnist/periodic.yaml, decision
# stage_fork), one process each, all at once, on the GPU. Rows land in $WORK/<job>/split<S>/ and a
# tarball of everything but checkpoints is rewritten to $OUT/rows.tar.gz every 20 s, so a run cut
# at its limit still returns the rows that finished.
#   FMNIST=.fmnist WORK=/tmp/rows OUT=out experiments/gpu_rows.sh            # the whole grid
#   JOBS="k8_s0" EPOCHS=2 EXTRA=--data.init_args.train_subset=1000 ACCEL=cpu OUT=out experiments/gpu_rows.sh   # a smoke test
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
WORK=${WORK:-/tmp/rows}; OUT=${OUT:?}; FMNIST=${FMNIST:-/usr/share/datasets/fashion-mnist}
ACCEL=${ACCEL:-gpu}
mkdir -p "$WORK" "$OUT"
# name  seed:split  overrides (K is every_n_epochs; max_epochs 60 unless given)
declare -A GRID=(
  [k8_s0]="0:0 --trainer.callbacks.init_args.schedule.every_n_epochs=8"
  [k8_s1]="1:0 --trainer.callbacks.init_args.schedule.every_n_epochs=8"
  [k8_s2]="2:0 --trainer.callbacks.init_args.schedule.every_n_epochs=8"
  [k4_s0]="0:0 --trainer.callbacks.init_args.schedule.every_n_epochs=4"
  [k4_s1]="1:0 --trainer.callbacks.init_args.schedule.every_n_epochs=4"
  [k16_s0]="0:0 --trainer.callbacks.init_args.schedule.every_n_epochs=16 --trainer.max_epochs=100"
  [k16_s1]="1:0 --trainer.callbacks.init_args.schedule.every_n_epochs=16 --trainer.max_epochs=100"
  [k8_s0_sp1]="0:1 --trainer.callbacks.init_args.schedule.every_n_epochs=8"
  [k8_s1_sp1]="1:1 --trainer.callbacks.init_args.schedule.every_n_epochs=8"
  [k8_s0_25]="0:0 --trainer.callbacks.init_args.schedule.every_n_epochs=8 --data.init_args.train_subset=14250"
  [k8_s0_g05]="0:0 --trainer.callbacks.init_args.schedule.every_n_epochs=8 --trainer.callbacks.init_args.decision.min_gain=0.005"
  [k8_s0_g2]="0:0 --trainer.callbacks.init_args.schedule.every_n_epochs=8 --trainer.callbacks.init_args.decision.min_gain=0.02"
  [k8_s0_p8k]="0:0 --trainer.callbacks.init_args.schedule.every_n_epochs=8 --data.init_args.probe_size=8000"
  [k8_s2_p8k]="2:0 --trainer.callbacks.init_args.schedule.every_n_epochs=8 --data.init_args.probe_size=8000"
)
JOBS=${JOBS:-${!GRID[@]}}
for name in $JOBS; do
  set -- ${GRID[$name]}; job=$1; shift
  seed=${job%%:*}; split=${job#*:}; dir=$WORK/$name
  mkdir -p "$dir"
  ${PYTHON:-python3} -m growtrain.cli stopping --config configs/fmnist/periodic.yaml --skip_scratch=true \
    --data.init_args.dataset=fashion-mnist --data.init_args.root=$FMNIST \
    --data.init_args.seed=$split --seeds="[$seed]" --output_dir=$dir/split$split \
    --trainer.default_root_dir=$dir/split$split --trainer.accelerator=$ACCEL \
    --trainer.callbacks.init_args.decision=growtrain.StageFork "$@" ${EPOCHS:+--trainer.max_epochs=$EPOCHS} $EXTRA \
    > "$dir/log.txt" 2>&1 &
done
pack() { tar -czf "$OUT/rows.tar.gz.tmp" --exclude='*.ckpt' -C "$WORK" . && mv "$OUT/rows.tar.gz.tmp" "$OUT/rows.tar.gz"; }
end=$((SECONDS + ${DEADLINE_S:-100000}))   # the machine's limit: stop packing (and leave) before it
while [ -n "$(jobs -r)" ] && [ $SECONDS -lt $end ]; do sleep 20; pack; done
pack
echo "$(jobs -r | wc -l) jobs still running after ${SECONDS} s; rows in $OUT/rows.tar.gz"
for f in "$WORK"/*/log.txt; do echo "== $f"; grep -E "growth|stopped|budget" "$f" | tail -n 3; done
