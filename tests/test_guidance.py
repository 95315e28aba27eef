"""A newcomer never wonders what happened: a fit with no check says why, the default
monitor works on a module that logs nothing, a missing metric is named, every fit says where its
outputs are, options that do nothing are warned about."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.nn import functional as F
from torch.utils.data import DataLoader, Subset

from growtrain import Converged, GrowUntilSaturated, Periodic, StageFork, Trial
from growtrain.callbacks import GammaTracePlot, guidance, telemetry
from growtrain.data import ImageDataModule
from growtrain.module import ImageClassifier
from tests.test_callback import UserModule, _blobs


def _dm(**kw) -> ImageDataModule:
    args = dict(dataset="synthetic", image_size=8, synthetic_size=200, synthetic_classes=4, probe_size=40,
                val_size=20, batch_size=32, augment=False)  # fmt: skip
    return ImageDataModule(**(args | kw))


def _trainer(tmp_path, callbacks, max_epochs=2, **kw) -> L.Trainer:
    args = dict(max_epochs=max_epochs, callbacks=callbacks, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                default_root_dir=tmp_path, accelerator="cpu")  # fmt: skip
    return L.Trainer(**(args | kw))


def _printed(monkeypatch) -> list[str]:
    out: list[str] = []
    monkeypatch.setattr(telemetry, "print_renderable", lambda trainer, r, **kw: out.append(_text(r)))
    return out


def _text(renderable) -> str:
    if isinstance(renderable, str):
        return renderable
    import io

    from rich.console import Console

    buffer = io.StringIO()
    Console(file=buffer, width=300, color_system=None).print(renderable)
    return buffer.getvalue()


# -- a fit with no check says so, with the reason and the fix -----------------------------------------
def test_a_fit_without_a_check_warns_and_its_summary_says_why(tmp_path, monkeypatch):
    printed = _printed(monkeypatch)
    grow = GrowUntilSaturated(schedule=Converged(patience=5, min_stage_epochs=2), decision="rule")
    with pytest.warns(UserWarning, match=r"no growth check ran in this fit of 2 epoch\(s\)") as caught:
        _trainer(tmp_path, [grow]).fit(ImageClassifier(width=4, in_channels=3, num_classes=4), _dm())
    message = next(str(w.message) for w in caught if "no growth check ran" in str(w.message))
    assert "monitor='train_loss' never plateaued: best " in message
    assert "a plateau needs patience=5 epochs in a row without an improvement larger than min_rel_delta×|best|" in message
    assert "(min_stage_epochs=2)" in message
    assert "no growth_history.json or gamma_trace.png was written" in message
    assert "Fix: train longer (trainer.max_epochs or max_steps)" in message
    assert "a smaller Converged.patience (now 5)" in message and "schedule=Periodic(every_n_epochs=N)" in message
    assert grow.history == [] and not (tmp_path / "growth_history.json").exists()
    (summary,) = printed
    assert "no growth check ran" in summary and "never plateaued" in summary
    assert "Fix:" not in summary and "the warning above says what to change" in summary  # said once, in the warning
    assert "stopped growing" not in summary  # no empty table and no misleading "had not ended"


def test_no_check_message_without_a_monitor_names_every_n_epochs():
    text = guidance.no_check_message(schedule=Periodic(every_n_epochs=5), best=None, wait=0, stage_epochs=2, epochs=2,
                                     waiting="next check in 3 epoch(s)")  # fmt: skip
    assert "every_n_epochs=5 is more than the 2 training epoch(s)" in text and "next check in 3 epoch(s)" in text
    assert "a smaller Periodic.every_n_epochs" in text and "patience" not in text


@pytest.mark.parametrize("interval", [{"every_n_epochs": 5}, {"min_steps_between_checks": 1000}])
def test_a_periodic_fit_without_a_check_names_its_interval_not_a_monitor(tmp_path, interval):
    """The periodic schedule never consults the monitor: a fit too short for its first check says
    which interval was too long (in epochs, or in optimizer steps), with the fix."""
    grow = GrowUntilSaturated(schedule=Periodic(**interval), verbose=False)
    with pytest.warns(UserWarning, match=r"no growth check ran in this fit of 2 epoch\(s\)") as caught:
        trainer = _trainer(tmp_path, [grow])
        trainer.fit(ImageClassifier(width=4, in_channels=3, num_classes=4), _dm())
    message = next(str(w.message) for w in caught if "no growth check ran" in str(w.message))
    assert "never plateaued" not in message and "monitor" not in message
    if "every_n_epochs" in interval:
        assert "every_n_epochs=5 is more than the 2 training epoch(s)" in message
        assert "next check in 3 epoch(s)" in message and "a smaller Periodic.every_n_epochs" in message
    else:
        steps = trainer.global_step
        assert f"min_steps_between_checks=1000 is more than the {steps} optimizer step(s) of this fit" in message
        assert f"next check after {1000 - steps} more optimizer step(s)" in message
        assert "a smaller Periodic.min_steps_between_checks" in message


# -- the default monitor works on any LightningModule --------------------------------------------------
def test_default_monitor_uses_the_loss_training_step_returns(tmp_path, caplog):
    """UserModule logs nothing: its returned loss is the default monitor's signal, and checks run."""
    ds = _blobs()
    train = DataLoader(Subset(ds, range(0, 160)), batch_size=32, shuffle=True)
    probe = DataLoader(Subset(ds, range(160, 240)), batch_size=40)
    L.seed_everything(0)
    module = UserModule()
    # min_rel_delta=0.9: an epoch that does not cut the loss by 90 % is no improvement, so a plateau
    # after patience=1 epoch; the check needs the monitor's value at every epoch end.
    grow = GrowUntilSaturated(probe=probe, network="trunk", loss_fn=F.cross_entropy,
                              schedule=Converged(patience=1, min_rel_delta=0.9, min_stage_epochs=1), max_growths=1,
                              decision="rule", lr_schedule="continue", verbose=False)  # fmt: skip
    with caplog.at_level("INFO", logger="lightning.pytorch"):  # other tests raise that logger's level
        _trainer(tmp_path, [grow], max_epochs=3).fit(module, train)
    assert len(grow.history) >= 1 and grow.history[0]["epoch"] == 1
    assert "monitoring the epoch mean of the loss training_step returns" in caplog.text


