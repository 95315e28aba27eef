"""The periodic schedule (``schedule="periodic"``): a check every K epochs (or optimizer steps) at the
constant rate, and the final anneal reserved inside ``max_epochs`` and ``max_steps``. The schedule is
tested with the first-order rule deciding (``t`` tiny: every check grows; huge: none does); the stage
fork that decides by default is tests/test_fork.py's."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch

from growtrain.callbacks import Converged, GrowUntilSaturated, Periodic, StageFork, Trial
from growtrain.callbacks.growth_config import GrowthConfig
from growtrain.data import ImageDataModule
from growtrain.module import ImageClassifier


@pytest.mark.parametrize("kw, arg", [
    ({"schedule": "weekly"}, "schedule"),
    ({"schedule": "periodic", "lr_schedule": "anneal"}, "lr_schedule"),
    ({"schedule": "periodic", "decision": "guess"}, "decision"),
    ({"decision": "stage_fork"}, "decision"),  # a fork is judged at the next periodic check
])  # fmt: skip
def test_bad_periodic_options_are_refused_naming_the_argument(kw, arg):
    with pytest.raises(ValueError, match=rf"^{arg}: expected .*Fix: "):
        GrowUntilSaturated(**kw)


def test_the_periodic_schedule_decides_by_the_stage_fork_by_default():
    assert GrowUntilSaturated(schedule="periodic").decision == StageFork()
    assert GrowUntilSaturated(schedule="converged").decision == Trial()  # the converged schedule keeps its default


class LrLog(L.Callback):
    def __init__(self):
        self.lrs = []

    def on_train_epoch_start(self, trainer, pl_module):
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


def tiny_dm() -> ImageDataModule:
    return ImageDataModule(dataset="synthetic", image_size=8, synthetic_size=400, synthetic_classes=4, probe_size=120,
                           val_size=40, batch_size=32, augment=False)  # fmt: skip


def periodic_fit(tmp_path, max_epochs=9, every_n_epochs=1, **kw):
    L.seed_everything(0)
    kw = {"on_saturated": "anneal"} | ALWAYS | kw
    grow = GrowUntilSaturated(schedule=Periodic(every_n_epochs=every_n_epochs, anneal_epochs=3), verbose=False, **kw)
    lr = LrLog()
    trainer = L.Trainer(max_epochs=max_epochs, callbacks=[grow, lr], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
                        default_root_dir=tmp_path)  # fmt: skip
    model = ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], family="basic", in_channels=3,
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))  # fmt: skip
    trainer.fit(model, tiny_dm())
    return grow, model, trainer, lr


# The paper's rule with t tiny: Γ̂ > δ + t at every check, so every check grows until the final phase's
# reservation ends growth; with t huge no check grows.
ALWAYS = {"decision": "rule", "rule": "paper", "t": 1e-9}
NEVER = ALWAYS | {"t": 1e9}


def test_a_periodic_fit_checks_every_k_epochs_at_the_constant_rate_then_anneals_once(tmp_path):
    grow, model, trainer, lr = periodic_fit(tmp_path, max_epochs=11, every_n_epochs=2)
    epochs = [h["epoch"] for h in grow.history]
    assert epochs == [1, 3, 5, 7]  # every 2 epochs; the last 3 of 11 are the final anneal's
    assert [h["action"] for h in grow.history] == ["grow", "grow", "grow", "budget"]
    assert "reserved for the final anneal" in grow.history[-1]["reason"]
    assert model.network.depth() == 6 and len(model.network.growth_log) == 3
    assert lr.lrs[:8] == [0.1] * 8  # the constant rate while growing: no anneal before a check
    cosine = [0.1 * 0.5 * (1 + math.cos(math.pi * (k + 1) / 4)) for k in range(3)]
    assert lr.lrs[8:] == pytest.approx(cosine)  # one final anneal, complete inside max_epochs
    assert trainer.current_epoch == 11 and grow.growth_epochs == 8 and grow.final_epochs == 3


def test_the_decision_ends_growth_and_the_final_anneal_follows_at_once(tmp_path):
    grow, model, trainer, lr = periodic_fit(tmp_path, max_epochs=12, **NEVER)
    assert [h["action"] for h in grow.history] == ["saturated"]  # the first check (epoch 0) ends growth
    assert model.network.depth() == 3 and grow.growth_epochs == 1 and not model.network.growth_log
    assert trainer.current_epoch == 4 and grow.final_epochs == 3  # stopped after the anneal, not at max_epochs


def _converged_fit(tmp_path, grow, max_epochs=6) -> LrLog:
    """Six epochs of the tiny ResNet under plain SGD at 0.1 (no scheduler) with ``grow``: the rates per epoch."""
    lr = LrLog()
    trainer = L.Trainer(max_epochs=max_epochs, callbacks=[grow, lr], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
                        default_root_dir=tmp_path)  # fmt: skip
    model = ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], family="basic", in_channels=3,
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.1))  # fmt: skip
    trainer.fit(model, tiny_dm())
    return lr


def test_the_converged_schedule_also_reserves_the_final_anneal(tmp_path):
    """A stage that never plateaus (patience longer than the fit): the budget ends growth in time
    for the final anneal instead of the fit ending mid-stage."""
    L.seed_everything(0)
    grow = GrowUntilSaturated(schedule=Converged(patience=50, anneal_epochs=2), on_saturated="anneal", verbose=False)
    lr = _converged_fit(tmp_path, grow)
    assert [h["action"] for h in grow.history] == ["budget"] and grow.history[0]["epoch"] == 3
    assert lr.lrs[4:] == pytest.approx([0.1 * 0.5 * (1 + math.cos(math.pi * (k + 1) / 3)) for k in range(2)])


def test_the_summary_says_how_the_epochs_split_and_whether_the_network_was_cut():
    from growtrain.callbacks.guidance import phase_line

    kw = dict(anneal_epochs=5, on_saturated="anneal", schedule="periodic")
    assert phase_line(growth_epochs=18, final_epochs=5, epochs=23, **kw) == (
        "epochs: 18 growing (periodic schedule), 5 in the final anneal (complete)")
    cut = phase_line(growth_epochs=18, final_epochs=2, epochs=20, **kw)
    assert "2 of 5 in the final anneal" in cut and "not fully annealed" in cut
    never = phase_line(growth_epochs=None, final_epochs=0, epochs=30, **kw)
    assert "ended before growth did" in never and "cut mid-stage" in never
    annealed = phase_line(growth_epochs=12, final_epochs=0, epochs=12, **kw | {"schedule": "converged"})
    assert "growth ended on an annealed network" in annealed


def test_a_periodic_fits_summary_prints_the_split(tmp_path, monkeypatch):
    from growtrain.callbacks import telemetry

    printed = []  # without a rich bar the summary goes through rank_zero_info: read it there
    monkeypatch.setattr(telemetry, "rank_zero_info", printed.append)
    L.seed_everything(0)
    grow = GrowUntilSaturated(schedule=Periodic(anneal_epochs=2), on_saturated="anneal", **NEVER)
    trainer = L.Trainer(max_epochs=8, callbacks=[grow], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
                        default_root_dir=tmp_path)  # fmt: skip
    model = ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], family="basic", in_channels=3,
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.1))  # fmt: skip
    trainer.fit(model, tiny_dm())
    out = " ".join(" ".join(map(str, printed)).split())
    assert "epochs: 1 growing (periodic schedule), 2 in the final anneal (complete)" in out


def test_a_check_leaves_a_train_loaders_own_generator_where_it_was(monkeypatch):
    """The trials iterate the train loader: with DataLoader(generator=g) a check would advance g
    and change the rest of the run's batch order (fork_rng forks only the global generators)."""
    from types import SimpleNamespace

    from torch.utils.data import DataLoader

    g = torch.Generator().manual_seed(3)
    loader = DataLoader(list(range(32)), batch_size=4, shuffle=True, generator=g)
    trainer = SimpleNamespace(train_dataloader=loader)
    grow = GrowUntilSaturated(schedule="converged", verbose=False)
    grow._network = torch.nn.Linear(2, 2)
    before = g.get_state().clone()

    def a_check_that_iterates_the_loader(trainer, pl_module, annealed=False):
        list(iter(loader))  # what a trial does with the train loader
        return "grow"

    monkeypatch.setattr(grow, "_check_unforked", a_check_that_iterates_the_loader)
    assert grow._check(trainer, None) == "grow"
    assert torch.equal(g.get_state(), before)


