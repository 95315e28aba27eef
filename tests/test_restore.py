"""restore_best: when growth ends because the last block did not pay, the network of the check
before that growth is handed over — weights, BatchNorm statistics, optimizer and architecture."""

from __future__ import annotations

import copy
import io
import warnings
from pathlib import Path

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


def fit(tmp_path, min_gain=10.0, extra=(), trainer_kw=None, module=ImageClassifier, **kw):
    L.seed_everything(0)
    # decision="gain": these runs test the stage-gain verdict and its undo (the default is now "trial")
    kw = {"rule": "paper", "t": 1e-12, "max_growths": 3, "decision": "gain"} | kw
    grow = GrowUntilSaturated(monitor=None, every_n_epochs=2, min_gain=min_gain, lr_schedule="anneal",
                              anneal_epochs=1, on_saturated="anneal", verbose=False, **kw)  # fmt: skip
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_top_k=-1,
                                               every_n_epochs=1, save_on_train_epoch_end=True)  # fmt: skip
    trainer_kw = {"limit_val_batches": 0, "logger": False} | (trainer_kw or {})
    trainer = L.Trainer(max_epochs=20, callbacks=[*extra, grow, ckpt], enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path, **trainer_kw)  # fmt: skip
    model = module(width=4, num_classes=4, blocks=[1, 1, 1], family="basic",
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


class ValLosses(L.Callback):
    """The val_loss each epoch's validation logged (it runs before the growth check of that epoch)."""

    def __init__(self):
        self.val: dict[int, float] = {}

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.val[trainer.current_epoch] = float(trainer.callback_metrics["val_loss"])


def test_after_an_undo_the_run_reports_the_restored_network(tmp_path):
    """The fit ends at the check that undoes the block: the epoch's validation and training
    losses are the removed network's. The record, growth_history.json, the callback metrics the
    checkpoint callback scores, and the summary's final line must be the restored network's:
    val_loss as `trainer.validate` gives it on last.ckpt, train_loss as an eval-mode pass over
    the train loader gives it (both computed here independently of the callback)."""
    import json

    import torch.nn.functional as F
    from rich.console import Console

    from growtrain.callbacks import telemetry
    from growtrain.callbacks.telemetry import final_metrics

    vals = ValLosses()
    scores = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "scored", monitor="train_loss", save_top_k=-1,
                                                 filename="{epoch}", save_on_train_epoch_end=True)  # fmt: skip
    logger = L.pytorch.loggers.CSVLogger(tmp_path, name="logs")
    grow, model, trainer = fit(tmp_path, extra=[vals, scores],
                               trainer_kw={"limit_val_batches": None, "logger": logger, "log_every_n_steps": 1})
    last = grow.history[-1]
    assert last["restored"] and trainer.global_step == last["step"]  # the fit ended at the undo

    loaded = ImageClassifier.load_from_checkpoint(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    assert loaded.network.depth() == 3
    (validated,) = L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False,
                             default_root_dir=tmp_path).validate(loaded, tiny_dm(), verbose=False)  # fmt: skip
    from growtrain.cli import GrowtrainCLI  # what a user runs: `growtrain validate ... --ckpt_path last.ckpt`

    with warnings.catch_warnings():  # Lightning's notice that the fit's callbacks are not in this validate run
        warnings.filterwarnings("ignore", message="Be aware that when using `ckpt_path`, callbacks used")
        cli = GrowtrainCLI(args=["validate", "--model=growtrain.ImageClassifier", "--model.width=4",
                                 "--model.num_classes=4", "--model.blocks=[1, 1, 1]", "--model.family=basic",
                                 "--data=growtrain.data.ImageDataModule", "--data.dataset=synthetic", "--data.image_size=8",
                                 "--data.synthetic_size=400", "--data.synthetic_classes=4", "--data.probe_size=120",
                                 "--data.val_size=40", "--data.batch_size=32", "--data.augment=false",
                                 "--trainer.logger=false", "--trainer.enable_progress_bar=false",
                                 "--trainer.enable_checkpointing=false", f"--trainer.default_root_dir={tmp_path / 'validate'}",
                                 f"--ckpt_path={tmp_path / 'ckpt' / 'last.ckpt'}"])  # fmt: skip
    assert cli.model.network.depth() == 3
    assert float(cli.trainer.callback_metrics["val_loss"]) == pytest.approx(validated["val_loss"], rel=1e-6)
    loaded.eval()
    total, count, correct = 0.0, 0, 0
    with torch.no_grad():
        dm = tiny_dm()
        dm.setup("fit")
        train = dm.train_dataloader()  # every training sample once (the train loader drops its ragged last batch)
        for batch in torch.utils.data.DataLoader(train.dataset, batch_size=50, collate_fn=train.collate_fn):
            x, y = dm.on_after_batch_transfer(batch, 0)  # uint8 → normalised float; no trainer: no augmentation
            logits = loaded(x)
            total += float(F.cross_entropy(logits, y, reduction="sum"))
            correct += int((logits.argmax(1) == y).sum())
            count += len(y)
    want = {"val_loss": validated["val_loss"], "val_acc": validated["val_acc"], "train_loss": total / count,
            "train_acc": correct / count}

    measured = last["restored"]["metrics"]
    assert measured.keys() == want.keys()
    for key, value in want.items():
        assert measured[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    removed = vals.val[last["epoch"]]  # what the epoch logged: the 4-block network's
    assert abs(removed - want["val_loss"]) > 1e-4  # the planted run tells the two apart

    on_disk = json.loads((Path(trainer.log_dir) / "growth_history.json").read_text())
    assert on_disk[-1]["restored"]["metrics"] == pytest.approx(measured)
    import csv

    with open(logger.experiment.metrics_file_path) as f:  # the last values logged for each metric
        logged = {k: float(v) for row in csv.DictReader(f) for k, v in row.items() if v not in ("", None)}
    for key in ("train_loss", "train_acc", "val_loss", "val_acc"):
        assert logged[key] == pytest.approx(measured[key], rel=1e-6), key
    for key in ("train_loss", "train_acc", "val_loss"):  # what ModelCheckpoint and EarlyStopping saw after the check
        assert float(trainer.callback_metrics[key]) == pytest.approx(measured[key], rel=1e-6)
    scored = {Path(p).name: float(v) for p, v in scores.best_k_models.items()}
    assert scored[f"epoch={last['epoch']}.ckpt"] == pytest.approx(measured["train_loss"], rel=1e-6)

    metrics, measured_on = final_metrics(grow.history, trainer.callback_metrics, trainer.global_step)
    assert metrics == pytest.approx(measured) and metrics.keys() == want.keys()  # every number the restored net's
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(telemetry.fit_summary(grow.history, start_depth=3, final_depth=3, finished=grow.finished,
                                        stop_reason=grow.stop_reason, metrics=metrics, probe_seconds=0.0,
                                        fit_seconds=1.0, measured_on=measured_on))  # fmt: skip
    text = console.export_text()
    assert "final (re-measured on the restored network of check 0 (depth 3, eval mode))" in text
    assert f"val_loss={want['val_loss']:.4g}" in text and f"val_loss={removed:.4g}" not in text
    assert "restored the network of check 0" in text


class _NoTrainAcc(ImageClassifier):
    """A classifier that logs train_loss but no train_acc (the names a module logs are its own)."""

    def log(self, name, value, *args, **kwargs):
        if name != "train_acc":
            super().log(name, value, *args, **kwargs)


def test_an_undo_adds_no_train_acc_the_module_does_not_log(tmp_path):
    """The restored network's train_acc is re-measured only where the module logs one: for a
    module without it, neither the record nor the trainer's callback metrics gain a train_acc."""
    grow, model, trainer = fit(tmp_path, module=_NoTrainAcc)
    last = grow.history[-1]
    assert last["restored"] and trainer.global_step == last["step"]  # the fit ended at the undo
    assert "train_loss" in last["restored"]["metrics"] and "train_acc" not in last["restored"]["metrics"]
    assert "train_loss" in trainer.callback_metrics and "train_acc" not in trainer.callback_metrics


def test_final_metrics_are_the_trainers_when_training_followed_the_undo():
    """A final anneal (or on_saturated="continue") trains the restored network on: the last
    epoch's metrics are then its own, and they are what the summary shows."""
    from growtrain.callbacks.telemetry import final_metrics

    history = [{"step": 10, "restored": {"metrics": {"val_loss": 1.0}, "check": 0, "depth": 3}}]
    assert final_metrics(history, {"val_loss": 0.5, "lr": 0.1}, global_step=10) == (
        {"val_loss": 1.0}, "re-measured on the restored network of check 0 (depth 3, eval mode)")
    assert final_metrics(history, {"val_loss": 0.5, "lr": 0.1}, global_step=12) == ({"val_loss": 0.5}, None)


def _depth_of(path) -> int:
    return ImageClassifier.load_from_checkpoint(path, weights_only=False).network.depth()


def test_after_an_undo_every_checkpoint_file_holds_the_restored_network(tmp_path):
    """The stage after a growth saves the grown network: a top-1 ``best_train`` (a fixed name,
    scored at the end of the training epoch), every epoch by ``val_loss`` saved at validation end
    (before the epoch's check, so its file of the undo's epoch is the removed network's), and
    fit()'s own every-epoch callback without a monitor. After the undo no file any of them keeps
    holds the removed block; each one's best and last files are the restored network, scored with
    its re-measured loss. Lightning's next save would have left all three wrong."""
    best_train = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "train", filename="best_train",
                                                     monitor="train_loss", save_top_k=1, save_last=True,
                                                     save_on_train_epoch_end=True)  # fmt: skip
    by_val = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "val", filename="{epoch}", monitor="val_loss",
                                                 save_top_k=-1, save_last=True, save_on_train_epoch_end=False)  # fmt: skip
    grow, model, trainer = fit(tmp_path, extra=[best_train, by_val], trainer_kw={"limit_val_batches": None})
    first, last = grow.history[0], grow.history[-1]
    assert first["action"] == "grow" and last["restored"] and model.network.depth() == 3
    measured = last["restored"]["metrics"]
    assert len(last["restored"]["checkpoints"]) == 3
    plain = next(cb for cb in trainer.checkpoint_callbacks if cb.monitor is None)
    for cb in (best_train, by_val, plain):
        files = sorted(Path(cb.dirpath).glob("*.ckpt"))
        assert files and {p.name for p in files} >= {"last.ckpt", Path(cb.best_model_path).name}
        assert {p.name: _depth_of(p) for p in files} == {p.name: 3 for p in files}, cb.dirpath
        assert set(cb.best_k_models) <= {str(p) for p in files}  # nothing scored that is not on disk
        if cb.monitor is not None:
            assert float(cb.best_k_models[cb.best_model_path]) == pytest.approx(float(cb.best_model_score))
    # every epoch up to the growth kept, the stage's deleted, the undo's epoch re-saved and re-scored
    epochs = sorted(int(Path(p).stem.split("=")[1]) for p in by_val.best_k_models)
    assert epochs == [*range(first["epoch"] + 1), last["epoch"]]
    undo_file = str(tmp_path / "val" / f"epoch={last['epoch']}.ckpt")
    assert float(by_val.best_k_models[undo_file]) == pytest.approx(measured["val_loss"], rel=1e-6)
    kept = sorted(p.name for p in Path(plain.dirpath).glob("epoch=*.ckpt"))
    # epochs before the growth, then the undo's: the growth epoch's own save (at its end, after the
    # check) already held the grown block, and the stage's files are gone
    assert kept == [f"epoch={e}-step={7 * (e + 1)}.ckpt" for e in [*range(first["epoch"]), last["epoch"]]]
    saved = torch.load(tmp_path / "train" / "last.ckpt", weights_only=False)
    assert saved["global_step"] == trainer.global_step  # last.ckpt is the handed-over network, saved at the undo


