"""The stopping experiment (growth runs beside a scratch sweep) and the final anneal."""

from __future__ import annotations

import json
import math

import lightning as L
import pytest
import torch

from growtrain.callbacks import Converged, GrowUntilSaturated, Periodic, StageFork, Trial
from growtrain.data import ImageDataModule
from growtrain.experiments.stopping import run_stopping, smallest_good_depth
from growtrain.module import ImageClassifier, ScaledLossClassifier


def tiny_dm(**kw) -> ImageDataModule:
    args = dict(dataset="synthetic", image_size=8, synthetic_size=400, synthetic_classes=4, probe_size=120,
                val_size=40, batch_size=32, augment=False)  # fmt: skip
    return ImageDataModule(**(args | kw))


def test_smallest_good_depth_is_within_one_standard_error_of_the_best():
    by_depth = {0: [0.60, 0.62], 1: [0.50, 0.54], 2: [0.49, 0.51], 3: [0.495, 0.505]}
    d_star, best = smallest_good_depth(by_depth)
    # best: depth 2 (mean 0.50, sd 0.0141, se 0.01); depth 1's mean 0.52 > 0.51, depth 3 is deeper
    assert (d_star, best) == (2, 2)
    by_depth[1] = [0.50, 0.52]  # mean 0.51 ≤ 0.51: now depth 1 is good enough
    assert smallest_good_depth(by_depth) == (1, 2)


def test_anneal_finishes_the_network_then_stops(tmp_path):
    """on_saturated="anneal": once growth ends, the lr follows a cosine to 0 over anneal_epochs,
    the user's scheduler is set aside, and the fit stops after exactly that many epochs."""
    L.seed_everything(0)
    lrs = []

    class RecordLR(L.Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    grow = GrowUntilSaturated(schedule=Periodic(every_n_epochs=2, anneal_epochs=3), decision="trial", max_growths=0,
                              on_saturated="anneal", verbose=False)  # fmt: skip
    trainer = L.Trainer(max_epochs=20, callbacks=[grow, RecordLR()], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)  # fmt: skip
    model = ImageClassifier(width=4, num_classes=4, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                            lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5))  # fmt: skip
    trainer.fit(model, tiny_dm())
    assert trainer.current_epoch == 5  # 2 epochs, the check ends growth (budget), 3 anneal epochs
    assert grow.finished == "budget" and grow.final_epochs == 3
    base = lrs[2 - 1] * 0.5  # the StepLR halved the lr after epoch 1 (the check is at the end of epoch 1)
    expected = [base * 0.5 * (1 + math.cos(math.pi * (k + 1) / 4)) for k in range(3)]
    assert lrs[2:] == pytest.approx(expected)
    assert lrs[-1] < 0.2 * lrs[2]


def test_stopping_experiment_rows_resume_and_summary(tmp_path):
    L.seed_everything(0)
    model = ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], family="basic")
    # the paper's rule with a negligible t grows at the first check; the second is refused by the budget
    grow = GrowUntilSaturated(schedule=Periodic(every_n_epochs=1, anneal_epochs=1), rule="paper", t=1e-12,
                              decision="rule", max_growths=1, on_saturated="anneal", verbose=False)  # fmt: skip
    kwargs = dict(max_epochs=4, callbacks=[grow], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, limit_val_batches=0)  # fmt: skip
    result = run_stopping(model, tiny_dm(), trainer_kwargs=kwargs, depths=[0, 1], seeds=[0], output_dir=tmp_path)
    growth = result.growth[0]
    assert growth["growths"] == 1 and growth["depth"] == 1 and growth["stopped"] == "budget"
    # each check's "certified" is kept with the row: the caption's words for its stop come from it
    assert [(h["action"], h["certified"]) for h in growth["history"]] == [("grow", False), ("budget", False)]
    assert {r["depth"] for r in result.scratch} == {0, 1}
    assert all(r["growths"] == 0 and r["stopped"] == "budget" for r in result.scratch)  # same rule, no growth
    summary = json.loads((tmp_path / "stopping.json").read_text())["summary"]
    # one seed: d* is the depth with the lowest test loss (a tie goes to the smaller depth); the
    # growth's compute is its FLOPs over the whole sweep's, both from the rows themselves
    best = min(result.scratch, key=lambda r: (r["test_loss"], r["depth"]))["depth"]
    assert summary["d_star"] == best
    sweep = sum(r["flops"] for r in result.scratch)
    assert summary["growth"][0]["compute_vs_sweep"] == pytest.approx(growth["flops"] / sweep)
    assert (tmp_path / "stopping.png").stat().st_size > 0
    again = run_stopping(model, tiny_dm(), trainer_kwargs=kwargs, depths=[0, 1], seeds=[0], output_dir=tmp_path)
    assert again.growth[0]["wall_s"] == growth["wall_s"]  # resumed from runs.jsonl, not retrained
    partial = run_stopping(model, tiny_dm(), trainer_kwargs=kwargs, depths=[0, 1, 2], seeds=[0, 1], output_dir=tmp_path,
                           train=False)  # fmt: skip
    assert len(partial.growth) == 1 and {r["depth"] for r in partial.scratch} == {0, 1}  # summarised, nothing trained


