"""What GrowUntilSaturated costs inside a fit.

    python bench/callback.py                         # both parts, ~8 min on 2 shared CPU cores
    python bench/callback.py --part overhead --repeats 3
    python bench/callback.py --part share --epochs 2

Part ``overhead`` — steps where no check happens. The same config is fitted with and without
the callback (``Periodic(every_n_epochs=...)`` larger than the run, so it never probes), arms interleaved;
per-step times come from a timer callback (batch start → batch end) and the callback's own
hook time is measured directly (its hooks wrapped in ``perf_counter``). The callback has no
per-batch hooks, so its cost per step is its epoch-end bookkeeping divided by the steps of the
epoch; the A/B median is reported for context (on a shared machine its noise is larger than
the effect).

Part ``share`` — the quickstart: ``ImageClassifier(in_channels=1)`` + ``ImageDataModule()``
(the embedded fashion-mnist-mini: 5,000 train / 2,000 probe / 1,000 val images, width 16,
batch 128) with ``GrowUntilSaturated(schedule="periodic", decision="trial")`` (a check after every epoch,
the default decision). Reports
the fit's wall time, the time inside ``measure_saturation`` and their ratio, the per-sample
cost of a probe sample relative to a training sample (``PROBE_COST``), and from those the
projected probe share on the full Fashion-MNIST (57,000 train images, the same probe).

Figures are medians in one process; ratios, not absolute times, transfer between machines.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402

from growtrain.callbacks import GrowUntilSaturated, Periodic
from growtrain.data import ImageDataModule  # noqa: E402
from growtrain.module import ImageClassifier  # noqa: E402

# The cost of one probe sample in training-sample equivalents assumed by the projections below
# (conservative: this benchmark measured 1.8-2.6 with calibration on; docs/design.md 1.6-2.3 without).
PROBE_COST = 3.0


class StepTimer(L.Callback):
    """Wall time of every training step (batch start → batch end) and of every epoch."""

    def __init__(self):
        self.steps: list[float] = []
        self.epochs: list[float] = []
        self.train_epoch: list[float] = []  # training steps only, per epoch

    def on_train_epoch_start(self, trainer, pl_module):
        self._epoch = time.perf_counter()
        self._in_epoch = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._t = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        dt = time.perf_counter() - self._t
        self.steps.append(dt)
        self._in_epoch += dt

    def on_train_epoch_end(self, trainer, pl_module):
        self.epochs.append(time.perf_counter() - self._epoch)
        self.train_epoch.append(self._in_epoch)


class TimedGrow(GrowUntilSaturated):
    """GrowUntilSaturated with its hooks timed (seconds, excluding measure_saturation)."""

    hook_seconds = 0.0

    def _timed(self, name, *args, **kwargs):
        start = time.perf_counter()
        probe_before = self.probe_seconds
        getattr(super(), name)(*args, **kwargs)
        self.hook_seconds += time.perf_counter() - start - (self.probe_seconds - probe_before)

    def on_train_epoch_start(self, *args):
        self._timed("on_train_epoch_start", *args)

    def on_train_epoch_end(self, *args):
        self._timed("on_train_epoch_end", *args)

    def on_train_start(self, *args):
        self._timed("on_train_start", *args)

    def setup(self, *args, **kwargs):
        self._timed("setup", *args, **kwargs)


def trainer(callbacks, **kw) -> L.Trainer:
    args = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                callbacks=callbacks, num_sanity_val_steps=0)  # fmt: skip
    return L.Trainer(**(args | kw))


def overhead(args) -> dict:
    arms = {"without": [], "with": []}
    fits = {"without": [], "with": []}
    hook = []
    for r in range(args.repeats):
        for arm in ("without", "with"):
            L.seed_everything(r, verbose=False)
            timer = StepTimer()
            cbs = [timer]
            if arm == "with":
                # never due: no probe
                grow = TimedGrow(schedule=Periodic(every_n_epochs=10**6), decision="trial", verbose=False)
                cbs.append(grow)
            t = trainer(cbs, max_epochs=args.overhead_epochs, limit_train_batches=args.steps, limit_val_batches=0)
            start = time.perf_counter()
            t.fit(ImageClassifier(in_channels=1), ImageDataModule())
            fits[arm].append(time.perf_counter() - start)
            arms[arm] += timer.steps[1:]  # the very first step warms up
            if arm == "with":
                assert not grow.history, "the callback probed in the overhead arm"
                hook.append(grow.hook_seconds / len(timer.steps))
    out = {
        "steps_per_arm": len(arms["with"]),
        "median_step_s": {arm: statistics.median(v) for arm, v in arms.items()},
        "median_fit_s": {arm: statistics.median(v) for arm, v in fits.items()},
        "hook_s_per_step": statistics.median(hook),
    }
    out["ab_ratio"] = out["median_step_s"]["with"] / out["median_step_s"]["without"]
    out["hook_fraction_of_step"] = out["hook_s_per_step"] / out["median_step_s"]["with"]
    return out


def share(args) -> dict:
    L.seed_everything(0, verbose=False)
    timer = StepTimer()
    grow = GrowUntilSaturated(schedule="periodic", decision="trial", verbose=False)  # a check after every epoch
    dm = ImageDataModule()
    t = trainer([timer, grow], max_epochs=args.epochs)
    start = time.perf_counter()
    t.fit(ImageClassifier(in_channels=1), dm)
    fit = time.perf_counter() - start
    checks = len(grow.history)
    n_train = len(dm.train_indices) // dm.batch_size * dm.batch_size  # drop_last
    n_probe = len(dm.probe_indices)
    train_per_sample = statistics.median(timer.train_epoch) / n_train
    probe_per_sample = grow.probe_seconds / max(checks, 1) / n_probe
    cost = probe_per_sample / train_per_sample
    epoch_s = statistics.median(timer.epochs)
    probe_s = grow.probe_seconds / max(checks, 1)

    def projected(train_images: int, every: int) -> float:
        # one check per `every` epochs; an epoch scales with the training images
        epoch = epoch_s - statistics.median(timer.train_epoch) + train_per_sample * train_images
        return probe_s / (every * epoch + probe_s)

    return {
        "epochs": args.epochs,
        "checks": checks,
        "actions": [h["action"] for h in grow.history],
        "fit_s": fit,
        "probe_s": grow.probe_seconds,
        "probe_share": grow.probe_seconds / fit,
        "median_epoch_s": epoch_s,
        "probe_s_per_check": probe_s,
        "probe_cost_per_sample_vs_train": cost,
        "assumed_PROBE_COST": PROBE_COST,
        "projected_share_full_fmnist_every_1": projected(57_000, 1),
        "projected_share_full_fmnist_every_2": projected(57_000, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("overhead", "share", "all"), default="all")
    parser.add_argument("--repeats", type=int, default=2, help="overhead: fits per arm (interleaved)")
    parser.add_argument("--steps", type=int, default=8, help="overhead: training steps per epoch")
    parser.add_argument("--overhead-epochs", type=int, default=2, help="overhead: epochs per fit")
    parser.add_argument("--epochs", type=int, default=2, help="share: quickstart epochs")
    parser.add_argument("--json", type=str, default=None, help="also write the figures here")
    args = parser.parse_args()
    result = {"torch_threads": torch.get_num_threads()}
    if args.part in ("overhead", "all"):
        result["overhead"] = overhead(args)
        print(json.dumps({"overhead": result["overhead"]}, indent=1), flush=True)
    if args.part in ("share", "all"):
        result["share"] = share(args)
        print(json.dumps({"share": result["share"]}, indent=1), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