def test_a_stage_anneal_is_not_counted_as_the_final_phase():
    """The summary's split counts only the final anneal: a converged stage's anneal (before its
    check) is growing time."""
    grow = GrowUntilSaturated(lr_schedule="anneal", on_saturated="anneal", schedule=Converged(anneal_epochs=3),
                              verbose=False)
    grow._anneal.kind, grow._anneal.done = "stage", 2
    assert grow.final_epochs == 0 and grow.growth_epochs is None
    grow._anneal.kind = "final"
    assert grow.final_epochs == 2


# -- a check interval counted in optimizer steps (min_steps_between_checks) -----------------------------
def test_should_check_counts_optimizer_steps_when_asked():
    from growtrain.schedule_rules import should_check

    kw = dict(finished=None, epochs_since_check=1, every_n_epochs=1, monitor=None, plateaued=False,
              min_steps_between_checks=12)  # fmt: skip
    assert should_check(**kw, steps_since_check=8) == (False, "next check after 4 more optimizer step(s)")
    due, why = should_check(**kw, steps_since_check=12)
    assert due and "every 12 optimizer step(s)" in why
    # the epoch count no longer decides: five epochs since the last check but too few steps
    assert should_check(**(kw | {"epochs_since_check": 5}), steps_since_check=11)[0] is False


