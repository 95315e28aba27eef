"""``RandomStateCheckpoint``: the random state into the checkpoint and back, at the right moment.

A tiny Lightning fit (a linear model with dropout on a shuffled loader) stopped at an epoch end
and resumed from its last checkpoint must see the batches, dropout masks and weights of the
uninterrupted fit; with the restore switched off it does not (so the comparison can fail). The
growth-level version of this, on the quickstart, is ``tests/test_resume_same_decisions.py``.
A few seconds.
"""

from __future__ import annotations

import random

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from growtrain.callbacks import RandomStateCheckpoint
from growtrain.callbacks.rng_state import CHECKPOINT_KEY, capture_random_state, loader_generators, restore_random_state
from growtrain.experiments._training import BaseGrowTrainer

# Lightning's notes on a resume into the same checkpoint folder (expected here)
pytestmark = [pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty"),
              pytest.mark.filterwarnings("ignore:The dirpath has changed")]  # fmt: skip


def _draws() -> tuple:
    return torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)]


def test_capture_and_restore_give_the_same_draws_and_survive_a_weights_only_load(tmp_path):
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    np.random.randn()  # numpy's cached Gaussian is part of its state
    state = capture_random_state()
    expected = _draws()
    torch.save({"state": state}, tmp_path / "s.pt")  # as Lightning writes it, and LightningCLI reads it back
    loaded = torch.load(tmp_path / "s.pt", weights_only=True)["state"]
    _draws()  # move on
    assert restore_random_state(loaded) == []
    assert _draws() == expected


def _loader(kind: str) -> DataLoader:
    data = TensorDataset(torch.arange(48.0).unsqueeze(1).repeat(1, 4) / 48)
    if kind == "global":  # shuffle from torch's global generator (a fresh seed drawn per epoch)
        return DataLoader(data, batch_size=8, shuffle=True)
    if kind == "loader generator":
        return DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(5))
    return DataLoader(data, batch_size=8, sampler=RandomSampler(data, generator=torch.Generator().manual_seed(5)))


def test_the_train_loaders_generators_are_found_once_each():
    plain, own, sampler = _loader("global"), _loader("loader generator"), _loader("sampler generator")
    trainer = type("T", (), {"train_dataloader": [plain, {"b": own, "a": sampler}]})()
    found = loader_generators(trainer)
    # DataLoader(shuffle=True, generator=g) gives its RandomSampler the same g: one generator, not two
    assert len(found) == 2 and found[0] is sampler.sampler.generator and found[1] is own.generator


class Toy(L.LightningModule):
    def __init__(self, kind: str):
        super().__init__()
        self.kind, self.layer, self.seen = kind, torch.nn.Linear(4, 1), []

    def training_step(self, batch, batch_idx):
        (x,) = batch
        self.seen.append((self.current_epoch, x[:, 0].tolist()))
        return self.layer(torch.nn.functional.dropout(x, 0.5)).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return _loader(self.kind)


class StopAt(L.Callback):
    def __init__(self, epoch: int):
        self.epoch = epoch

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == self.epoch:
            trainer.should_stop = True


def _fit(root, kind: str, *, stop: int | None = None, ckpt=None) -> Toy:
    L.seed_everything(0, verbose=False)
    model = Toy(kind)
    callbacks = [ModelCheckpoint(dirpath=root, save_last=True), RandomStateCheckpoint()]
    callbacks += [StopAt(stop)] if stop is not None else []
    trainer = L.Trainer(max_epochs=4, callbacks=callbacks, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0)  # fmt: skip
    trainer.fit(model, ckpt_path=ckpt)
    return model


@pytest.mark.parametrize("kind", ["global", "loader generator", "sampler generator"])
def test_a_resumed_fit_sees_the_batches_and_dropout_of_the_uninterrupted_one(tmp_path, kind):
    whole = _fit(tmp_path / "whole", kind)
    first = _fit(tmp_path / "cut", kind, stop=1)
    rest = _fit(tmp_path / "cut", kind, ckpt=tmp_path / "cut" / "last.ckpt")
    assert first.seen + rest.seen == whole.seen
    assert torch.equal(rest.layer.weight, whole.layer.weight)  # the dropout masks too


