"""The default schedule (``Budget()``) holds the checks every growth protocol shares, before any state
changes: a loss-scaled float16 precision, manual optimization, FSDP2, a shuffled probe, a probe that
was trained on; and a plan that probes nothing asks for no probe."""

from __future__ import annotations

from types import SimpleNamespace

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from growtrain import GrowUntilSaturated, Plan
from growtrain.data import ImageDataModule
from growtrain.module import ImageClassifier


_DM = dict(dataset="synthetic", image_size=8, synthetic_size=200, synthetic_classes=4, probe_size=40, val_size=20,
           batch_size=32, augment=False)  # fmt: skip


def _dm(**kw) -> ImageDataModule:
    return ImageDataModule(**(_DM | kw))


def _trainer(tmp_path, callbacks, **kw) -> L.Trainer:
    args = dict(max_steps=700, callbacks=callbacks, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                default_root_dir=tmp_path, accelerator="cpu")  # fmt: skip
    return L.Trainer(**(args | kw))


def _untouched(model: torch.nn.Module):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    return lambda: all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_the_default_refuses_a_loss_scaled_float16_and_fsdp2_at_setup():
    strategy = L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False).strategy
    fp16 = SimpleNamespace(strategy=strategy, world_size=1, precision="16-mixed",
                           precision_plugin=SimpleNamespace(scaler=object()))  # fmt: skip
    with pytest.raises(RuntimeError, match=r"^precision: decision='budget_fork' does not scale the arm's loss.*"
                                           r"Fix: pass precision='bf16-mixed'"):  # fmt: skip
        GrowUntilSaturated().setup(fp16, None, "fit")

    class ModelParallelStrategy:  # recognised by name, as growtrain.callbacks.sharded does
        _device_mesh, _tensor_parallel_size, _data_parallel_size = None, 1, 2

    fsdp = SimpleNamespace(strategy=ModelParallelStrategy(), world_size=1, precision_plugin=SimpleNamespace())
    with pytest.raises(RuntimeError, match=r"^strategy: decision='budget_fork' trains a full copy"):
        GrowUntilSaturated().setup(fsdp, None, "fit")


def test_the_default_refuses_manual_optimization_before_training(tmp_path):
    class Manual(ImageClassifier):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.automatic_optimization = False

    model = Manual(width=4, in_channels=3, num_classes=4)
    same = _untouched(model)
    with pytest.raises(RuntimeError, match=r"^decision: 'budget_fork' trains its arm through Manual\.training_step.*"
                                           r"Fix: use automatic optimization"):  # fmt: skip
        _trainer(tmp_path, [GrowUntilSaturated(verbose=False)]).fit(model, _dm())
    assert same()


def test_the_default_refuses_a_shuffled_probe_and_one_that_was_trained_on(tmp_path):
    dm = _dm()
    dm.setup("fit")
    probe = dm.probe_dataloader()
    shuffled = DataLoader(probe.dataset, batch_size=8, shuffle=True, collate_fn=probe.collate_fn)
    model = ImageClassifier(width=4, in_channels=3, num_classes=4)
    same = _untouched(model)
    with pytest.raises(ValueError, match=r"^probe: min_gain compares every probe sample's loss.*Fix: build the probe "
                                         r"loader with shuffle=False"):  # fmt: skip
        _trainer(tmp_path, [GrowUntilSaturated(probe=shuffled, verbose=False)]).fit(model, dm)
    other = _dm()
    with pytest.raises(ValueError, match="probe: the probe sample overlaps the training data"):
        _trainer(tmp_path, [GrowUntilSaturated(probe=other.train_dataloader, verbose=False)]).fit(model, other)
    assert same()


def test_a_plan_probes_nothing_and_needs_no_probe(tmp_path):
    """A fixed plan with no test grows on a datamodule without a probe split (its records carry no Γ̂)."""

    class NoProbe(ImageDataModule):
        probe_dataloader = None  # no probe split at all

    model = ImageClassifier(width=4, in_channels=3, num_classes=4)
    grow = GrowUntilSaturated(schedule=Plan(at=[2], site="cyclic"), verbose=False)
    _trainer(tmp_path, [grow], max_steps=4).fit(model, NoProbe(**_DM))
    (record,) = grow.history
    assert (record["action"], record["gamma"], record["function_preserving"]) == ("grow", None, True)
    assert model.network.depth() == 4