def test_the_checkpoint_rewind_keeps_what_predates_the_growth(tmp_path):
    """Unit: files scored before the growth stay (and stay on disk); files written after it (new
    paths, an old path saved over with a new score, new files of a callback without a monitor)
    are dropped from the record and deleted, never ``last``; the best and the k-th best are
    recomputed over what is left; a link to a deleted file is forgotten; a callback absent at the
    growth, or whose monitor was not re-measured, is not re-scored."""
    from types import SimpleNamespace

    from growtrain.callbacks.remeasure import rewind_checkpoints, save_rewound

    removed = []

    class Fake(L.pytorch.callbacks.ModelCheckpoint):
        def _remove_checkpoint(self, trainer, filepath):
            removed.append(Path(filepath).name)

        def _save_topk_checkpoint(self, trainer, candidates):
            self.saved_topk = candidates

        def _save_last_checkpoint(self, trainer, candidates):
            self.saved_last = candidates

        def _monitor_candidates(self, trainer):
            return {"train_loss": torch.tensor(0.3)}

    a, b, c, e, f = (str(tmp_path / f"{n}.ckpt") for n in "abcef")
    last = str(tmp_path / "last.ckpt")
    cb = Fake(dirpath=tmp_path, monitor="train_loss", save_top_k=2)
    cb.best_k_models = {a: torch.tensor(0.5), b: torch.tensor(0.4), c: torch.tensor(0.2), e: torch.tensor(0.6),
                        f: torch.tensor(0.8), last: torch.tensor(0.1)}  # fmt: skip
    cb.best_model_path, cb.best_model_score, cb.last_model_path = c, torch.tensor(0.2), last
    # f: a fixed name saved over since the growth with an equal score — the last save, after the growth
    cb._last_checkpoint_saved, cb._last_global_step_saved = f, 20
    other = Fake(dirpath=tmp_path / "other", monitor="val_loss")
    other.best_k_models = {"x.ckpt": torch.tensor(1.0)}
    unmeasured = Fake(dirpath=tmp_path / "acc", monitor="train_acc", save_top_k=1)
    trainer = SimpleNamespace(checkpoint_callbacks=[cb, other, unmeasured], current_epoch=4, ckpt_path=None)
    before = {cb.state_key: {"files": {a: 0.5, b: float(torch.tensor(0.4)), e: 0.7, f: float(torch.tensor(0.8))},
                             "listed": [], "step": 10},
              unmeasured.state_key: {"files": {}, "listed": [], "step": 0}}  # e: a fixed name saved over since
    done, pending = rewind_checkpoints(trainer, before, measured={"train_loss", "val_loss"})
    assert removed == ["c.ckpt", "e.ckpt", "f.ckpt"]  # last.ckpt is dropped from the record, never deleted
    assert set(cb.best_k_models) == {a, b} and cb._last_checkpoint_saved == ""
    assert cb.best_model_path == b and float(cb.best_model_score) == pytest.approx(0.4)
    assert cb.kth_best_model_path == a and float(cb.kth_value) == pytest.approx(0.5)  # 2 kept = save_top_k
    assert pending == [(cb, True), (unmeasured, False)] and len(done) == 2 and "c.ckpt, e.ckpt, f.ckpt" in done[0]
    assert "not re-measured" in done[1] and other.best_k_models == {"x.ckpt": torch.tensor(1.0)}
    assert not hasattr(cb, "saved_last")  # nothing saved before the check's record exists
    save_rewound(trainer, pending)
    assert cb.saved_last and float(cb.saved_topk["train_loss"]) == pytest.approx(0.3)
    assert unmeasured.saved_last and not hasattr(unmeasured, "saved_topk") and not hasattr(other, "saved_last")
    # without a monitor nothing is scored: the files written since the growth are found by listing
    removed.clear()
    plain = Fake(dirpath=tmp_path / "plain", monitor=None, save_top_k=-1)
    (tmp_path / "plain").mkdir()
    for name in ("epoch=0.ckpt", "epoch=1.ckpt", "epoch=2.ckpt", "last.ckpt", "notes.txt"):
        (tmp_path / "plain" / name).write_text("")
    plain.last_model_path = str(tmp_path / "plain" / "last.ckpt")
    trainer.checkpoint_callbacks = [plain]
    listed = [str(tmp_path / "plain" / "epoch=0.ckpt")]
    trainer.ckpt_path = str(tmp_path / "plain" / "epoch=2.ckpt")  # the fit resumed from it: Lightning's rule keeps it
    rewind_checkpoints(trainer, {plain.state_key: {"files": {}, "listed": listed, "step": 5}})
    assert removed == ["epoch=1.ckpt"]
    # without a monitor and with a fixed name, the file existed at the growth and was saved over since
    removed.clear()
    fixed = Fake(dirpath=tmp_path / "plain", monitor=None, filename="latest", save_top_k=1)
    fixed.best_model_path, fixed._last_global_step_saved = str(tmp_path / "plain" / "epoch=0.ckpt"), 30
    trainer.checkpoint_callbacks, trainer.ckpt_path = [fixed], None
    everything = [str(p) for p in sorted((tmp_path / "plain").glob("*.ckpt"))]
    rewind_checkpoints(trainer, {fixed.state_key: {"files": {}, "listed": everything, "step": 5}})
    assert removed == ["epoch=0.ckpt"] and fixed.best_model_path == ""
