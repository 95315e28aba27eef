"""Successive halving over depths: what a user would do instead of growth.

Eight ResNets of 3–10 blocks (width 8, the sweep's cyclic assignment of added blocks) train from
scratch under the sweep's optimizer (SGD 0.05, momentum 0.9, weight decay 5e-4, batch 128, a
constant rate) on the full Fashion-MNIST split the growth runs use (57,000 train / 2,000 probe /
1,000 validation images). After rung r (cumulative epochs R0 · 3^r) the third with the lowest
validation loss goes on (reduction factor 3: 8 → 3 → 1); the survivor then gets the sweep's
5-epoch cosine anneal to zero and is scored on the official 10,000 test images. FLOPs count
3 × forward FLOPs per training image (growtrain.callbacks.compute's rule), as the growth rows do.

    OMP_NUM_THREADS=1 python experiments/successive_halving.py --out runs/sh_seed0.json --seed 0 \\
        --root /usr/share/datasets/fashion-mnist

Resumable: each config's state after each rung is saved beside --out, and a finished rung is not
trained again.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from growtrain.callbacks.compute import forward_flops  # noqa: E402
from growtrain.data import ImageDataModule  # noqa: E402
from growtrain.module import ImageClassifier  # noqa: E402


def build(blocks: int, seed: int) -> ImageClassifier:
    with torch.random.fork_rng():  # the same initialisation per depth; the loaders' shuffle stream runs on
        torch.manual_seed(seed)
        return ImageClassifier(arch="cifar_resnet", blocks=[1, 1, 1], added=blocks - 3, width=8, family="basic",
                               in_channels=1, num_classes=10)  # fmt: skip


def batches(loader, data: ImageDataModule):
    """The loader's batches as a training step gets them (the datamodule's uint8 → normalised float)."""
    for batch in loader:
        yield data.on_after_batch_transfer(batch, 0)


def loss_on(model: torch.nn.Module, loader, data: ImageDataModule) -> float:
    model.eval()
    total, n = 0.0, 0
    with torch.no_grad():
        for x, y in batches(loader, data):
            total += float(F.cross_entropy(model(x), y, reduction="sum"))
            n += len(y)
    return total / n


def train(model, optimizer, loader, data: ImageDataModule, epochs: int, lr_at=None) -> None:
    model.train()
    steps = epochs * len(loader)
    for step in range(steps):
        if step % len(loader) == 0:
            epoch = batches(loader, data)
        if lr_at is not None:
            for g in optimizer.param_groups:
                g["lr"] = lr_at(step, steps)
        x, y = next(epoch)
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--split", type=int, default=0)
    p.add_argument("--root", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--depths", type=int, nargs="+", default=list(range(3, 11)))
    p.add_argument("--r0", type=int, default=2, help="epochs of the first rung")
    p.add_argument("--anneal", type=int, default=5)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--train-subset", type=int, default=None, help="a smoke test on fewer images")
    args = p.parse_args()
    out = Path(args.out)
    state_dir = out.with_suffix("")
    state_dir.mkdir(parents=True, exist_ok=True)
    data = ImageDataModule(dataset="fashion-mnist", root=args.root, batch_size=128, probe_size=2000, val_size=1000,
                           seed=args.split, augment=False, train_subset=args.train_subset)  # fmt: skip
    data.setup("fit")
    torch.manual_seed(args.seed)  # the shuffle of every rung's loader draws from here
    train_loader, val_loader, test_loader = data.train_dataloader(), data.val_dataloader(), data.test_dataloader()
    images = len(train_loader.dataset)
    x0 = next(batches(val_loader, data))[0][:1]

    live = list(args.depths)
    done: dict[int, int] = {}  # blocks → epochs trained
    rungs, flops = [], 0.0
    per_epoch = {b: 3.0 * forward_flops(build(b, args.seed), x0) * images for b in live}
    r, target = 0, args.r0
    while True:
        vals = {}
        for b in live:
            path = state_dir / f"blocks{b}.pt"
            model = build(b, args.seed)
            opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
            if path.exists():
                saved = torch.load(path, weights_only=True)
                model.load_state_dict(saved["model"]), opt.load_state_dict(saved["opt"])
                done[b] = saved["epochs"]
            todo = target - done.get(b, 0)
            if todo > 0:
                train(model, opt, train_loader, data, todo)
                flops += per_epoch[b] * todo
                done[b] = target
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "epochs": target}, path)
            vals[b] = loss_on(model, val_loader, data)
            print(f"rung {r}: {b} blocks, {target} epochs, val {vals[b]:.4f}", flush=True)
        rungs.append({"epochs": target, "val": vals})
        if len(live) == 1:
            break
        keep = max(1, math.ceil(len(live) / 3))
        live = sorted(live, key=vals.get)[:keep]
        r, target = r + 1, target * 3
    (winner,) = live
    model = build(winner, args.seed)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    saved = torch.load(state_dir / f"blocks{winner}.pt", weights_only=True)
    model.load_state_dict(saved["model"]), opt.load_state_dict(saved["opt"])
    cosine = lambda step, steps: 0.5 * args.lr * (1 + math.cos(math.pi * step / steps))  # noqa: E731
    train(model, opt, train_loader, data, args.anneal, lr_at=cosine)
    flops += per_epoch[winner] * args.anneal
    row = {"seed": args.seed, "split": args.split, "depths": args.depths, "r0": args.r0, "rungs": rungs,
           "winner_blocks": winner, "epochs": target + args.anneal, "gflop": flops / 1e9,
           "val_loss": loss_on(model, val_loader, data), "test_loss": loss_on(model, test_loader, data)}  # fmt: skip
    out.write_text(json.dumps(row, indent=1) + "\n")
    print(json.dumps({k: row[k] for k in ("winner_blocks", "gflop", "test_loss")}), flush=True)


if __name__ == "__main__":
    main()