@pytest.mark.parametrize("kw", [{"every_n_epochs": 2, "min_steps_between_checks": 100},
                                {"min_steps_between_checks": 0}])
def test_bad_step_options_are_refused_naming_the_argument(kw):
    with pytest.raises(ValueError, match=r"^Periodic\.min_steps_between_checks: expected .*Fix: "):
        Periodic(**kw)


def test_the_former_name_every_n_train_steps_is_pythons_plain_type_error():
    """Renamed before 0.1.0 (Lightning's ``ModelCheckpoint(every_n_train_steps=N)`` acts every N
    steps mid-epoch; this option's checks come only at epoch ends): no alias, no shim."""
    with pytest.raises(TypeError) as info:
        GrowUntilSaturated(schedule="converged", every_n_train_steps=4)
    assert str(info.value) == "GrowUntilSaturated.__init__() got an unexpected keyword argument 'every_n_train_steps'"
    assert "every_n_train_steps" not in GrowthConfig.names()  # nor a dataclass field a config could set
    grow = GrowUntilSaturated(schedule=Periodic(min_steps_between_checks=4), verbose=False)
    assert (grow.schedule.min_steps_between_checks, grow._schedule.min_steps_between_checks) == (4, 4)


def test_the_schedule_keeps_its_step_count_across_a_checkpoint():
    from types import SimpleNamespace

    from growtrain.callbacks.anneal import LrAnneal
    from growtrain.callbacks.monitor import StageMonitor
    from growtrain.callbacks.schedule import CheckSchedule

    def schedule():
        return CheckSchedule(kind="periodic", every_n_epochs=1, min_stage_epochs=1, lr_schedule="continue",
                             on_saturated="stop", monitor=StageMonitor(None, "min", 1, 0.0), anneal=LrAnneal(2),
                             min_steps_between_checks=10)  # fmt: skip

    def at(step, epoch):
        return SimpleNamespace(global_step=step, current_epoch=epoch, max_epochs=100, world_size=1)

    first = schedule()
    seen = []
    for epoch, step in enumerate([4, 8, 12, 16, 20, 24]):  # 4 optimizer steps an epoch
        if first.epoch_end(at(step, epoch), finished=None, budget=lambda: None, optimizer=lambda: None) == "check":
            first.checked(step)
            seen.append(step)
    assert seen == [12, 24]  # the first epoch ends at least 10 steps after the last check (0, then 12)
    resumed = schedule()
    resumed.load_state_dict(first.state_dict())
    assert resumed.last_check_step == 24
    ask = dict(finished=None, budget=lambda: None, optimizer=lambda: None)
    assert resumed.epoch_end(at(32, 7), **ask) is None and "2 more" in resumed.waiting
    assert resumed.epoch_end(at(36, 8), **ask) == "check"


