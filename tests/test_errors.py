"""Every error the probe and growth code raises, triggered through the public API (issue 10).

Each test checks the message names the argument or the batch and says what to do, and, for
errors in a fit, that it comes before any training step or leaves the model as it was.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from growtrain import GrowUntilSaturated
from growtrain.data import ImageDataModule
from growtrain.module import ImageClassifier


class CountSteps(L.Callback):
    def __init__(self):
        self.steps = 0

    def on_train_batch_start(self, *args):
        self.steps += 1


def _trainer(tmp_path, callbacks, max_epochs=2):
    return L.Trainer(max_epochs=max_epochs, callbacks=callbacks, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                     default_root_dir=tmp_path, accelerator="cpu")  # fmt: skip


def _dm(**kw) -> ImageDataModule:
    args = dict(dataset="synthetic", image_size=8, synthetic_size=128, synthetic_classes=4, probe_size=32,
                val_size=16, batch_size=16, augment=False)  # fmt: skip
    return ImageDataModule(**(args | kw))


# -- an empty probe is refused before training -------------------------------------------------
def test_empty_probe_is_refused_before_any_training_step(tmp_path):
    steps = CountSteps()
    grower = GrowUntilSaturated(every_n_epochs=1, verbose=False)
    with pytest.raises(ValueError, match=r"probe_size: expected an integer >= 1 when a probe is used.*got 0"):
        _trainer(tmp_path, [steps, grower]).fit(ImageClassifier(width=4, in_channels=3, num_classes=4),
                                               _dm(probe_size=0))  # fmt: skip
    assert steps.steps == 0


def test_probe_size_zero_is_fine_without_a_probe():
    dm = _dm(probe_size=0)
    dm.setup("fit")
    assert len(dm.probe_indices) == 0 and len(dm.train_dataloader()) > 0
    with pytest.raises(ValueError, match="probe_size"):
        dm.probe_dataloader()