def test_without_the_restore_the_resumed_batches_differ(tmp_path, monkeypatch):
    """The negative control: the comparison above notices a resume that restores nothing."""
    whole = _fit(tmp_path / "whole", "global")
    _fit(tmp_path / "cut", "global", stop=1)
    monkeypatch.setattr(RandomStateCheckpoint, "on_load_checkpoint", lambda self, trainer, module, checkpoint: None)
    rest = _fit(tmp_path / "cut", "global", ckpt=tmp_path / "cut" / "last.ckpt")
    assert rest.seen != whole.seen[-len(rest.seen):]


def test_the_checkpoint_says_where_it_was_written(tmp_path):
    _fit(tmp_path, "global", stop=1)
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)[CHECKPOINT_KEY]
    assert (saved["format"], saved["epoch"], saved["global_step"], saved["at_epoch_end"]) == (1, 1, 12, True)
    assert len(saved["ranks"]) == 1 and set(saved["ranks"][0]) == {"torch", "cuda", "numpy", "python", "generators"}


def test_a_checkpoint_without_random_state_resumes_with_a_warning(tmp_path):
    _fit(tmp_path, "global", stop=1)
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=True)
    del checkpoint[CHECKPOINT_KEY]
    torch.save(checkpoint, tmp_path / "old.ckpt")
    with pytest.warns(UserWarning, match="RandomStateCheckpoint: the checkpoint holds no random state"):
        _fit(tmp_path / "resumed", "global", ckpt=tmp_path / "old.ckpt")


def test_a_checkpoint_of_another_format_is_refused_with_the_fix(tmp_path):
    _fit(tmp_path, "global", stop=1)
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=True)
    checkpoint[CHECKPOINT_KEY]["format"] = 99
    torch.save(checkpoint, tmp_path / "future.ckpt")
    with pytest.raises(ValueError, match=r"ckpt_path: '.*future\.ckpt' holds a random state of format 99; this "
                                         r"growtrain reads format 1\. Fix: "):
        _fit(tmp_path / "resumed", "global", ckpt=tmp_path / "future.ckpt")


def test_every_growtrain_trainer_has_one(tmp_path):
    trainer = BaseGrowTrainer(logger=False, default_root_dir=tmp_path)
    assert sum(isinstance(cb, RandomStateCheckpoint) for cb in trainer.callbacks) == 1
    mine = RandomStateCheckpoint()
    trainer = BaseGrowTrainer(logger=False, default_root_dir=tmp_path, callbacks=[mine])
    assert [cb for cb in trainer.callbacks if isinstance(cb, RandomStateCheckpoint)] == [mine]  # not a second one


def test_under_ddp_each_rank_gets_its_own_random_state_back(tmp_path):
    """2 CPU processes (gloo), each seeded differently: the stopped and resumed fit draws, on each
    rank, what that rank drew in the uninterrupted fit (``tests/ddp_rng_script.py``)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from test_ddp import _free_port, clean_env

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "tests" / "ddp_rng_script.py"), "--out", str(tmp_path)], cwd=root,
                          env=clean_env(dict(os.environ), _free_port()), capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["resumed"] == r0["whole"] and r1["resumed"] == r1["whole"]
    # the ranks drew differently (else rank 0's state on every rank would pass too), on other samples
    assert [s[3] for s in r0["whole"]] != [s[3] for s in r1["whole"]] and r0["whole"][0][2] != r1["whole"][0][2]
    saved = torch.load(tmp_path / "cut" / "last.ckpt", weights_only=True)[CHECKPOINT_KEY]
    assert len(saved["ranks"]) == 2 and not torch.equal(saved["ranks"][0]["torch"], saved["ranks"][1]["torch"])