def test_an_option_added_later_keys_a_results_folder_only_when_set():
    """Folders written before min_steps_between_checks existed resume: at its default it is not part of
    the options the fingerprint reads; set, it is (a step-counted run is another configuration)."""
    from growtrain.callbacks.growth_config import GrowthConfig
    from growtrain.experiments.stopping import file_options

    epochs = file_options(GrowthConfig(schedule=Periodic(every_n_epochs=2)))
    steps = file_options(GrowthConfig(schedule=Periodic(min_steps_between_checks=890)))
    assert "min_steps_between_checks" not in epochs and steps["min_steps_between_checks"] == 890
    assert set(steps) - set(epochs) == {"min_steps_between_checks"}
    assert not {"probe", "network", "loss_fn", "verbose"} & set(epochs)


# What the code before the options were grouped keyed these configurations by (its file_options, run then:
# the flat options, as validated), written out: folders of results written then must resume.
FLAT_KEYS = [
    ({"schedule": Converged(monitor="val_loss", patience=2, min_rel_delta=0.005, anneal_epochs=3),
      "decision": Trial(min_gain=0.01), "lr_schedule": "anneal", "max_growths": 6, "on_saturated": "anneal"},
     {"alpha": 0.05, "anneal_epochs": 3, "decision": "trial", "delta": 0.0, "every_n_epochs": 1, "lr_schedule": "anneal",
      "max_growths": 6, "max_params": None, "min_gain": 0.01, "min_rel_delta": 0.005, "min_stage_epochs": 2,
      "mode": "min", "monitor": "val_loss", "on_saturated": "anneal", "patience": 2, "rule": "crossfit",
      "schedule": "converged", "seed": 0, "t": None, "trial_epochs": 0.5}),
    ({"schedule": Periodic(min_steps_between_checks=890)},
     {"alpha": 0.05, "anneal_epochs": 10, "decision": "stage_fork", "delta": 0.0, "every_n_epochs": 1,
      "lr_schedule": "continue", "max_growths": None, "max_params": None, "min_gain": 0.01, "min_rel_delta": 0.01,
      "min_stage_epochs": 2, "min_steps_between_checks": 890, "mode": "min", "monitor": "train_loss",
      "on_saturated": "stop", "patience": 3, "rule": "crossfit", "schedule": "periodic", "seed": 0, "t": None,
      "trial_epochs": 0.5}),
    ({"schedule": "converged", "decision": "rule", "rule": "paper", "t": 0.5},
     {"alpha": 0.05, "anneal_epochs": 10, "decision": "rule", "delta": 0.0, "every_n_epochs": 1, "lr_schedule": None,
      "max_growths": None, "max_params": None, "min_gain": None, "min_rel_delta": 0.01, "min_stage_epochs": 2,
      "mode": "min", "monitor": "train_loss", "on_saturated": "stop", "patience": 3, "rule": "paper",
      "schedule": "converged", "seed": 0, "t": 0.5, "trial_epochs": 0.5}),
]  # fmt: skip


@pytest.mark.parametrize("options, flat", FLAT_KEYS)
def test_a_results_folder_keeps_its_key_across_the_grouping_of_the_options(options, flat):
    from growtrain.callbacks.growth_config import GrowthConfig
    from growtrain.experiments.stopping import file_options

    assert file_options(GrowthConfig(**options)) == flat