def _steps_per_epoch(trainer) -> int:
    return int(trainer.num_training_batches)


@pytest.mark.parametrize("size", [416, 288])  # 256 and 128 training images: 8 and 4 steps an epoch
def test_a_step_counted_fit_checks_at_the_same_pace_per_step_on_less_data(tmp_path, size):
    L.seed_everything(0)
    grow = GrowUntilSaturated(schedule=Periodic(min_steps_between_checks=12, anneal_epochs=2), on_saturated="anneal",
                              verbose=False, **ALWAYS)  # fmt: skip
    trainer = L.Trainer(max_epochs=10, callbacks=[grow], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
                        default_root_dir=tmp_path)  # fmt: skip
    model = ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], family="basic", in_channels=3,
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))  # fmt: skip
    dm = ImageDataModule(dataset="synthetic", image_size=8, synthetic_size=size, synthetic_classes=4, probe_size=120,
                         val_size=40, batch_size=32, augment=False)  # fmt: skip
    trainer.fit(model, dm)
    per_epoch = _steps_per_epoch(trainer)
    assert per_epoch == {416: 8, 288: 4}[size]
    # by hand: a check at the first epoch end at least 12 steps after the last, up to the reservation
    # (the last 2 of 10 epochs are the final anneal: epoch 7's end is the budget check)
    expected, last = [], 0
    for epoch in range(8):
        step = (epoch + 1) * per_epoch
        if step - last >= 12 or epoch == 7:
            expected.append((epoch, step))
            last = step
    assert [(h["epoch"], h["step"]) for h in grow.history] == expected


