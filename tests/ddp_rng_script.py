"""A 2-process CPU DDP fit stopped and resumed with ``RandomStateCheckpoint`` (run by
``tests/test_rng_state.py`` as a subprocess; Lightning's ``ddp`` launcher re-runs this script
for rank 1, so it must be a plain script):

    PYTHONPATH=. python tests/ddp_rng_script.py --out /tmp/ddp_rng

Each rank is seeded differently (``10 + rank``), so the ranks draw different random numbers:
a resume that gave every rank rank 0's state would show. Three fits in the same two processes:
uninterrupted (3 epochs), stopped at the end of epoch 0, resumed from its ``last.ckpt``. Each
rank writes ``rank{r}.json``: per training step, (epoch, batch, the samples' ids, the step's
first random number), for the uninterrupted fit and for the stopped + resumed one.
"""

from __future__ import annotations

import argparse
import json
import os

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from growtrain.callbacks import RandomStateCheckpoint


class Toy(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer, self.seen = torch.nn.Linear(4, 1), []

    def training_step(self, batch, batch_idx):
        (x,) = batch
        noise = torch.rand(())  # a draw from this rank's global generator, as augmentation or dropout makes
        self.seen.append([self.current_epoch, batch_idx, x[:, 0].tolist(), float(noise)])
        return self.layer(torch.nn.functional.dropout(x, 0.5) + noise).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        # Lightning puts a DistributedSampler in (seeded by epoch); the ranks' own draws are the test
        return DataLoader(TensorDataset(torch.arange(32.0).unsqueeze(1).repeat(1, 4)), batch_size=4, shuffle=True)


class StopAt(L.Callback):
    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == 0:
            trainer.should_stop = True


def fit(out: str, root: str, *, stop: bool = False, ckpt: str | None = None) -> Toy:
    rank = int(os.environ.get("LOCAL_RANK", 0))  # set by the launcher for rank 1; rank 0 is this process
    L.seed_everything(10 + rank, verbose=False)
    model = Toy()
    callbacks = [ModelCheckpoint(dirpath=os.path.join(out, root), save_last=True), RandomStateCheckpoint()]
    callbacks += [StopAt()] if stop else []
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=3, callbacks=callbacks, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)  # fmt: skip
    trainer.fit(model, ckpt_path=ckpt)
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = parser.parse_args().out
    whole = fit(out, "whole")
    first = fit(out, "cut", stop=True)
    rest = fit(out, "cut", ckpt=os.path.join(out, "cut", "last.ckpt"))
    rank = int(os.environ.get("LOCAL_RANK", 0))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "whole": whole.seen, "resumed": first.seen + rest.seen}, f)


if __name__ == "__main__":
    main()
