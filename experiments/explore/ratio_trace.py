"""Exploration: the relative rule's ratio (best cross-fit lower bound / R) at every check on a
*training-loss* plateau of a growth run forced to keep growing (τ tiny).

    python experiments/explore/ratio_trace.py --seed 0 --out runs/explore/trace_s0.json

Result (2026-11-30, seed 0, 60 epochs, 1600 s on a loaded 2-core machine): no check ran at all —
with SGD 0.05 (no momentum) on the 5000-image subset the epoch training loss improved by more
than min_delta=0.005 within every 2 epochs for 60 epochs (memorisation), so the plateau never
came (test loss 0.498 at the end, still ResNet-8). This is why the shipped configs monitor
val_loss (docs/decision.md).
"""
import argparse, json, time
import torch, lightning as L
from growtrain.callbacks import GrowUntilSaturated
from growtrain.data import ImageDataModule
from growtrain.module import ImageClassifier

ap = argparse.ArgumentParser()
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--epochs", type=int, default=60)
ap.add_argument("--growths", type=int, default=9)
ap.add_argument("--out", required=True)
a = ap.parse_args()
torch.set_num_threads(1)
L.seed_everything(a.seed)
data = ImageDataModule(dataset="fashion-mnist-mini", probe_size=2000, val_size=1000, batch_size=128, seed=0, augment=False)
from functools import partial
model = ImageClassifier(in_channels=1, num_classes=10, arch="cifar_resnet", blocks=[1, 1, 1], width=8, family="basic",
                        optimizer=partial(torch.optim.SGD, lr=0.05))
cb = GrowUntilSaturated(monitor="train_loss", patience=2, min_delta=0.005, rule="relative", tau=1e-6, max_growths=a.growths,
                        on_saturated="continue", verbose=False, seed=a.seed)
import growtrain.saturation as sat
tr = L.Trainer(max_epochs=a.epochs, callbacks=[cb], enable_progress_bar=False, logger=False, enable_checkpointing=False,
               num_sanity_val_steps=0, limit_val_batches=0)
t0 = time.time()
tr.fit(model, data)
res = tr.test(model, datamodule=data, verbose=False)
json.dump({"history": cb.history, "test": res, "seconds": time.time() - t0}, open(a.out, "w"), indent=1, default=str)
for h in cb.history:
    print(h["epoch"], h["depth_before"], h["action"], "ratio", h.get("ratio"), "ref", h.get("reference"), "lower", h.get("lower"))
print(res, time.time() - t0)
