"""The callback's parts on their own, without a Trainer: the schedule's ``StageMonitor`` (plateau)
and ``LrAnneal`` (the cosine the callback drives), and the ``rule`` decision's ``FirstOrderRule``.
Each expectation is computed here by hand, not read back from the part."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from growtrain.callbacks.anneal import LrAnneal
from growtrain.callbacks.monitor import StageMonitor
from growtrain.callbacks.probe_check import CheckInputs
from growtrain.callbacks.rule_check import FirstOrderRule
from growtrain.models.resnet import cifar_resnet
from growtrain.saturation import measure_saturation


def _trainer(metrics=None, configs=None):
    return SimpleNamespace(callback_metrics=metrics or {}, world_size=1,
                           strategy=SimpleNamespace(lr_scheduler_configs=list(configs or [])))  # fmt: skip


def _feed(monitor: StageMonitor, values, scale=1.0) -> list[bool]:
    return [monitor.plateaued(_trainer({"val_loss": torch.tensor(v * scale)})) for v in values]


# -- StageMonitor ----------------------------------------------------------------------------
def test_a_plateau_is_patience_epochs_without_a_relative_improvement():
    # min_rel_delta 1 %: from best 1.0 an improvement must go below 0.99; 0.995 and 0.992 are none
    monitor = StageMonitor("val_loss", "min", patience=2, min_rel_delta=0.01)
    assert _feed(monitor, [1.0, 0.995, 0.992]) == [False, False, True]
    assert monitor.best == 1.0 and monitor.wait == 2
    # 0.98 beats 0.99: a new best and the wait starts again
    monitor = StageMonitor("val_loss", "min", patience=2, min_rel_delta=0.01)
    assert _feed(monitor, [1.0, 0.995, 0.98, 0.975, 0.974]) == [False, False, False, False, True]
    assert monitor.best == pytest.approx(0.98)


def test_the_plateau_is_scale_free_and_follows_the_mode():
    values = [2.0, 1.7, 1.69, 1.5, 1.499, 1.498, 1.497]
    seen = [_feed(StageMonitor("val_loss", "min", 2, 0.01), values, scale) for scale in (1.0, 10.0, 0.1)]
    assert seen[0] == seen[1] == seen[2] and seen[0][-1] is True
    # mode="max" on the negated values makes the same plateaus
    assert _feed(StageMonitor("val_loss", "max", 2, 0.01), [-v for v in values]) == seen[0]


def test_a_new_stage_forgets_the_best_and_the_state_round_trips():
    monitor = StageMonitor("val_loss", "min", patience=2, min_rel_delta=0.01)
    _feed(monitor, [1.0, 0.999])
    state = monitor.state_dict()
    assert state == {"best": 1.0, "wait": 1}
    other = StageMonitor("val_loss", "min", patience=2, min_rel_delta=0.01)
    other.load_state_dict(state)
    assert _feed(other, [0.998]) == [True]  # the loaded wait counts
    monitor.new_stage()
    assert (monitor.best, monitor.wait) == (None, 0) and _feed(monitor, [0.5]) == [False]


def test_the_returned_loss_is_the_fallback_of_train_loss_and_a_missing_metric_is_named():
    monitor = StageMonitor("train_loss", "min", patience=1, min_rel_delta=0.0)
    monitor.epoch_start()
    for v in (1.0, 2.0, 3.0):
        monitor.batch_end({"loss": torch.tensor(v)})
    assert monitor.plateaued(_trainer()) is False and monitor.best == pytest.approx(2.0)  # mean of 1, 2, 3
    monitor.epoch_start()
    monitor.batch_end(torch.tensor(2.5))
    assert monitor.plateaued(_trainer()) is True  # 2.5 is no improvement on 2.0
    with pytest.raises(RuntimeError, match=r"monitor: metric 'val_acc' is not logged; available: \['x'\].*Fix:"):
        StageMonitor("val_acc", "max", 1, 0.0).plateaued(_trainer({"x": torch.tensor(1.0)}))


# -- LrAnneal --------------------------------------------------------------------------------
def test_the_anneal_follows_the_cosine_sets_schedulers_aside_and_restores_the_rate():
    w = nn.Parameter(torch.zeros(1))
    v = nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([{"params": [w], "lr": 0.1}, {"params": [v], "lr": 0.04}])
    other = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    mine = SimpleNamespace(scheduler=SimpleNamespace(optimizer=optimizer))
    theirs = SimpleNamespace(scheduler=SimpleNamespace(optimizer=other))
    trainer = _trainer(configs=[mine, theirs])
    anneal = LrAnneal(epochs=3)
    assert not anneal.active and anneal.start(optimizer, "stage") and anneal.active
    rates = []
    for k in range(3):
        anneal.set_lr(trainer, optimizer)
        rates.append([g["lr"] for g in optimizer.param_groups])
        assert anneal.epoch_done() is (k == 2)
    want = [[base * 0.5 * (1 + math.cos(math.pi * (k + 1) / 4)) for base in (0.1, 0.04)] for k in range(3)]
    assert sum(rates, []) == pytest.approx(sum(want, [])) and all(r > 0 for row in rates for r in row)
    assert trainer.strategy.lr_scheduler_configs == [theirs]  # only this optimizer's scheduler set aside
    state = anneal.state_dict()
    assert state == {"anneal_done": 3, "anneal_kind": "stage", "anneal_base_lrs": [0.1, 0.04]}
    anneal.end(optimizer)
    assert [g["lr"] for g in optimizer.param_groups] == [0.1, 0.04] and not anneal.active
    again = LrAnneal(epochs=3)
    again.load_state_dict({"anneal_done": 1, "anneal_kind": "final", "anneal_base_lrs": [0.1, 0.04]})
    assert (again.kind, again.done, again.base_lrs) == ("final", 1, [0.1, 0.04])
    assert LrAnneal(epochs=3).start(None, "final") is False  # no optimizer: nothing to anneal


# -- FirstOrderRule --------------------------------------------------------------------------
@pytest.mark.parametrize("rule, options", [("crossfit", {"delta": 0.0}), ("crossfit", {"delta": 1e9}),
                                           ("paper", {"t": 1e-9})])  # fmt: skip
def test_the_rule_decision_is_the_reports_verdict_at_its_best_site(rule, options):
    torch.manual_seed(0)
    net = cifar_resnet(blocks=[1, 1, 1], width=4, num_classes=3, in_channels=1)
    # a signal the first-order test certifies: the labels are the sign pattern of the input's mean
    x = torch.randn(512, 1, 8, 8)
    y = (x.mean(dim=(1, 2, 3)) > 0).long() + (x[:, 0, 0, 0] > 1).long()
    batches = [(x[i:i + 128], y[i:i + 128]) for i in range(0, 512, 128)]
    report = measure_saturation(net, batches, F.cross_entropy, rule=rule, seed=0, **options)
    verdict, sites, entry = FirstOrderRule().judge(CheckInputs(None, None, net, report, batches, F.cross_entropy,
                                                               0.05, 0))  # fmt: skip
    assert entry is None and verdict.saturated == report.saturated and verdict.reason == report.reason
    assert not verdict.certified  # a first-order stop never certifies saturation
    if report.saturated:
        assert sites == [] and options.get("delta") == 1e9
        return
    # the site to grow at: the best first-order score, by hand, wherever it sits in the report
    key = (lambda r: r.lower) if rule == "crossfit" else (lambda r: r.grad_norm)
    assert sites == [max(report.sites, key=key).name]
    flipped = dataclasses.replace(report, sites=list(reversed(report.sites)))
    _, again, _ = FirstOrderRule().judge(CheckInputs(None, None, net, flipped, batches, F.cross_entropy, 0.05, 0))
    assert again == sites


# -- CheckSchedule ---------------------------------------------------------------------------
def _schedule(kind="converged", every=1, lr_schedule="continue", on_saturated="stop", anneal_epochs=2):
    from growtrain.callbacks.schedule import CheckSchedule

    return CheckSchedule(kind=kind, every_n_epochs=every, min_stage_epochs=2, lr_schedule=lr_schedule,
                         on_saturated=on_saturated, monitor=StageMonitor("val_loss", "min", 1, 0.01),
                         anneal=LrAnneal(anneal_epochs))  # fmt: skip


def _run(schedule, losses, *, max_epochs=100, budget=None, optimizer=None):
    """``epoch_end``'s answers over epochs 0, 1, ... with these validation losses."""
    out = []
    for epoch, loss in enumerate(losses):
        trainer = SimpleNamespace(max_epochs=max_epochs, current_epoch=epoch, world_size=1,
                                  callback_metrics={"val_loss": torch.tensor(loss)},
                                  strategy=SimpleNamespace(lr_scheduler_configs=[]))  # fmt: skip
        schedule.epoch_start(trainer, lambda: optimizer)
        what = schedule.epoch_end(trainer, finished=None, budget=lambda: budget, optimizer=lambda: optimizer)
        if what in ("check", "check_annealed"):
            schedule.checked()
        out.append(what)
    return out