def test_stopping_experiment_refuses_an_unfinished_growth_arm(tmp_path):
    model = ImageClassifier(width=4, num_classes=4)
    kwargs = dict(max_epochs=1, callbacks=[GrowUntilSaturated(schedule="converged", on_saturated="stop")])
    with pytest.raises(ValueError, match="on_saturated: 'stop' ends the growth run unannealed"):
        run_stopping(model, tiny_dm(), trainer_kwargs=kwargs, depths=[0], seeds=[0], output_dir=tmp_path)
    with pytest.raises(ValueError, match="needs exactly one GrowUntilSaturated"):
        run_stopping(model, tiny_dm(), trainer_kwargs={"max_epochs": 1}, depths=[0], seeds=[0], output_dir=tmp_path)


class RecordLRs(L.Callback):
    """Every param group's lr at the start of each training epoch (what that epoch trains with)."""

    def __init__(self):
        self.lrs: list[list[float]] = []

    def on_train_epoch_start(self, trainer, pl_module):
        self.lrs.append([g["lr"] for g in trainer.optimizers[0].param_groups])


def _stage_anneal_fit(tmp_path, *, grows, max_epochs=20, ckpt_path=None, extra=(), **kw):
    """``grows``: the paper's rule with a negligible t (every check grows, until the budget); else the
    cross-fit rule with a margin δ no lower bound reaches (every check is saturated)."""
    L.seed_everything(0)
    rule = {"rule": "paper", "t": 1e-12} if grows else {"rule": "crossfit", "delta": 1e9}
    grow = GrowUntilSaturated(schedule=Periodic(every_n_epochs=2, anneal_epochs=2), **rule, max_growths=1,
                              decision="rule", lr_schedule="anneal", on_saturated="anneal", verbose=False, **kw)  # fmt: skip
    record = RecordLRs()
    trainer = L.Trainer(max_epochs=max_epochs, callbacks=[grow, record, *extra], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        enable_checkpointing=bool(extra), default_root_dir=tmp_path)  # fmt: skip
    model = ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], family="basic",
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))  # fmt: skip
    trainer.fit(model, tiny_dm(), ckpt_path=ckpt_path)
    return grow, record, trainer


def _cos(k: int, total: int) -> float:
    return 0.5 * (1 + math.cos(math.pi * (k + 1) / (total + 1)))


def test_stage_anneal_checks_the_annealed_network_then_restarts_the_rate(tmp_path):
    """lr_schedule="anneal": a converged stage is annealed, the check sees the annealed network,
    a growth puts every group (old and new) back at the constant rate, and a budget at the next
    due check starts the ordinary final anneal."""
    grow, record, trainer = _stage_anneal_fit(tmp_path, grows=True)
    a, b = 0.1 * _cos(0, 2), 0.1 * _cos(1, 2)
    # epochs 0-1 stage 1; 2-3 its anneal, check → grow; 4-5 stage 2; check → budget; 6-7 final anneal
    firsts = [lrs[0] for lrs in record.lrs]
    assert firsts == pytest.approx([0.1, 0.1, a, b, 0.1, 0.1, a, b])
    assert trainer.current_epoch == 8 and grow.finished == "budget" and grow.growths == 1
    assert all(lr == pytest.approx(0.1) for lr in record.lrs[4])  # the new block's group too
    assert len(record.lrs[4]) >= len(record.lrs[0])
    assert [h.get("annealed", False) for h in grow.history] == [True, False]
    assert grow.history[0]["epoch"] == 3 and grow.history[0]["action"] == "grow"


def test_stage_anneal_saturated_network_is_finished_already(tmp_path):
    """Saturated at the check after a stage anneal: the network is annealed, so the fit stops at
    once (no second anneal), reason "saturated"."""
    grow, record, trainer = _stage_anneal_fit(tmp_path, grows=False)
    assert trainer.current_epoch == 4 and grow.finished == "saturated" and grow.growths == 0
    assert [lrs[0] for lrs in record.lrs] == pytest.approx([0.1, 0.1, 0.1 * _cos(0, 2), 0.1 * _cos(1, 2)])
    assert grow.state_dict()["anneal_done"] is None and grow.final_epochs == 0 and grow.history[0]["annealed"] is True


