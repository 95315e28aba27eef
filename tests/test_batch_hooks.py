"""The probe sees batches as a training step does: the precision conversion and the batch hooks
(``on_before_batch_transfer``, ``transfer_batch_to_device``, ``on_after_batch_transfer``).

The oracle: the same data normalised in the dataset instead, with no hook. A probe that skipped
the hooks would score raw inputs (ten times the scale, shifted) and its figures would differ."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from growtrain.callbacks import GrowUntilSaturated, Trial
from growtrain.module import ImageClassifier

SCALE, SHIFT = 10.0, 3.0


def _tensors(n, seed):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, 3, 8, 8, generator=g)
    y = (z.mean((1, 2, 3)) > 0).long() + 2 * (z[:, 0].mean((1, 2)) > 0).long()
    return z, y


class Data(L.LightningDataModule):
    """Normalised in the dataset (``in_hook=False``), or raw ``SCALE·z + SHIFT`` normalised in
    ``on_after_batch_transfer`` (and marked in ``on_before_batch_transfer``: both hooks must run)."""

    def __init__(self, in_hook: bool):
        super().__init__()
        self.in_hook = in_hook
        self.train, self.probe = _tensors(256, 0), _tensors(64, 1)

    def _loader(self, z, y, shuffle=False):
        x = z * SCALE + SHIFT if self.in_hook else z
        return DataLoader(TensorDataset(x, y), batch_size=32, shuffle=shuffle)

    def train_dataloader(self):
        return self._loader(*self.train)

    def probe_dataloader(self):
        return self._loader(*self.probe)

    def on_before_batch_transfer(self, batch, dataloader_idx):
        x, y = batch
        return [x - SHIFT, y] if self.in_hook else batch

    def on_after_batch_transfer(self, batch, dataloader_idx):
        x, y = batch
        return [x / SCALE, y] if self.in_hook else batch


def _fit(tmp_path, in_hook: bool, decision: str) -> GrowUntilSaturated:
    L.seed_everything(0)
    dm = Data(in_hook)
    grow = GrowUntilSaturated(schedule="periodic", decision="rule" if decision == "rule" else Trial(epochs=0.5),
                              rule="paper", t=1e-9, max_growths=1, probe=dm.probe_dataloader(), verbose=False)
    trainer = L.Trainer(max_epochs=2, callbacks=[grow], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], in_channels=3), dm)
    return grow


@pytest.mark.parametrize("decision", ["rule", "trial"])
def test_normalising_in_the_batch_hooks_scores_as_normalising_in_the_dataset(tmp_path, decision):
    hooked, plain = _fit(tmp_path / "hook", True, decision), _fit(tmp_path / "plain", False, decision)
    assert [h["action"] for h in hooked.history] == [h["action"] for h in plain.history]
    a, b = hooked.history[0], plain.history[0]
    assert a["gamma"] == pytest.approx(b["gamma"], rel=1e-3)
    for sa, sb in zip(a["site_scores"], b["site_scores"]):
        assert sa["grad_norm"] == pytest.approx(sb["grad_norm"], rel=1e-3, abs=1e-6)
    if decision == "trial":  # the trials' per-sample probe losses: the same held-out scores
        assert a["trial"]["reason"] == b["trial"]["reason"]
        for ta, tb in zip(a["trial"]["trials"], b["trial"]["trials"]):
            assert ta["gain_frac"] == pytest.approx(tb["gain_frac"], rel=1e-2, abs=1e-4)