# -- the final anneal reserved inside max_steps too -------------------------------------------------
def test_the_final_anneal_is_reserved_inside_max_steps_as_whole_epochs():
    from growtrain.callbacks.schedule import final_reserved, no_room

    kw = dict(anneal_epochs=5, on_saturated="anneal", finished=None, max_steps=1050, per_epoch=100)
    # after epoch 3 (step 400) 650 steps are left: 6 whole epochs > 5, growth goes on
    assert final_reserved(-1, 3, global_step=400, **kw) is None
    # after epoch 4 (step 500) 550 steps: 5 whole epochs, the anneal's; it ends at step 1000 <= 1050
    why = final_reserved(-1, 4, global_step=500, **kw)
    assert why.startswith("max_steps=1050 (550 step(s) left, 100 an epoch): the last 5 epoch(s) are reserved")
    # both budgets: the one leaving fewer whole epochs binds
    assert final_reserved(7, 1, global_step=200, **kw).startswith("max_epochs=7")
    assert final_reserved(None, 1, global_step=200, **(kw | {"on_saturated": "stop"})) is None
    assert "Fix: raise max_steps" in no_room(-1, 0, global_step=0, **(kw | {"max_steps": 600}))
    assert no_room(-1, 0, global_step=0, **(kw | {"max_steps": 700})) is None  # 7 epochs: one to grow in


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_fit_bounded_by_max_steps_ends_growth_in_time_to_anneal(tmp_path, accumulate):
    L.seed_everything(0)
    grow = GrowUntilSaturated(schedule=Periodic(anneal_epochs=3), on_saturated="anneal", verbose=False, **ALWAYS)
    lr = LrLog()
    per_epoch = 8 // accumulate  # 256 training images, batches of 32: 8 batches an epoch
    max_steps = 9 * per_epoch + per_epoch // 2  # 9.5 epochs of optimizer steps
    trainer = L.Trainer(max_steps=max_steps, max_epochs=-1, accumulate_grad_batches=accumulate, callbacks=[grow, lr],
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, limit_val_batches=0, default_root_dir=tmp_path)  # fmt: skip
    model = ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], family="basic", in_channels=3,
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))  # fmt: skip
    dm = ImageDataModule(dataset="synthetic", image_size=8, synthetic_size=416, synthetic_classes=4, probe_size=120,
                         val_size=40, batch_size=32, augment=False)  # fmt: skip
    trainer.fit(model, dm)
    # by hand: growth ends at the first epoch end leaving at most 3 whole epochs of steps: after epoch e,
    # (max_steps - (e + 1) * per_epoch) // per_epoch <= 3: 4.5 epochs left after e = 4 (4 whole), 3.5 after e = 5
    last = next(e for e in range(20) if (max_steps - (e + 1) * per_epoch) // per_epoch <= 3)
    assert last == 5
    assert [h["epoch"] for h in grow.history] == list(range(last + 1))
    assert grow.history[-1]["action"] == "budget" and grow.history[-1]["reason"].startswith(f"max_steps={max_steps}")
    # the whole anneal ran (3 epochs) and the callback, not max_steps, ended the fit
    assert grow.final_epochs == 3 and trainer.current_epoch == last + 1 + 3
    assert trainer.global_step == (last + 1 + 3) * per_epoch < max_steps
    cosine = [0.1 * 0.5 * (1 + math.cos(math.pi * (k + 1) / 4)) for k in range(3)]
    assert lr.lrs[last + 1:] == pytest.approx(cosine)


def test_a_step_count_left_from_an_earlier_fit_counts_from_the_new_start(tmp_path):
    """A callback reused in a second fit: the trainer's step count starts again at 0, so the last
    check's step (500, from the first fit) must not push the next check 500 steps away."""
    L.seed_everything(0)
    grow = GrowUntilSaturated(schedule=Periodic(min_steps_between_checks=12), verbose=False, **ALWAYS)
    grow._schedule.last_check_step = 500
    trainer = L.Trainer(max_epochs=3, callbacks=[grow], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
                        default_root_dir=tmp_path)  # fmt: skip
    model = ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], family="basic", in_channels=3)
    dm = ImageDataModule(dataset="synthetic", image_size=8, synthetic_size=416, synthetic_classes=4, probe_size=120,
                         val_size=40, batch_size=32, augment=False)  # fmt: skip
    trainer.fit(model, dm)
    assert [h["step"] for h in grow.history] == [16]  # 8 steps an epoch: the first epoch end >= 12 steps from 0


