#!/usr/bin/env bash
# scratch sweep rows, one at a time, resumable
cd /work/main; . /work/venv/bin/activate
export OMP_NUM_THREADS=1
for job in "$@"; do
  seed=${job%:*}; d=${job#*:}
  growtrain stopping --config configs/fmnist/stopping.yaml \
    --data.init_args.dataset=fashion-mnist --data.init_args.root=/usr/share/datasets/fashion-mnist \
    --skip_growth=true --seeds="[$seed]" --depths=$d..$d --output_dir=runs/stopping_full \
    --trainer.default_root_dir=runs/stopping_full >> runs/stopping_full/scratch_seed${seed}.log 2>&1
done