def test_returned_loss_mean_is_the_epoch_mean():
    grow = GrowUntilSaturated(schedule="converged", verbose=False)
    for loss in (1.0, 2.0, 6.0):
        grow.on_train_batch_end(None, None, {"loss": torch.tensor(loss)}, None, 0)
    assert float(grow._monitor._returned_loss(type("T", (), {"world_size": 1})())) == pytest.approx(3.0)
    grow.on_train_epoch_start(type("T", (), {})(), None)  # a new epoch starts a new mean
    assert grow._monitor._returned_loss(None) is None


def test_a_metric_asked_for_and_never_logged_is_an_error_naming_it(tmp_path):
    grow = GrowUntilSaturated(schedule=Converged(monitor="val_loss"), verbose=False, decision="rule")
    with pytest.raises(RuntimeError) as info:
        _trainer(tmp_path, [grow], max_epochs=1).fit(ImageClassifier(width=4, in_channels=3, num_classes=4), _dm())
    text = str(info.value)
    assert text.startswith("monitor: metric 'val_loss' is not logged; available: [")
    assert "self.log('val_loss', value, on_epoch=True)" in text and "'train_loss'" not in text.split("Fix:")[1]
    assert "validation runs every epoch" in text


# -- options that would do nothing -----------------------------------------------------------------------
def test_an_interval_beside_a_monitor_cannot_be_given():
    """An interval under a plateau schedule would do nothing (it was a warning while both were flat options):
    Converged has no interval field and Periodic no monitor, so the combination is Python's TypeError."""
    with pytest.raises(TypeError, match="every_n_epochs"):
        Converged(every_n_epochs=3)
    with pytest.raises(TypeError, match="monitor"):
        Periodic(monitor="val_loss")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert GrowUntilSaturated(schedule=Periodic(every_n_epochs=3), decision="trial").schedule.every_n_epochs == 3
        assert GrowUntilSaturated(schedule="periodic").schedule.every_n_epochs == 1


# -- every fit says where its outputs are ----------------------------------------------------------------
def test_summary_says_where_the_outputs_are(tmp_path, monkeypatch):
    printed = _printed(monkeypatch)
    grow = GrowUntilSaturated(schedule="periodic", decision="rule", max_growths=0)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_last=True)
    trainer = _trainer(tmp_path, [grow, ckpt, GammaTracePlot()], max_epochs=1, enable_checkpointing=True,
                       logger=CSVLogger(tmp_path, name="logs"), log_every_n_steps=1)  # fmt: skip
    trainer.fit(ImageClassifier(width=4, in_channels=3, num_classes=4), _dm())  # warns of nothing (the suite's filters)
    summary = printed[-1]  # after the check's table
    log_dir = trainer.log_dir
    assert f"outputs: {log_dir}/ (metrics.csv, growth_history.json, gamma_trace.png)" in summary
    assert f"checkpoints: {tmp_path / 'ckpts'}/" in summary and "last.ckpt" in summary
    assert (tmp_path / "logs" / "version_0" / "growth_history.json").exists()


