"""A tiny 2-process CPU DDP fit with GrowUntilSaturated (run by tests/test_ddp.py as a subprocess).

Lightning's ``ddp`` launcher re-runs this script for rank 1, so it must be a plain script:

    PYTHONPATH=. python tests/ddp_script.py --out /tmp/ddp_out [--no-rewrap]

Each rank writes ``rank{r}.json``: its growth history, growth log, param-group names, the
probe sample size it saw after the all-reduce, its own probe shard size, and a checksum of its
parameters (buffers are left out: DDP broadcasts rank 0's BatchNorm buffers each forward, so
after the last step every rank's running statistics are its own).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os

import lightning as L
import torch

from growtrain.callbacks import GrowUntilSaturated
from growtrain.data import ImageDataModule
from growtrain.module import ImageClassifier


def parameter_checksum(module: torch.nn.Module) -> tuple[str, float]:
    digest = hashlib.sha256()
    total = 0.0
    for name, p in sorted(module.named_parameters()):
        data = p.detach().cpu().contiguous()
        digest.update(name.encode())
        digest.update(data.numpy().tobytes())
        total += float(data.double().sum())
    return digest.hexdigest(), total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--no-rewrap", action="store_true", help="break DDP re-wrapping (the test's negative control)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.no_rewrap:
        GrowUntilSaturated._rewrap_ddp = staticmethod(lambda trainer: None)

    L.seed_everything(0)
    data = ImageDataModule(dataset="synthetic", image_size=8, synthetic_size=400, synthetic_classes=4,
                           probe_size=91, val_size=10, batch_size=32, augment=False)  # fmt: skip
    module = ImageClassifier(width=4, num_classes=4)
    # cross-fit rule (its A/B split all-reduces mid-pass); 91 probe samples: shards of 46 and 45.
    # The untrained net grows at epochs 0 and 1 (lower bounds far above δ = 0); epoch 2 meets max_growths.
    grow = GrowUntilSaturated(monitor=None, rule="crossfit", max_growths=2, verbose=False)
    trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=args.epochs, callbacks=[grow],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, default_root_dir=args.out)  # fmt: skip
    trainer.fit(module, data)

    rank = trainer.global_rank
    digest, total = parameter_checksum(module)
    shard = grow._probe_loader(trainer)
    result = {
        "rank": rank,
        "world_size": trainer.world_size,
        "history": grow.history,
        "growth_log": module.network.growth_log,
        "param_groups": [g.get("name") for g in trainer.optimizers[0].param_groups],
        "probe_shard": len(shard.sampler),
        "checksum": digest,
        "param_sum": total,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