def test_stage_anneal_survives_a_checkpoint_mid_anneal(tmp_path):
    """Resumed from the checkpoint written inside the stage anneal, the run follows the same lrs
    and makes the same decisions as the uninterrupted run."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    whole, whole_lrs, _ = _stage_anneal_fit(tmp_path / "whole", grows=True)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, every_n_epochs=1, filename="{epoch}")
    # interrupted inside the stage anneal, before the stage's check (a stop at epoch 3 of the same
    # max_epochs: a smaller max_epochs would reserve the final anneal instead): no check ran, and it says so
    class StopAfter(L.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            trainer.should_stop = trainer.should_stop or trainer.current_epoch == 2

    with pytest.warns(UserWarning, match=r"no growth check ran in this fit of 3 epoch\(s\).*Why: the check due after "
                                         r"every_n_epochs=2 epoch\(s\) had not run .*the stage anneal: 1 of 2 epoch"):
        _stage_anneal_fit(tmp_path / "first", grows=True, extra=[ckpt, StopAfter()])
    path = tmp_path / "ckpt" / "epoch=2.ckpt"
    state = torch.load(path, weights_only=False)["callbacks"]
    saved = next(v for k, v in state.items() if k.startswith("GrowUntilSaturated"))
    assert (saved["anneal_kind"], saved["anneal_done"]) == ("stage", 1)
    # the checkpoint callback it was saved with (Lightning warns when it is missing), saving nothing
    same = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=0, every_n_epochs=1, filename="{epoch}")
    resumed, resumed_lrs, trainer = _stage_anneal_fit(tmp_path / "resumed", grows=True, ckpt_path=path, extra=[same])
    assert [lrs[0] for lrs in resumed_lrs.lrs] == pytest.approx([lrs[0] for lrs in whole_lrs.lrs[3:]])
    assert [h["action"] for h in resumed.history] == [h["action"] for h in whole.history]
    assert trainer.current_epoch == 8


def test_stage_anneal_refuses_a_scheduler_before_training(tmp_path):
    grow = GrowUntilSaturated(schedule="periodic", decision="trial", lr_schedule="anneal", verbose=False)
    trainer = L.Trainer(max_epochs=2, callbacks=[grow], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)  # fmt: skip
    model = ImageClassifier(width=4, num_classes=4, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                            lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1))  # fmt: skip
    before = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    with pytest.raises(ValueError, match=r"lr_schedule: 'anneal' drives the learning rate itself.*StepLR.*Fix"):
        trainer.fit(model, tiny_dm())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items() if torch.is_tensor(v))  # refused before a step


def TenTimesTheLoss(**kwargs):
    """The same model trained and probed on 10 × the cross-entropy (what a user's loss in other units
    does): the product's own loss-scale control, as `growtrain stopping` runs it."""
    return ScaledLossClassifier(loss_scale=10.0, **kwargs)