def test_summary_says_which_checkpoint_holds_the_network_handed_over(tmp_path, monkeypatch):
    """The quickstart keeps best_train.ckpt and last.ckpt: the summary says last.ckpt holds the
    network the fit handed over (checked: its weights are the model's at the end) and that
    best_train is the lowest-train_loss save, possibly an earlier, shallower network."""
    printed = _printed(monkeypatch)
    grow = GrowUntilSaturated(schedule="periodic", decision="rule", max_growths=0)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpts", filename="best_train", monitor="train_loss", mode="min",
                           save_top_k=1, save_last=True, save_on_train_epoch_end=True)  # fmt: skip
    trainer = _trainer(tmp_path, [grow, ckpt], max_epochs=2, enable_checkpointing=True)
    model = ImageClassifier(width=4, in_channels=3, num_classes=4)
    trainer.fit(model, _dm())
    (line,) = [x for x in guidance.output_lines(trainer, history_path=None, history_written=False)
               if x.startswith("checkpoints:")]  # fmt: skip
    step = trainer.global_step
    assert line == (f"checkpoints: {tmp_path / 'ckpts'}/ (best_train.ckpt, last.ckpt): last.ckpt holds the network "
                    f"this fit handed over (saved at its last step, {step}); best_train.ckpt holds the save with the "
                    "lowest train_loss, which may be an earlier, shallower network")  # fmt: skip
    assert line in " ".join(printed[-1].split())  # the printed summary carries it (unwrapped)
    saved = torch.load(tmp_path / "ckpts" / "last.ckpt", weights_only=True)["state_dict"]
    assert saved.keys() == model.state_dict().keys()
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items() if torch.is_tensor(v))


def test_summary_says_when_no_checkpoint_holds_the_network_handed_over():
    """A ModelCheckpoint whose last save came before the fit's last step (every_n_epochs, a top-k that
    did not improve) holds no copy of the final network: said, with both steps."""
    from types import SimpleNamespace

    cb = SimpleNamespace(best_model_path="/c/best.ckpt", last_model_path="", _last_checkpoint_saved="/c/best.ckpt",
                         _last_global_step_saved=40, monitor="val_loss", mode="max")  # fmt: skip
    trainer = SimpleNamespace(checkpoint_callbacks=[cb], global_step=60, loggers=[], callbacks=[])
    assert guidance.output_lines(trainer, history_path=None, history_written=False) == [
        "checkpoints: /c/ (best.ckpt): none holds the network this fit handed over: the last save was at step 40, the "
        "fit ended at step 60; best.ckpt holds the save with the highest val_loss, which may be an earlier, shallower "
        "network"
    ]  # fmt: skip
    cb._last_global_step_saved = 60  # saved at the last step, no save_last: the file just saved holds it
    roles = guidance.checkpoint_roles(trainer, cb)
    assert roles == "best.ckpt holds the network this fit handed over (saved at its last step, 60)"


# -- gamma_trace.png shows what decided ------------------------------------------------------------------
def _history():
    """The first check decided by the first-order rule (no trial record), the later ones by block-only trials."""
    def trial(site, gain, lower):
        tried = {"site": site, "gain_frac": gain, "lower_frac": lower, "upper_frac": gain + 0.02, "diverged": False}
        return {"lower_frac": lower, "min_gain": 0.01, "trials": [tried], "saturated": lower <= 0.01}

    return [
        {"epoch": 3, "step": 40, "gamma": 0.2, "threshold": 0.6, "lower": 0.05, "margin": 0.0, "rule": "crossfit",
         "action": "grow", "site": "layer1.1", "sites": ["layer1.1"]},
        {"epoch": 9, "step": 120, "gamma": 0.15, "threshold": 0.7, "lower": 0.0, "margin": 0.0, "rule": "crossfit",
         "action": "grow", "site": "layer2.1", "sites": ["layer2.1"], "trial": trial("layer2.1", 0.08, 0.03)},
        {"epoch": 15, "step": 200, "gamma": 0.1, "threshold": 0.8, "lower": 0.01, "margin": 0.0, "rule": "crossfit",
         "action": "saturated", "site": None, "sites": [], "trial": trial("layer1.2", -0.01, -0.02)},
    ]  # fmt: skip


