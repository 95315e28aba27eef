"""Training throughput: Lightning (`ImageClassifier` + `Trainer.fit`) vs a hand-written loop.

    python bench/train.py                       # ResNet-8 w=16, 32x32 RGB, batch 128
    python bench/train.py --repeats 5 --batches 40 --threads 2

Both arms train the same network (same initial weights) on the same in-memory synthetic
CIFAR-shaped data (3x32x32, 10 classes), batch 128, SGD(0.1, momentum 0.9, wd 5e-4) over the
same param groups, and the same batched augmentation (`normalize_batch` + `augment_batch`,
which the datamodule applies in `on_after_batch_transfer`). The Lightning arm also updates its
loss/accuracy metrics and logs them: that is part of the overhead being measured.

Timing excludes start-up: each arm is timed from the start of batch `--warmup` to the end of
the last batch. Arms alternate within each repeat so load from other processes hits both;
reported figures are medians over repeats, the ratio is the median of the per-repeat (paired)
ratios. Both wall-clock and process-CPU-time rates are reported: on a shared machine the CPU
time is the steadier measure of what each arm costs (with one thread it is the compute).
The loader-alone row times iterating the train loader plus the augmentation with no model.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import lightning as L
import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from growtrain.data import ImageDataModule, augment_batch, normalize_batch  # noqa: E402
from growtrain.models import cifar_resnet  # noqa: E402
from growtrain.module import ImageClassifier  # noqa: E402
from growtrain.optim import param_groups  # noqa: E402


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=5e-4)


def clocks() -> tuple[float, float]:
    # Wall time, and this process's CPU time: on a shared machine the CPU time is what the work
    # itself cost, while the wall time also counts waiting for the other processes.
    return time.perf_counter(), time.process_time()


def rates(start, end, images) -> tuple[float, float]:
    """Images per wall-clock second and per CPU second."""
    return images / (end[0] - start[0]), images / (end[1] - start[1])


class BatchTimer(L.Callback):
    """Clocks at the start of batch `warmup` and at the end of the last batch."""

    def __init__(self, warmup: int):
        self.warmup, self.start, self.end = warmup, None, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.warmup:
            self.start = clocks()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.end = clocks()


def lightning_arm(net, data, args) -> tuple[float, float]:
    timer = BatchTimer(args.warmup)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=args.warmup + args.batches,
        limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[timer],
    )  # fmt: skip
    trainer.fit(ImageClassifier(net, num_classes=10, optimizer=sgd), data)
    return rates(timer.start, timer.end, args.batches * args.batch)


def plain_arm(net, data, args) -> tuple[float, float]:
    net.train()
    optimizer = sgd(param_groups(net))
    start = None
    for i, (x, y) in enumerate(data.train_dataloader()):
        if i == args.warmup:
            start = clocks()
        if i == args.warmup + args.batches:
            break
        x = augment_batch(normalize_batch(x, data.mean, data.std))
        loss = F.cross_entropy(net(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return rates(start, clocks(), args.batches * args.batch)


def loader_alone(data, args) -> float:
    """Seconds per batch to produce an augmented training batch, no model."""
    start = None
    for i, (x, y) in enumerate(data.train_dataloader()):
        if i == args.warmup:
            start = time.perf_counter()
        if i == args.warmup + args.batches:
            break
        augment_batch(normalize_batch(x, data.mean, data.std))
    return (time.perf_counter() - start) / args.batches


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", type=int, default=20, help="timed batches per arm")
    parser.add_argument("--warmup", type=int, default=3, help="untimed batches first")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    L.seed_everything(0, verbose=False)

    n = (args.warmup + args.batches + 1) * args.batch
    data = ImageDataModule(dataset="synthetic", synthetic_size=n + 200, image_size=32, channels=3,
                           probe_size=100, val_size=100, batch_size=args.batch)  # fmt: skip
    data.setup("fit")
    torch.manual_seed(0)
    net0 = cifar_resnet(width=args.width, family="basic")

    runs = {"lightning": [], "plain": [], "loader_s": []}
    for _ in range(args.repeats):
        runs["lightning"].append(lightning_arm(copy.deepcopy(net0), data, args))
        runs["plain"].append(plain_arm(copy.deepcopy(net0), data, args))
        runs["loader_s"].append(loader_alone(data, args))
    result = {"threads": args.threads, "batch": args.batch, "width": args.width, "repeats": args.repeats,
              "timed_batches": args.batches}  # fmt: skip
    print(f"torch {torch.__version__}, lightning {L.__version__}, {args.threads} thread(s), batch {args.batch}, "
          f"cifar_resnet (1,1,1) w={args.width}, {args.repeats} repeats x {args.batches} timed batches")  # fmt: skip
    for i, clock in enumerate(("wall", "cpu")):
        light = [r[i] for r in runs["lightning"]]
        plain = [r[i] for r in runs["plain"]]
        ratio = statistics.median(a / b for a, b in zip(light, plain))
        result[clock] = {
            "lightning_img_s": round(statistics.median(light), 1),
            "plain_img_s": round(statistics.median(plain), 1),
            "ratio_paired_median": round(ratio, 3),
            "lightning_all": [round(x, 1) for x in light],
            "plain_all": [round(x, 1) for x in plain],
        }
        print(f"  per {clock:4s} second: Lightning {result[clock]['lightning_img_s']:7.1f} img/s, plain "
              f"{result[clock]['plain_img_s']:7.1f} img/s, ratio {ratio:.3f} (median of paired repeats)")  # fmt: skip
    loader_s = statistics.median(runs["loader_s"])
    step_s = args.batch / result["wall"]["plain_img_s"]
    result["loader_ms_per_batch"] = round(1000 * loader_s, 2)
    result["plain_step_ms"] = round(1000 * step_s, 1)
    print(f"  loader + augment alone: {1000 * loader_s:.2f} ms/batch = {100 * loader_s / step_s:.1f}% "
          f"of a plain training step ({1000 * step_s:.0f} ms, wall)")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
