"""compare's statistics and schedule rescaling, without training.

Oracles: Student-t quantiles from printed tables; the paired interval recomputed with the
``statistics`` module and a tabulated t value; schedules checked by stepping them and
comparing the learning rates with the closed-form schedule written out here.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from torch.optim.lr_scheduler import CosineAnnealingLR, ExponentialLR, LambdaLR, MultiStepLR, StepLR

from growtrain.experiments.paired import (
    equal_loss_target,
    first_reaching,
    paired_difference,
    student_t_cdf,
    student_t_quantile,
)
from growtrain.experiments.schedules import inspect_schedule, rescaled, with_rescaled_schedule
from growtrain.module import ImageClassifier
from growtrain.optim import WarmupCosine

# two-sided 95 % critical values t_{0.975, df} (any statistics table)
T975 = {1: 12.7062047, 2: 4.3026527, 3: 3.1824463, 4: 2.7764451, 5: 2.5705818, 9: 2.2621572, 10: 2.2281389,
        29: 2.0452296, 30: 2.0422725, 120: 1.9799304}  # fmt: skip


@pytest.mark.parametrize("df", sorted(T975))
def test_t_quantile_matches_the_table(df):
    assert student_t_quantile(0.975, df) == pytest.approx(T975[df], abs=2e-6)


def test_t_quantile_other_levels_symmetry_and_the_normal_limit():
    assert student_t_quantile(0.95, 5) == pytest.approx(2.0150484, abs=2e-6)  # one-sided 95 %
    assert student_t_quantile(0.995, 3) == pytest.approx(5.8409093, abs=2e-6)
    assert student_t_quantile(0.025, 4) == pytest.approx(-T975[4], abs=2e-6)
    assert student_t_quantile(0.975, 1e6) == pytest.approx(1.959964, abs=1e-4)
    assert student_t_cdf(0.0, 3) == pytest.approx(0.5)
    assert student_t_cdf(1.0, 1) == pytest.approx(0.75)  # Cauchy: 1/2 + atan(1)/π
    with pytest.raises(ValueError, match="p:"):
        student_t_quantile(1.0, 3)
    with pytest.raises(ValueError, match="df:"):
        student_t_quantile(0.9, 0)


def test_paired_difference_against_the_textbook_formula():
    growth = [0.301, 0.254, 0.270, 0.288]
    scratch = [0.333, 0.291, 0.262, 0.310]
    diffs = [g - s for g, s in zip(growth, scratch)]
    mean, sd = statistics.mean(diffs), statistics.stdev(diffs)
    half = T975[3] * sd / math.sqrt(4)
    got = paired_difference(growth, scratch)
    assert got["n"] == 4
    assert got["mean"] == pytest.approx(mean) and got["sd"] == pytest.approx(sd)
    assert got["lo"] == pytest.approx(mean - half, abs=1e-7) and got["hi"] == pytest.approx(mean + half, abs=1e-7)


def test_paired_difference_skips_missing_pairs_and_has_no_interval_for_one_pair():
    got = paired_difference([0.5, None, 0.2], [0.4, 0.3, None])
    assert got["n"] == 1 and got["mean"] == pytest.approx(0.1) and got["lo"] is None and got["sd"] is None
    assert paired_difference([None], [0.3])["mean"] is None
    with pytest.raises(ValueError, match="one value per seed"):
        paired_difference([0.1, 0.2], [0.1])


def test_equal_loss_target_and_first_epoch_reaching_it():
    growth = [{"epoch": 0, "train_loss": 0.9}, {"epoch": 1, "train_loss": 0.4}, {"epoch": 2, "train_loss": 0.35}]
    scratch = [{"epoch": 0, "train_loss": 1.2}, {"epoch": 1, "train_loss": 0.5}, {"epoch": 2, "train_loss": 0.45},
               {"epoch": 3, "train_loss": 0.41}]  # fmt: skip
    target = equal_loss_target([growth[-1]["train_loss"], scratch[-1]["train_loss"]])
    assert target == 0.41  # the larger final loss: both arms reach it
    assert first_reaching(growth, target)["epoch"] == 1  # 0.4 ≤ 0.41 first at epoch 1
    assert first_reaching(scratch, target)["epoch"] == 3
    assert first_reaching(growth, 0.1) is None
    assert first_reaching([{"epoch": 0, "train_loss": None}, {"epoch": 1, "train_loss": 0.3}], 0.3)["epoch"] == 1


# -- schedules -------------------------------------------------------------------------------------
def _optimizer(lr=0.1):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def _lrs(scheduler, n):
    lrs = []
    for _ in range(n):
        lrs.append(scheduler.optimizer.param_groups[0]["lr"])
        scheduler.optimizer.step()
        scheduler.step()
    return lrs


def test_multisteplr_milestones_scale_with_the_budget():
    new = rescaled(MultiStepLR(_optimizer(), milestones=[10, 15], gamma=0.1), 2.0)
    assert type(new) is MultiStepLR and sorted(new.milestones.elements()) == [20, 30]
    lrs = _lrs(new, 35)
    expected = [0.1 * 0.1 ** ((e >= 20) + (e >= 30)) for e in range(35)]
    assert lrs == pytest.approx(expected)
    # a repeated milestone stays repeated (×γ² there)
    again = rescaled(MultiStepLR(_optimizer(), milestones=[3, 3], gamma=0.5), 1.0)
    assert sorted(again.milestones.elements()) == [3, 3]


def test_steplr_step_size_scales():
    new = rescaled(StepLR(_optimizer(), step_size=5, gamma=0.5), 2.0)
    assert type(new) is StepLR and new.step_size == 10
    assert _lrs(new, 25) == pytest.approx([0.1 * 0.5 ** (e // 10) for e in range(25)])


def test_cosine_t_max_scales():
    new = rescaled(CosineAnnealingLR(_optimizer(), T_max=10, eta_min=0.001), 3.0)
    assert type(new) is CosineAnnealingLR and new.T_max == 30 and new.eta_min == 0.001
    expected = [0.001 + (0.1 - 0.001) * (1 + math.cos(math.pi * e / 30)) / 2 for e in range(31)]
    assert _lrs(new, 31) == pytest.approx(expected, abs=1e-9)


def test_warmup_cosine_lengths_scale():
    new = rescaled(WarmupCosine(_optimizer(), warmup_steps=10, total_steps=100, min_lr_ratio=0.1), 0.5)
    assert type(new) is WarmupCosine and (new.warmup_steps, new.total_steps, new.min_lr_ratio) == (5, 50, 0.1)

    def factor(step):  # linear warmup over 5 steps, half-cosine to 0.1 by step 50, flat after
        if step < 5:
            return (step + 1) / 5
        p = min(1.0, (step - 5) / 45)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p))

    assert _lrs(new, 60) == pytest.approx([0.1 * factor(s) for s in range(60)])


@pytest.mark.parametrize("make", [lambda o: ExponentialLR(o, gamma=0.9), lambda o: LambdaLR(o, lambda e: 1.0)])
def test_a_scheduler_with_unknown_lengths_is_refused_by_name(make):
    scheduler = make(_optimizer())
    with pytest.raises(ValueError, match=type(scheduler).__name__):
        rescaled(scheduler, 2.0)


def test_a_module_schedule_is_inspected_and_rescaled_through_configure_optimizers():
    from functools import partial

    module = ImageClassifier(width=4, num_classes=4, lr_scheduler=partial(MultiStepLR, milestones=[4, 6], gamma=0.1))
    info = inspect_schedule(module)
    assert info.names == ["MultiStepLR"] and info.unsupported() == [] and info.end_epoch(None) == 6
    config = with_rescaled_schedule(module, 1.5).configure_optimizers()
    scheduler = config["lr_scheduler"]["scheduler"]
    assert sorted(scheduler.milestones.elements()) == [6, 9] and config["lr_scheduler"]["interval"] == "epoch"
    assert scheduler.optimizer is config["optimizer"]
    step_module = ImageClassifier(width=4, num_classes=4, scheduler_interval="step",
                                  lr_scheduler=partial(WarmupCosine, warmup_steps=5, total_steps=95))  # fmt: skip
    assert inspect_schedule(step_module).end_epoch(10) == 10  # ceil(95 / 10 steps per epoch)
    cosine = ImageClassifier(width=4, num_classes=4, lr_scheduler=partial(CosineAnnealingLR, T_max=5))
    assert inspect_schedule(cosine).end_epoch(None) == math.inf  # its lr rises again after T_max
    with pytest.raises(ValueError, match="factor"):
        with_rescaled_schedule(module, 0.0)


def test_epoch_trace_saves_each_new_minimum_and_restarts_where_the_lr_is_final(tmp_path):
    from types import SimpleNamespace

    from growtrain.experiments.pairing import EpochTrace

    module = torch.nn.Linear(2, 1)
    trace = EpochTrace(tmp_path, reset_at=2)
    for epoch, loss in enumerate([1.0, 0.5, 0.8, 0.7, 0.75, 0.6]):
        trainer = SimpleNamespace(current_epoch=epoch, callback_metrics={"train_loss": torch.tensor(loss)},
                                  optimizers=[_optimizer(0.01)])  # fmt: skip
        trace.on_train_epoch_start(trainer, module)
        trace.on_train_epoch_end(trainer, module)
    saved = [r["epoch"] for r in trace.records if r["weights"]]
    assert saved == [0, 1, 2, 3, 5]  # epoch 2 is above the minimum 0.5 of epochs 0–1 but starts the final-lr phase
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"epoch{e:04d}.pt" for e in saved]
    assert trace.records[4] == {"epoch": 4, "train_loss": 0.75, "lr": 0.01, "weights": None, "params": 3}