def _points(ax):
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}


def test_gamma_trace_draws_the_deciding_quantities(tmp_path):
    from growtrain.plots import plot_gamma_trace

    fig = plot_gamma_trace(_history(), tmp_path / "trace.png")
    trials, first, paper = fig.axes  # the trials decided the later checks: on top
    lines = _points(first)
    # the first check was decided by its lower bound (filled); later ones only report it (hollow)
    assert lines["best certified lower bound (decided)"] == ([3], [0.05])
    assert lines["best certified lower bound (reported)"] == ([9, 15], [0.0, 0.01])
    assert lines["threshold δ: grow above"] == ([3, 9, 15], [0.0, 0.0, 0.0])
    lines = _points(trials)
    assert lines["best tried block: held-out gain (estimate)"] == ([9, 15], [0.08, -0.01])
    assert lines["its certified lower bound (decided)"] == ([9, 15], [0.03, -0.02])
    assert lines["min_gain: grow when the bound is above"] == ([9, 15], [0.01, 0.01])
    assert _points(paper)[r"$\hat\Gamma$ (paper)"] == ([3, 9, 15], [0.2, 0.15, 0.1])
    assert all(float(t).is_integer() for t in paper.get_xticks())
    assert paper.get_xlabel().startswith("epoch")
    assert (tmp_path / "trace.png").read_bytes()[:4] == b"\x89PNG"


def test_gamma_trace_of_one_check_has_whole_epoch_ticks():
    from growtrain.plots import plot_gamma_trace

    fig = plot_gamma_trace(_history()[:1])
    assert len(fig.axes) == 2  # no trial panel: the first-order rule decided
    assert fig.axes[-1].get_xlim() == (2.0, 4.0)
    assert all(float(t).is_integer() for t in fig.axes[-1].get_xticks())


def test_gamma_trace_with_the_paper_rule_draws_gamma_against_delta_plus_t():
    from growtrain.plots import plot_gamma_trace

    history = [dict(h, rule="paper") for h in _history()[:1]]
    lines = _points(plot_gamma_trace(history).axes[0])
    assert lines[r"$\hat\Gamma$ (decided)"] == ([3], [0.2]) and lines[r"$\delta+t$: grow above"] == ([3], [0.6])


def test_the_stopping_experiments_scratch_rule_keeps_the_schedule_and_does_not_warn():
    from growtrain.experiments.stopping import _scratch_grower

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scratch = _scratch_grower(GrowUntilSaturated(schedule=Converged(monitor="val_loss"), decision="rule"))
        fixed = _scratch_grower(GrowUntilSaturated(schedule=Periodic(every_n_epochs=3), decision="rule"))
    assert (scratch.schedule, scratch.max_growths) == (Converged(monitor="val_loss"), 0)
    assert (fixed.schedule, fixed.max_growths) == (Periodic(every_n_epochs=3), 0)


def test_the_stopping_experiments_rules_keep_a_step_interval():
    """A growth callback counting optimizer steps (min_steps_between_checks) is rebuilt for the seeded
    growth rows and the scratch rows with its interval (its schedule passes as the part it is)."""
    from growtrain.experiments.stopping import _scratch_grower, _seeded_grower

    grow = GrowUntilSaturated(schedule=Periodic(min_steps_between_checks=890), on_saturated="anneal")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        seeded, scratch = _seeded_grower(grow, 2), _scratch_grower(grow)
    for rebuilt in (seeded, scratch):
        assert (rebuilt.schedule, rebuilt.decision) == (Periodic(min_steps_between_checks=890), StageFork())
        assert rebuilt._schedule.min_steps_between_checks == 890
    assert (seeded.seed, scratch.max_growths) == (2, 0)


def test_the_stopping_experiments_seeded_growth_rule_keeps_the_schedule_and_does_not_warn():
    from growtrain.experiments.stopping import _seeded_grower

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        grow = _seeded_grower(GrowUntilSaturated(schedule=Converged(monitor="val_loss"), decision="rule"), 7)
        fixed = _seeded_grower(GrowUntilSaturated(schedule=Periodic(every_n_epochs=3), decision="rule"), 7)
    assert (grow.seed, grow.config.seed, grow.schedule) == (7, 7, Converged(monitor="val_loss"))
    assert (fixed.seed, fixed.schedule) == (7, Periodic(every_n_epochs=3))
    # the trial collaborator is built from the seeded options (its blocks follow the run's seed)
    trial = _seeded_grower(GrowUntilSaturated(schedule=Converged(monitor="val_loss"),
                                              decision=Trial(min_gain=0.01, epochs=0.25)), 7)
    assert (trial._trials.seed, trial._trials.epochs, trial._trials.sites) == (7, 0.25, 3)
    assert trial.decision == Trial(min_gain=0.01, epochs=0.25)


