"""restore_best: when growth ends because the last block did not pay, the network of the check
before that growth is handed over — weights, BatchNorm statistics, optimizer and architecture."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch

from growtrain.callbacks import GrowUntilSaturated
from growtrain.data import ImageDataModule
from growtrain.module import ImageClassifier


def tiny_dm() -> ImageDataModule:
    return ImageDataModule(dataset="synthetic", image_size=8, synthetic_size=400, synthetic_classes=4, probe_size=120,
                           val_size=40, batch_size=32, augment=False)  # fmt: skip


class States(L.Callback):
    """Before the grower: a deep copy of the module's state and optimizer groups at every epoch end."""

    def __init__(self):
        self.module: dict[int, dict] = {}
        self.groups: dict[int, int] = {}
        self.optimizer: dict[int, dict] = {}

    def on_train_epoch_end(self, trainer, pl_module):
        self.module[trainer.current_epoch] = copy.deepcopy(pl_module.state_dict())
        self.groups[trainer.current_epoch] = len(trainer.optimizers[0].param_groups)
        self.optimizer[trainer.current_epoch] = copy.deepcopy(trainer.optimizers[0].state_dict())


def fit(tmp_path, min_gain=10.0, extra=(), **kw):
    L.seed_everything(0)
    kw = {"rule": "paper", "t": 1e-12, "max_growths": 3} | kw
    grow = GrowUntilSaturated(monitor=None, every_n_epochs=2, min_gain=min_gain, lr_schedule="anneal",
                              anneal_epochs=1, on_saturated="anneal", verbose=False, **kw)  # fmt: skip
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_top_k=-1,
                                               every_n_epochs=1, save_on_train_epoch_end=True)  # fmt: skip
    trainer = L.Trainer(max_epochs=20, callbacks=[*extra, grow, ckpt], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path)  # fmt: skip
    model = ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], family="basic",
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=5e-4))  # fmt: skip
    trainer.fit(model, tiny_dm())
    return grow, model, trainer


def assert_same_state(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_an_unpaid_growth_is_undone_bit_for_bit(tmp_path):
    """min_gain=10 (a tenfold drop: impossible): check 0 grows, check 1 finds the growth did not
    pay. The handed-over module equals the one at check 0 bit for bit (BatchNorm statistics
    included), the block is gone from the architecture, the record and the optimizer."""
    states = States()
    grow, model, trainer = fit(tmp_path, extra=[states])
    first, second = grow.history[:2]
    assert first["action"] == "grow" and second["action"] == "saturated" and len(grow.history) == 2
    assert_same_state(model.state_dict(), states.module[first["epoch"]])
    assert model.network.depth() == 3 and model.network.growth_log == []
    optimizer = trainer.optimizers[0]
    assert len(optimizer.param_groups) == states.groups[first["epoch"]]
    ids = {id(p) for p in model.parameters()}
    assert all(id(p) in ids for g in optimizer.param_groups for p in g["params"])
    assert all(id(p) in ids for p in optimizer.state)  # the block's momentum buffers are gone
    want_opt = states.optimizer[first["epoch"]]["state"]
    got_opt = optimizer.state_dict()["state"]
    assert got_opt.keys() == want_opt.keys()
    for k in want_opt:
        assert torch.equal(got_opt[k]["momentum_buffer"], want_opt[k]["momentum_buffer"])
    restored = second["restored"]
    assert restored["removed_sites"] == [first["site"]] and restored["check"] == 0 and restored["depth"] == 3
    assert "restored the network of check 0" in grow.stop_reason and second["depth"] == 3


def test_the_checkpoints_rebuild_the_restored_network(tmp_path):
    grow, model, _ = fit(tmp_path)
    loaded = ImageClassifier.load_from_checkpoint(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    assert loaded.network.depth() == 3
    assert_same_state(loaded.state_dict(), model.state_dict())
    state = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["callbacks"]
    saved = next(v for k, v in state.items() if "GrowUntilSaturated" in k)
    assert saved["snapshot"] is None and saved["history"][-1]["restored"]["removed_sites"]


def test_restore_best_false_keeps_the_last_network(tmp_path):
    """The negative control and the option that keeps the old behaviour."""
    states = States()
    grow, model, _ = fit(tmp_path, extra=[states], restore_best=False)
    assert [h["action"] for h in grow.history] == ["grow", "saturated"]
    assert model.network.depth() == 4 and "restored" not in grow.history[1]
    assert grow.snapshot is None  # no snapshot taken: no host copy when it cannot be used


def test_a_budget_ends_growth_without_judging_or_undoing(tmp_path):
    """max_growths=1: check 1 is refused by the budget before any probing; the last growth is
    not judged (a budget the user set is not a verdict), so its block stays."""
    grow, model, _ = fit(tmp_path, max_growths=1)
    second = grow.history[1]
    assert second["action"] == "budget" and "gain" not in second and "restored" not in second
    assert model.network.depth() == 4
    assert grow.snapshot is None  # growth has ended: no verdict can use the host copy any more


def test_a_paid_growth_is_kept(tmp_path):
    grow, model, _ = fit(tmp_path, min_gain=0.0, max_growths=2)
    assert grow.history[1]["gain"]["paid"] and grow.history[1]["action"] == "grow"
    assert all("restored" not in h for h in grow.history) and model.network.depth() == 5


def test_trial_growth_grows_where_the_first_order_test_does_not_certify(tmp_path):
    """rule=crossfit with δ = 1e9 certifies nothing; trial_growth grows at the best-scored site
    anyway and lets the realized gain decide (here: did not pay → undone)."""
    grow, model, _ = fit(tmp_path, rule="crossfit", t=None, delta=1e9, trial_growth=True)
    first, second = grow.history[:2]
    assert first["verdicts"]["crossfit"]["saturated"] is True and first["action"] == "grow"
    assert "trial growth" in first["reason"] and second["restored"] and model.network.depth() == 3
    plain, _, _ = fit(tmp_path / "plain", rule="crossfit", t=None, delta=1e9)
    assert [h["action"] for h in plain.history] == ["saturated"]


def test_trial_growth_needs_min_gain():
    with pytest.raises(ValueError, match=r"trial_growth: expected min_gain set.*Fix"):
        GrowUntilSaturated(trial_growth=True, min_gain=None)
