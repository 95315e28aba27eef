"""Full Fashion-MNIST on a fixed FLOP budget: a ResNet grown on a schedule against 10 blocks from scratch.

The language-model study (docs/results.md) found growth that copies blocks early under
warmup-stable-decay beating scratch for the same FLOPs. This is the same comparison on the image task
of the depth sweep: the sweep's split (seed 0: 57,000 train, 2,000 probe, 1,000 validation; the
official 10,000 test images), ResNet width 8 (basic blocks), SGD 0.05 + momentum 0.9 + weight decay
5e-4, batch 128. Every arm gets the same training FLOPs B (3 × forward FLOPs × images, counted per
architecture by FlopCounterMode as ComputeMeter does): a deeper network takes fewer steps. Arms:

  scratch-10-wsd   10 blocks (the sweep's added = 7: 4-3-3) from the start, warmup-stable-decay
                   (1 % warmup, the last 20 % decays to 0)
  grow-copy-wsd    3 blocks; 2, 2, 2, 1 more at 10 / 20 / 30 / 40 % of the steps, block k on top of
                   stage k mod 3 (→ 4-3-3), each a copy of the block below it (G_stack); the same WSD
  grow-zero-wsd    the same with the paper's zero terminal map (function-preserving)
  scratch-N-wsd    the scratch frontier: N blocks (N >= 3, spread as the sweep spreads them) from the start
  growto-N         the growth frontier: 3 blocks → N, one copied block at a time on top of stage k mod 3,
                   evenly spaced so the last lands at 40 % of the steps; the same WSD
  budget[-S][-fF][-cC][-pP]  the budget schedule from 3 blocks (statistic S, fork F ‰, C checks over P %; else its
                   defaults); it drives WSD itself
                   (its floor is 10 % of the peak rate, not 0)

The default budget is the FLOPs of the sweep's plateau-stopped 10-block network of seed 0 (50,471
GFLOP, test loss 0.1972). Each arm resumes from its last epoch checkpoint and writes OUT/row.json.

    OMP_NUM_THREADS=1 python experiments/fmnist_budget.py grow-copy-wsd --out runs/fb/grow-copy-wsd
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from pathlib import Path

import torch

ROOT = os.environ.get("FMNIST", "/usr/share/datasets/fashion-mnist")
WIDTH, BATCH, LR = 8, 128, 0.05
GROW_AT, GROW_BLOCKS = [0.1, 0.2, 0.3, 0.4], [2, 2, 2, 1]


def arm_spec(arm: str) -> dict:
    if arm == "scratch-10-wsd":
        return {"added": 7, "at": [], "depths": [10]}
    if arm.startswith("scratch-") and arm.endswith("-wsd"):  # the scratch frontier: N blocks from the start
        n = int(arm.split("-")[1])
        if n < 3:
            raise SystemExit(f"arm: scratch-N-wsd needs N >= 3 (one block per stage), got {arm!r}")
        return {"added": n - 3, "at": [], "depths": [n]}
    if arm in ("grow-copy-wsd", "grow-zero-wsd"):
        return {"added": 0, "at": GROW_AT, "blocks": GROW_BLOCKS, "depths": [3, 5, 7, 9, 10],
                "insertion": arm.split("-")[1]}  # fmt: skip
    if arm.startswith("growto-"):  # the growth frontier: 3 blocks → N, one copied block at a time on stage k mod 3,
        # evenly spaced so the last lands at 40 % of the steps (as the language model's growto-N)
        n = int(arm.split("-")[1])
        if n <= 3:
            raise SystemExit(f"arm: growto-N needs N > 3 (the start depth), got {arm!r}")
        at = [round(0.4 * i / (n - 3), 6) for i in range(1, n - 2)]
        return {"added": 0, "at": at, "blocks": [1] * len(at), "depths": list(range(3, n + 1)), "insertion": "copy"}
    if arm.startswith("budget"):  # the budget schedule from 3 blocks: budget[-STATISTIC][-fFORK‰][-cCHECKS][-pPHASE%]
        opts: dict = {}
        for part in arm.split("-")[1:]:
            if part in ("fork", "carried", "steps"):
                opts["statistic"] = part
            elif part[0] in "fcp" and part[1:].isdigit():
                key, scale = {"f": ("fork", 1000), "c": ("checks", None), "p": ("growth_phase", 100)}[part[0]]
                opts[key] = int(part[1:]) if scale is None else int(part[1:]) / scale
            else:
                raise SystemExit(f"arm: unknown budget option {part!r} in {arm!r}")
        return {"added": 0, "at": [], "depths": [3], "budget": opts}
    raise SystemExit(f"arm: unknown {arm!r}")


def image_flops(depth: int) -> float:
    """Training FLOPs of one image at this depth (3 × forward), blocks spread as the sweep spreads them."""
    from growtrain.callbacks.compute import forward_flops
    from growtrain.module import ImageClassifier

    net = ImageClassifier(width=WIDTH, blocks=[1, 1, 1], added=depth - 3, family="basic", in_channels=1).network
    return 3.0 * forward_flops(net, torch.zeros(1, 1, 28, 28))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("arm")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-gflop", type=float, default=50471.0)
    args = ap.parse_args()
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from growtrain import Budget, BudgetFork, GrowUntilSaturated, Plan
    from growtrain.callbacks import ComputeMeter
    from growtrain.data import ImageDataModule
    from growtrain.module import ImageClassifier
    from growtrain.optim import WarmupStableDecay

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spec = arm_spec(args.arm)
    dm = ImageDataModule(dataset="fashion-mnist", root=ROOT, batch_size=BATCH, probe_size=2000, val_size=1000, seed=0,
                         augment=False)  # fmt: skip
    dm.setup("fit")
    images = len(dm.train_dataloader().dataset)
    per_epoch = -(-images // BATCH)
    # optimizer steps S: Σ over phases (fraction of S) × BATCH images × FLOPs per image = budget
    edges = [0.0, *spec["at"], 1.0]
    per_step = sum((b - a) * BATCH * image_flops(d) for a, b, d in zip(edges, edges[1:], spec["depths"]))
    steps = int(args.budget_gflop * 1e9 / per_step)
    sched = None if "budget" in spec else functools.partial(WarmupStableDecay, warmup_steps=max(1, steps // 100), total_steps=steps,
                              decay_steps=steps // 5, min_lr_ratio=0.0)  # fmt: skip
    L.seed_everything(args.seed, workers=True)
    model = ImageClassifier(width=WIDTH, blocks=[1, 1, 1], added=spec["added"], family="basic", in_channels=1,
                            optimizer=functools.partial(torch.optim.SGD, lr=LR, momentum=0.9, weight_decay=5e-4),
                            lr_scheduler=sched, scheduler_interval="step")  # fmt: skip
    meter = ComputeMeter()
    callbacks = [meter, ModelCheckpoint(dirpath=out / "ckpt", save_last=True)]
    grow = None
    if spec["at"]:
        grow = GrowUntilSaturated(schedule=Plan(at=spec["at"], blocks=spec["blocks"], site="cyclic"),
                                  insertion=spec["insertion"], seed=args.seed)  # fmt: skip
        callbacks.append(grow)
    elif "budget" in spec:
        import dataclasses

        opts = {"insertion": "copy", **spec["budget"]}  # the insertion these rows were measured with
        part = lambda cls: {f.name: opts.pop(f.name) for f in dataclasses.fields(cls) if f.name in opts}  # noqa: E731
        grow = GrowUntilSaturated(schedule=Budget(**part(Budget)), decision=BudgetFork(**part(BudgetFork)),
                                  seed=args.seed, **opts)  # fmt: skip
        callbacks.append(grow)
    trainer = L.Trainer(max_steps=steps, max_epochs=-1, callbacks=callbacks, accelerator="cpu", devices=1,
                        logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0)  # fmt: skip
    last = out / "ckpt" / "last.ckpt"
    t0 = time.perf_counter()
    trainer.fit(model, dm, ckpt_path=str(last) if last.exists() else None)
    wall = time.perf_counter() - t0
    final = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False)
    test = final.test(model, dm, verbose=False)[0]
    row = {"arm": args.arm, "seed": args.seed, "budget_gflop": args.budget_gflop, "steps": steps,
           "epochs": steps / per_epoch, "spec": spec, "depth": model.network.depth(),
           "blocks": [len(model.network.stage(s)) for s in model.network.growable_stages],
           "gflop": meter.flops / 1e9, "test_loss": test["test_loss"], "test_acc": test.get("test_acc"),
           "growth": grow.history if grow is not None else None,
           "budget": ({"spent": grow.run.spent, "decision_flops": grow.run.decision_flops, "plan": grow.run.plan.as_dict(),
                      "finished": grow.finished} if "budget" in spec else None), "wall_s_this_process": wall,
           "threads": torch.get_num_threads()}  # fmt: skip
    (out / "row.json").write_text(json.dumps(row, indent=1, default=str))
    print(json.dumps({k: row[k] for k in ("arm", "seed", "steps", "epochs", "depth", "blocks", "gflop", "test_loss")}))


if __name__ == "__main__":
    main()