def test_resume_false_says_it_discards_earlier_rows(tmp_path):
    from growtrain.experiments.runs import RunLog

    log = RunLog(tmp_path / "runs.jsonl", "fp")
    log.add("a", {"x": 1})
    log.add("b", {"x": 2})
    with pytest.warns(UserWarning, match=r"resume=False discards the 2 earlier result row\(s\) in .*runs\.jsonl"):
        fresh = RunLog(tmp_path / "runs.jsonl", "fp", resume=False)
    assert fresh.rows == {} and not (tmp_path / "runs.jsonl").exists()


def test_the_default_trial_decision_does_not_warn_about_the_probe(tmp_path):
    """The default decision scores a trial block's paired gain on the probe, whose per-sample
    differences spread 2–10× less than the removed stage-gain decision's: that decision's
    small-probe warning does not apply (a newcomer's first run is quiet)."""
    import warnings

    grow = GrowUntilSaturated(schedule="periodic", decision=Trial(min_gain=0.01), verbose=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            _trainer(tmp_path, [grow], max_epochs=1, limit_train_batches=0).fit(
                ImageClassifier(width=4, in_channels=3, num_classes=4), _dm())
        except Exception:
            pass
    assert not [w for w in caught if "not detectable" in str(w.message)]


class _FirstStep(L.Callback):
    """Records the warnings given before the first training step."""

    def __init__(self):
        self.before: list[str] | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.before is None:
            self.before = [str(w.message) for w in self.caught]


@pytest.mark.parametrize("schedule, epochs, need", [
    (Converged(min_stage_epochs=1, patience=1, min_rel_delta=0.99), 11, 12),  # a plateau by epoch 2, a 10-epoch anneal
    (Periodic(every_n_epochs=5), 4, 5),
])  # fmt: skip
def test_a_fit_too_short_for_one_check_says_so_before_the_first_step(tmp_path, schedule, epochs, need):
    """The earliest check is exact: one epoch short of it warns before training, naming the fix; a fit
    that can just reach it is silent and makes its check in the last epoch."""
    import warnings

    for max_epochs in (epochs, need):
        first = _FirstStep()
        grow = GrowUntilSaturated(schedule=schedule, decision="rule", verbose=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first.caught = caught
            _trainer(tmp_path, [grow, first], max_epochs=max_epochs, limit_train_batches=2).fit(
                ImageClassifier(width=4, in_channels=3, num_classes=4), _dm())
        said = [w for w in first.before if "the first check cannot come before" in w]
        if max_epochs < need:
            assert len(said) == 1 and f"max_epochs={max_epochs} leaves {max_epochs} epoch(s)" in said[0]
            assert f"Fix: raise max_epochs to allow {need} epoch(s)" in said[0] and grow.history == []
        else:
            assert said == [] and [h["epoch"] for h in grow.history][:1] == [need - 1]


def test_a_fit_too_short_for_one_check_and_its_final_anneal_says_so_before_the_first_step(tmp_path):
    """on_saturated='anneal' reserves the final anneal: every_n_epochs=5 and anneal_epochs=3 need 8 epochs;
    7 warns before training (naming the anneal's share and 8), 8 is silent and checks in epoch 5."""
    import warnings

    for max_epochs in (7, 8):
        first = _FirstStep()
        grow = GrowUntilSaturated(schedule=Periodic(every_n_epochs=5, anneal_epochs=3), decision="rule",
                                  on_saturated="anneal", verbose=False)  # fmt: skip
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first.caught = caught
            _trainer(tmp_path, [grow, first], max_epochs=max_epochs, limit_train_batches=2).fit(
                ImageClassifier(width=4, in_channels=3, num_classes=4), _dm())
        said = [w for w in first.before if "the first check cannot come before" in w]
        if max_epochs == 7:
            assert len(said) == 1 and "max_epochs=7 leaves 7 epoch(s)" in said[0] and "and 3 for the final anneal" in said[0]
            assert "Fix: raise max_epochs to allow 8 epoch(s)" in said[0]
        else:
            assert said == [] and [h["epoch"] for h in grow.history][:1] == [4]
