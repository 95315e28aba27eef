"""`growtrain measure` says which question it answers (the first-order value of a new block, not
the trial's or the stage fork's) and, on a checkpoint whose fit ended growth, how its verdict
relates to the fit's (read from the growth callback's state in the checkpoint); it measures on the
split the checkpoint was trained with (or refuses), and says why its figures can differ from the
fit's last check (and reproduces them when nothing differs)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from growtrain.experiments.measure import (
    QUESTION,
    MeasureResult,
    differences,
    fit_verdict,
    relation_to_fit,
    run_measure,
)
from growtrain.data import ImageDataModule
from growtrain.module import ImageClassifier
from growtrain.report import saturation_table
from growtrain.saturation import measure_saturation
from tests import helpers as H


def tiny_dm() -> ImageDataModule:
    return ImageDataModule(dataset="synthetic", image_size=8, synthetic_size=400, synthetic_classes=4, probe_size=120,
                           val_size=40, batch_size=32, augment=False)  # fmt: skip


def fit(tmp_path, decision="trial", min_gain=10.0, **kw):
    """A planted fit that ends growth by its decision: min_gain=10 (a tenfold drop of the held-out loss) is
    beyond any block (decision="trial": the first check's trials) and any stage fork of the periodic
    schedule (decision="stage_fork": opened at the first check, judged at the next). Checkpoints every epoch."""
    import lightning as L

    from growtrain import GrowUntilSaturated, Periodic, StageFork, Trial

    L.seed_everything(0)
    if decision == "stage_fork":  # a fork opened at the first check, judged at the next: 10x never pays
        how = {"schedule": Periodic(anneal_epochs=1), "decision": StageFork(min_gain=min_gain)}
    else:
        how = {"schedule": Periodic(every_n_epochs=2, anneal_epochs=1), "decision": Trial(min_gain=min_gain),
               "lr_schedule": "anneal"}
    grow = GrowUntilSaturated(max_growths=3, on_saturated="anneal", verbose=False, **how, **kw)
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_top_k=-1,
                                               every_n_epochs=1, save_on_train_epoch_end=True)  # fmt: skip
    trainer = L.Trainer(max_epochs=20, callbacks=[grow, ckpt], enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path, limit_val_batches=0, logger=False)  # fmt: skip
    model = ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], family="basic",
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=5e-4))  # fmt: skip
    trainer.fit(model, tiny_dm())
    return grow, model, trainer


def _checkpoint(finished, stop_reason, last):
    state = {"finished": finished, "stop_reason": stop_reason, "history": [{"action": "grow"}, last]}
    return {"callbacks": {"ModelCheckpoint{...}": {"best_model_score": 0.1}, "GrowUntilSaturated{'monitor': None}": state}}


def test_the_fits_verdict_is_read_from_the_checkpoint_and_related():
    grow_here = SimpleNamespace(saturated=False, best_site="layer1.1")
    saturated_here = SimpleNamespace(saturated=True, best_site="layer1.1")
    trial = fit_verdict(_checkpoint("saturated", "saturated: no block tried lowers the loss by 1 %", {"trial": {"x": 1}}))
    assert trial == {"finished": "saturated", "stop_reason": "saturated: no block tried lowers the loss by 1 %",
                     "checks": 2, "decided_by": "trial"}  # fmt: skip
    text = relation_to_fit(trial, grow_here)
    assert "stopped growing (saturated: no block tried lowers the loss by 1 %)" in text and "decision='trial'" in text
    assert "grow at layer1.1" in text and "do not contradict" in text
    # the fit's side is a certification that failed, not a measured absence of gain
    assert "The fit could not certify that a trained block lowers the loss by more than min_gain" in text
    assert "measured that" not in text
    assert "This report agrees" in relation_to_fit(trial, saturated_here)
    rule = fit_verdict(_checkpoint("saturated", "why", {"rule": "crossfit"}))
    assert rule["decided_by"] == "crossfit" and "this report's question" in relation_to_fit(rule, grow_here)
    budget = fit_verdict(_checkpoint("budget", "max_growths=1 reached", {"rule": "crossfit"}))
    assert "at a budget (max_growths=1 reached), not at a verdict on depth" in relation_to_fit(budget, grow_here)
    running = fit_verdict(_checkpoint(None, None, {"rule": "crossfit"}))
    assert "had not ended growth (2 check(s))" in relation_to_fit(running, grow_here)
    assert fit_verdict({"callbacks": {}}) is None and relation_to_fit(None, grow_here) is None


@pytest.mark.parametrize("decision, how", [
    ("trial", "block-only trials (decision='trial')"),
    ("stage_fork", "the paired stage fork (decision='stage_fork')"),
])  # fmt: skip
def test_measure_on_a_fit_that_ended_growth_says_how_the_verdicts_relate(tmp_path, decision, how):
    """A planted fit ends growth by its decision (nothing pays min_gain=10); measure on its last.ckpt
    names its question, the fit's verdict and the decision that made it, and how the two relate: the
    fit's side a certification that failed, never the first-order question this report answers."""
    grow, _, _ = fit(tmp_path, decision=decision)
    key = "fork" if decision == "stage_fork" else decision  # the check record's entry
    assert grow.finished == "saturated" and key in grow.history[-1]
    assert grow.history[-1]["rule"] == "crossfit"  # the first-order rule that only chose the sites
    result = run_measure(ImageClassifier(width=4, num_classes=4), tiny_dm(),
                         ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"), output_dir=tmp_path / "measure")  # fmt: skip
    assert result.fit == {"finished": "saturated", "stop_reason": grow.stop_reason, "checks": len(grow.history),
                          "decided_by": key}  # fmt: skip
    caption = result.caption()
    assert QUESTION in caption and "first-order value of one new zero-output block" in caption
    assert f"stopped growing ({grow.stop_reason}); it decided by " in caption and how in caption
    assert "the first-order crossfit rule" not in caption  # not this report's question
    if result.report.saturated:
        mine = "This report agrees"
    else:
        mine = f"This report says grow at {result.report.best_site}"
        assert "the two do not contradict each other" in caption
    assert mine in caption
    saved = json.loads((tmp_path / "measure" / "measure.json").read_text())
    assert saved["question"] == QUESTION and saved["fit"] == result.fit and mine in saved["relation_to_fit"]
    assert QUESTION in (tmp_path / "measure" / "measure.md").read_text()


@pytest.mark.parametrize("rule, words", [
    ("paper", "no certified first-order gain (Γ̂ ≤ δ+t: rules out Γ ≥ δ+2t only)"),
    ("crossfit", "no certified first-order gain (no site's lower bound above δ)"),
])  # fmt: skip
def test_a_first_order_stop_is_reported_as_no_certified_gain_never_saturated(rule, words):
    """A first-order stop is a statistic that did not clear its margin, not an upper bound on a block's
    gain: measure's caption, its markdown, its relation to a running fit and the rich table's title say
    "no certified first-order gain" (the paper's rule: what Γ̂ ≤ δ+t rules out), never "saturated"."""
    net, batches = H.make_net("generic", seed=0), H.probe_batches("generic", n=40, batch=8)
    report = measure_saturation(net, batches, H.loss_fn, delta=1e6, rule=rule, seed=7)  # no δ is ever cleared
    assert report.saturated and not any(v.certified for v in report.verdicts.values())
    result = MeasureResult(report=report, dims={})
    assert f"{rule} rule: {words} — Γ̂=" in result.caption() and f"{rule} rule: {words} — Γ̂=" in result.markdown()
    running = relation_to_fit({"finished": None, "checks": 2}, report)
    assert running.endswith(f"this report says: {words}.")
    title = str(saturation_table(report).title)
    assert f"({rule} rule): [bold]{words}[/]" in title
    for text in (result.caption(), result.markdown(), running, title):
        assert "saturated" not in text.lower(), text
    grow = measure_saturation(net, batches, H.loss_fn, delta=0.0, t=1e-12, rule="paper", seed=7)
    assert not grow.saturated and f"grow at {grow.best_site}" in MeasureResult(report=grow, dims={}).caption()


# -- the split the checkpoint was trained with, and the fit's last check -----------------------------------
def _dm(seed: int = 0):
    dm = tiny_dm()
    dm.seed = seed  # the split's seed only (the images of the synthetic set stay the same)
    return dm


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A fit whose only check (check 0, candidates seeded 2·1000 + 0) finds nothing certified above a
    huge δ and stops at once: last.ckpt, saved after the check at the same step, holds the network it measured."""
    import lightning as L

    from growtrain import GrowUntilSaturated, Periodic

    tmp = tmp_path_factory.mktemp("stopped")
    L.seed_everything(0)
    grow = GrowUntilSaturated(schedule=Periodic(every_n_epochs=2), rule="crossfit", decision="rule", delta=1e3, seed=2,
                              on_saturated="stop", verbose=False)  # fmt: skip
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp / "ckpt", save_last=True, save_on_train_epoch_end=True)
    trainer = L.Trainer(max_epochs=6, callbacks=[grow, ckpt], enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp, limit_val_batches=0, logger=False, limit_train_batches=3)  # fmt: skip
    trainer.fit(ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], family="basic"), tiny_dm())
    (last,) = grow.history
    assert last["action"] == "saturated" and last["step"] == trainer.global_step
    return tmp, str(tmp / "ckpt" / "last.ckpt"), last


def test_measure_reproduces_the_fits_last_check_when_nothing_differs(stopped):
    """The same network, the check's candidate seed, level, rule and δ: no reason listed, and Γ̂, δ+t
    and the lower bounds are the check's exactly. Another seed: that one reason, and another Γ̂."""
    _, path, last = stopped
    same = run_measure(ImageClassifier(width=4, num_classes=4), _dm(), ckpt_path=path, seed=2000, delta=1e3,
                       fit_growth={"seed": 2, "precision": "32-true"})  # fmt: skip
    assert same.differences == [] and same.last_check["check"] == 0
    assert (same.report.gamma, same.report.threshold) == (last["gamma"], last["threshold"])
    assert max(r.lower for r in same.report.sites) == last["lower"]
    assert "Same network, candidate blocks, calibration, precision, level, t, rule and δ: the figures agree" in \
        same.caption()  # fmt: skip
    other = run_measure(ImageClassifier(width=4, num_classes=4), _dm(), ckpt_path=path, seed=0, delta=1e3,
                        fit_growth={"seed": 2, "precision": "32-true"})  # fmt: skip
    (reason,) = other.differences
    assert reason.startswith("candidate blocks: that check drew them with seed 2000 (GrowUntilSaturated's seed 2 × "
                             "1000 + check 0), this report with seed=0") and "(seed=2000 draws that check's)" in reason
    assert other.report.gamma != last["gamma"]
    assert f"They can differ: (1) {reason}." in other.caption() and other.to_dict()["differences"] == [reason]


def test_differences_names_each_reason_that_applies():
    """Trained after the check, grown there, another seed, level, t, rule, δ: each listed when (and only
    when) it applies."""
    base = {"check": 3, "step": 50, "checkpoint_step": 50, "alpha": 0.05, "error_bound": 0.05, "t": 0.4,
            "rule": "crossfit", "delta": 0.0, "action": "saturated", "sites": []}  # fmt: skip
    report = SimpleNamespace(alpha=0.05, rule="crossfit", delta=0.0)
    same = dict(seed=3003, fit_growth={"seed": 3})  # what a fit records now (growtrain.trainer's measure)
    assert differences(base, report, **same) == []
    cases = {
        "trained on for 30 optimizer step(s) (the check at step 50, this checkpoint at step 80": {
            "checkpoint_step": 80},
        "that check then grew the network at layer2.1": {"action": "grow", "sites": ["layer2.1"]},
        "level: that check tested at α=0.0125": {"alpha": 0.0125, "error_bound": 0.0125},
        "t: that check's was given (t=1e-06, the callback's t), this report's derived from alpha": {
            "t": 1e-6, "error_bound": 1.0},
        "rule: that check's was 'paper', this report's 'crossfit'": {"rule": "paper"},
        "δ: that check's was 0.1, this report's 0: δ+t differs": {"delta": 0.1},
    }  # fmt: skip
    for text, change in cases.items():
        (reason,) = differences(base | change, report, **same)
        assert reason.startswith(text) or text in reason, (text, reason)
    (seeded,) = differences(base, report, seed=0)  # the callback's seed unknown: its formula
    assert "seed = GrowUntilSaturated's seed × 1000 + 3 (check 3), this report with seed=0" in seeded
    (mixed,) = differences(base, report, seed=3003, fit_growth={"seed": 3, "precision": "bf16-mixed"})
    assert mixed.startswith("precision: the fit's checks ran the probe under autocast (precision=bf16-mixed)")
    assert differences(base, report, seed=3003, fit_growth={"seed": 3, "precision": "32-true"}) == []
    (given,) = differences(base, report, t=0.2, **same)
    assert given == "t: that check derived t from its level, this report's is given (t=0.2): δ+t differs"


def test_measure_refuses_a_split_other_than_the_checkpoints(stopped, tmp_path):
    """A datamodule seeded 7 for a checkpoint trained on seed 0: an error naming the argument, what was
    expected and given and the fix, before the weights or the data are loaded or anything is written;
    allow_other_split=True measures anyway, with a warning, and the report says its figures are not held-out."""
    _, path, _ = stopped
    model, dm = ImageClassifier(width=4, num_classes=4), _dm(seed=7)
    before = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    with pytest.raises(ValueError) as caught:
        run_measure(model, dm, ckpt_path=path, output_dir=tmp_path / "measure")
    assert str(caught.value) == (
        f"data.init_args.seed: expected seed=0, the split {path!r} was trained with; got seed=7: the probe is carved "
        "out of the training images by that split, so this one can hold images the network trained on and the report "
        "would not be a held-out measurement. Fix: pass --data.init_args.seed=0 (in Python: the datamodule with "
        "seed=0); or allow_other_split=True (--allow_other_split=true) to measure on this split anyway."
    )  # fmt: skip
    assert dm._data is None and not (tmp_path / "measure").exists()  # nothing loaded, nothing written
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items() if torch.is_tensor(v))
    with pytest.warns(UserWarning, match=r"allow_other_split: measuring .*, trained with seed=0, on the split seed=7"):
        result = run_measure(model, dm, ckpt_path=path, allow_other_split=True)
    assert result.split == {"checked": True, "checkpoint": result.split["checkpoint"], "measured": dm._split_key(),
                            "differs": ["seed"]}  # fmt: skip
    assert result.split["checkpoint"]["seed"] == 0
    assert ("Another split than the checkpoint's (allow_other_split; seed: checkpoint 0, here 7): this probe can hold "
            "images the network trained on, so these figures are not held-out.") in result.caption()  # fmt: skip
    assert run_measure(ImageClassifier(width=4, num_classes=4), _dm(), ckpt_path=path).split["differs"] == []


def test_a_checkpoint_without_a_split_is_measured_and_says_so(stopped, tmp_path):
    _, path, _ = stopped
    checkpoint = torch.load(path, weights_only=True)
    for key in ("ImageDataModule", "datamodule_hyper_parameters", "datamodule_hparams_name"):
        checkpoint.pop(key)
    torch.save(checkpoint, tmp_path / "bare.ckpt")
    result = run_measure(ImageClassifier(width=4, num_classes=4), _dm(seed=7), ckpt_path=str(tmp_path / "bare.ckpt"))
    assert result.split["checked"] is False
    assert ("Split not checked: the checkpoint records no data split (no datamodule state or hyper-parameters); "
            "whether this probe was held out from the network's training is unknown.") in result.caption()