@pytest.mark.parametrize("rule", ["crossfit", "trial", "stage_fork"])
def test_a_whole_run_with_the_loss_times_ten_makes_the_same_decisions(tmp_path, rule):
    """Run-level control: loss × 10 with lr ÷ 10 and weight decay × 10 is the same SGD trajectory,
    so a scale-free decision must grow at the same epochs and sites with the same ratios. The
    absolute rule with δ between the two runs' lower bounds is the negative control: it decides
    differently on the same trajectory."""

    def fit(cls, lr, wd, delta):
        L.seed_everything(0)
        if rule == "trial":  # the default: block-only trials (Adam: the same steps on a loss × 10)
            how = {"rule": "crossfit", "decision": Trial(min_gain=0.01), "lr_schedule": "anneal"}
        elif rule == "stage_fork":  # the periodic schedule: the arm against the run, both cooled, on the probe
            how = {"rule": "crossfit", "decision": StageFork(min_gain=0.01)}
        else:  # the first-order rule alone
            how = {"rule": rule, "decision": "rule", "lr_schedule": "anneal"}
        grow = GrowUntilSaturated(schedule=Periodic(every_n_epochs=2, anneal_epochs=1), **how, delta=delta,
                                  max_growths=2, on_saturated="anneal", verbose=False)  # fmt: skip
        trainer = L.Trainer(max_epochs=9, callbacks=[grow], logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)  # fmt: skip
        model = cls(width=4, num_classes=4, blocks=[1, 1, 1], family="basic",
                    optimizer=lambda p: torch.optim.SGD(p, lr=lr, momentum=0.9, weight_decay=wd))  # fmt: skip
        trainer.fit(model, tiny_dm())
        return [(h["action"], h.get("site"), h.get("lower")) for h in grow.history], grow.history

    plain, plain_history = fit(ImageClassifier, 0.1, 5e-4, 0.0)
    scaled, scaled_history = fit(TenTimesTheLoss, 0.01, 5e-3, 0.0)
    assert [a for a, _, _ in plain] == [a for a, _, _ in scaled] and len(plain) >= 2
    assert [s for _, s, _ in plain] == [s for _, s, _ in scaled]
    assert [None if lo is None else 10 * lo for _, _, lo in plain] == [
        None if lo is None else pytest.approx(lo, rel=1e-3) for _, _, lo in scaled]  # None: a budget, no probe
    if rule == "crossfit":  # both kinds of decision are exercised: grow, then no certified gain
        assert [a for a, _, _ in plain] == ["grow", "saturated"]
        # δ = 3 × the unscaled run's first lower bound: grows ×10, saturates ×1
        delta = 3 * plain[0][2]
        assert fit(ImageClassifier, 0.1, 5e-4, delta)[0][0][0] != fit(TenTimesTheLoss, 0.01, 5e-3, delta)[0][0][0]
    if rule == "trial":  # every trial's gain, as a fraction of the loss, is the same number
        fracs = [[t["gain_frac"] for t in h["trial"]["trials"]] for h in plain_history if "trial" in h]
        scaled_fracs = [[t["gain_frac"] for t in h["trial"]["trials"]] for h in scaled_history if "trial" in h]
        assert fracs and [[pytest.approx(f, abs=2e-3) for f in row] for row in fracs] == scaled_fracs
        # and the same kind of reason: a loss × 10 is not "at chance level" where the plain loss is not
        reasons = [[("chance" in h["reason"]), h["reason"].split(":")[0]] for h in plain_history]
        assert reasons == [[("chance" in h["reason"]), h["reason"].split(":")[0]] for h in scaled_history]
    if rule == "stage_fork":  # a fork was judged, on the same fractions of the loss
        keys = ("saturated", "gain_frac", "lower_frac", "upper_frac")
        forks = [[h["fork"].get(k) for k in keys] for h in plain_history if "gain_frac" in h.get("fork", {})]
        scaled_forks = [[h["fork"].get(k) for k in keys] for h in scaled_history if "gain_frac" in h.get("fork", {})]
        assert forks, plain_history
        assert [[v if v is None or isinstance(v, bool) else pytest.approx(v, rel=1e-3, abs=1e-5) for v in w]
                for w in forks] == scaled_forks  # fmt: skip


def test_the_loss_scale_control_scales_every_loss_it_logs_and_refuses_a_bad_scale():
    """ScaledLossClassifier's training loss, logged losses and probe loss are loss_scale × the plain
    classifier's on the same weights (checked against F.cross_entropy); a scale ≤ 0 is refused."""
    L.seed_everything(0)
    plain = ImageClassifier(width=4, num_classes=4, in_channels=3)
    scaled = ScaledLossClassifier(width=4, num_classes=4, in_channels=3, loss_scale=10.0)
    scaled.load_state_dict(plain.state_dict())
    x, y = torch.randn(6, 3, 8, 8), torch.tensor([0, 1, 2, 3, 0, 1])
    plain.eval(), scaled.eval()
    for module in (plain, scaled):  # _shared_step's self.log needs no trainer here: only the metrics are checked
        module.log = lambda *args, **kwargs: None
    reference = torch.nn.functional.cross_entropy(plain(x), y)
    assert torch.allclose(scaled.probe_loss(scaled(x), y), 10 * reference)
    assert torch.allclose(scaled._shared_step((x, y), "val"), 10 * reference)
    assert torch.allclose(scaled.metrics["val_loss"].compute(), 10 * reference)
    assert torch.allclose(plain._shared_step((x, y), "val"), reference)
    assert scaled.hparams["loss_scale"] == 10.0
    for bad in (0, -1.0, True, "10"):
        with pytest.raises(ValueError, match=r"loss_scale: expected a positive number.*Fix"):
            ScaledLossClassifier(loss_scale=bad)