def test_a_step_budget_the_anneal_cannot_be_reserved_in_is_warned_about():
    """A loader without a length: the steps of an epoch are unknown, so the final anneal cannot be
    reserved inside max_steps; the fit says so at its start, with the fix (and an epoch budget or a
    fit that does not anneal is not warned about)."""
    from types import SimpleNamespace

    from growtrain.callbacks.anneal import LrAnneal
    from growtrain.callbacks.monitor import StageMonitor
    from growtrain.callbacks.schedule import CheckSchedule

    def schedule(on_saturated="anneal"):
        return CheckSchedule(kind="periodic", every_n_epochs=1, min_stage_epochs=1, lr_schedule="continue",
                             on_saturated=on_saturated, monitor=StageMonitor(None, "min", 1, 0.0), anneal=LrAnneal(2))

    def trainer(max_steps, batches):
        return SimpleNamespace(max_epochs=-1, max_steps=max_steps, current_epoch=0, global_step=0,
                               num_training_batches=batches, accumulate_grad_batches=1)  # fmt: skip

    why = schedule().no_room(trainer(1000, float("inf")), None)
    assert why.startswith("max_steps=1000 bounds this fit, but the training loader has no length") and "Fix:" in why
    assert schedule().no_room(trainer(1000, 50), None) is None  # 20 epochs of 50 steps: room to grow
    assert schedule("stop").no_room(trainer(1000, float("inf")), None) is None
    assert schedule().no_room(trainer(-1, float("inf")), None) is None


def test_the_steps_of_an_epoch_are_the_optimizer_steps_lightning_takes(tmp_path):
    """steps_per_epoch against Lightning's own count: 7 batches with gradients accumulated over 2
    take 4 optimizer steps (the last, partial accumulation steps too)."""
    from growtrain.callbacks.schedule import steps_per_epoch

    trainer = L.Trainer(max_epochs=1, accumulate_grad_batches=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
                        default_root_dir=tmp_path)  # fmt: skip
    dm = ImageDataModule(dataset="synthetic", image_size=8, synthetic_size=384, synthetic_classes=4, probe_size=120,
                         val_size=40, batch_size=32, augment=False)  # 224 training images: 7 batches  # fmt: skip
    trainer.fit(ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], family="basic", in_channels=3), dm)
    assert trainer.num_training_batches == 7
    assert steps_per_epoch(trainer) == trainer.global_step == 4


def test_the_bare_converged_default_anneals_each_stage_before_its_check(tmp_path):
    """lr_schedule=None (the default) under the converged schedule with a monitor: the stage is
    cosine-annealed once its monitor plateaus, and the check sees the annealed network (a trial
    block trained with its own anneal is not credited with the network's). With the module's own
    scheduler it stays "continue" and says so; fixed-interval checks keep the rate as it is."""
    L.seed_everything(0)
    # min_rel_delta=0.9: no epoch improves by 90 %, so a plateau after patience=1 (at epoch 1's end)
    grow = GrowUntilSaturated(schedule=Converged(patience=1, min_rel_delta=0.9, min_stage_epochs=1, anneal_epochs=3),
                              decision="rule", max_growths=1, verbose=False)  # fmt: skip
    assert grow.lr_schedule is None  # resolved when training starts, against the module's optimizer
    lr = _converged_fit(tmp_path, grow)
    assert grow.lr_schedule == "anneal"
    cosine = [0.1 * 0.5 * (1 + math.cos(math.pi * (k + 1) / 4)) for k in range(3)]
    assert lr.lrs[:2] == [0.1, 0.1] and lr.lrs[2:5] == pytest.approx(cosine)  # plateau at epoch 1, then the anneal
    assert grow.history and grow.history[0]["epoch"] == 4  # checked after the anneal's last epoch

    assert GrowUntilSaturated(schedule="periodic").lr_schedule == "continue"
    assert GrowUntilSaturated(schedule="periodic", decision="trial").lr_schedule == "continue"
    # resolved per fit: the same callback object on a module with its own scheduler continues it (no refusal)
    with_scheduler = grow
    trainer = L.Trainer(max_epochs=1, callbacks=[with_scheduler], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
                        default_root_dir=tmp_path)  # fmt: skip
    model = ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], family="basic", in_channels=3,
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                            lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 5))  # fmt: skip
    with pytest.warns(UserWarning, match=r"lr_schedule: the network's optimizer has a scheduler \(StepLR\).*Fix:"):
        trainer.fit(model, tiny_dm())
    assert with_scheduler.lr_schedule == "continue"