def test_the_periodic_schedule_checks_every_k_epochs_whatever_the_loss():
    # a falling loss (no plateau) and a flat one: the periodic schedule does not read the monitor
    assert _run(_schedule("periodic", every=2), [1.0, 0.5, 0.25, 0.1, 0.05, 0.01]) == [None, "check"] * 3
    assert _run(_schedule("periodic", every=3), [1.0] * 6) == [None, None, "check"] * 2


def test_the_converged_schedule_waits_for_a_plateau_and_a_long_enough_stage():
    # patience 1: 0.995 is no 1 % improvement on 1.0 → a plateau at epoch 1 (the stage is 2 epochs long)
    assert _run(_schedule(), [1.0, 0.995, 0.5, 0.498]) == [None, "check", None, "check"]
    schedule = _schedule()
    _run(schedule, [1.0, 0.995])
    schedule.new_stage()  # after a growth: the stage starts again, its plateau too
    assert schedule.stage_epochs == 0 and schedule.monitor.best is None


def test_with_the_anneal_protocol_a_plateau_starts_a_stage_anneal_and_the_check_comes_annealed():
    w = nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([w], lr=0.1)
    schedule = _schedule(lr_schedule="anneal", anneal_epochs=2)
    # epoch 1 plateaus → the anneal starts (no check yet), epochs 2-3 anneal, the check at the end of epoch 3
    assert _run(schedule, [1.0, 0.995, 0.99, 0.99], optimizer=optimizer) == [None, None, None, "check_annealed"]
    assert optimizer.param_groups[0]["lr"] == 0.1 and not schedule.anneal.active  # the rate is back for the new stage
    # a budget already ends growth: no stage anneal, the check comes at once (the final anneal follows it)
    assert _run(_schedule(lr_schedule="anneal"), [1.0, 0.995], budget="max_growths", optimizer=optimizer)[-1] == "check"


def test_the_final_anneal_is_reserved_inside_max_epochs_and_ends_the_fit():
    # max_epochs 6, a final anneal of 2: after epoch 3 only 2 are left, so that epoch's end is a (budget) check
    schedule = _schedule("periodic", every=10, on_saturated="anneal", anneal_epochs=2)
    assert _run(schedule, [1.0, 0.9, 0.8, 0.7], max_epochs=6) == [None, None, None, "check"]
    w = nn.Parameter(torch.zeros(1))
    assert schedule.anneal.start(torch.optim.SGD([w], lr=0.1), "final")  # growth ended: the callback starts it
    trainer = SimpleNamespace(max_epochs=6, current_epoch=4, world_size=1, callback_metrics={},
                              strategy=SimpleNamespace(lr_scheduler_configs=[]))  # fmt: skip
    ends = [schedule.epoch_end(trainer, finished="budget", budget=lambda: None, optimizer=lambda: None) for _ in (0, 1)]
    assert ends == [None, "stop"]
