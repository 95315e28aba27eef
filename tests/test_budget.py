"""GrowUntilSaturated's budget schedule (the default): the budget read from the trainer, the WSD rate
over it, the forks, the decision, and the paper's Γ̂ reported beside it.

Figures are checked against independent computations: FLOPs counted by FlopCounterMode on networks
built fresh at each depth, the rate against WSD's formula written out, adoption against the arm's
own weights and output.
"""

from __future__ import annotations

import functools
import math

import lightning as L
import pytest
import torch
from lightning.pytorch import Callback
from torch.utils.flop_counter import FlopCounterMode

import growtrain.callbacks.budget as budget_cb
from growtrain import Budget, BudgetFork, GrowUntilSaturated
from growtrain.budget import BudgetPlan, budget_verdict, carried, plan_problem, steps_cost, wsd_fraction
from growtrain.data.text import TextDataModule
from growtrain.lm import LanguageModel
from growtrain.models.gpt import GPT, GPTConfig

WIDTH, HEADS, CTX, BATCH = 16, 2, 16, 8


def _lm(depth: int = 1, lr: float = 3e-3, scheduler=None) -> LanguageModel:
    return LanguageModel(n_layer=depth, d_model=WIDTH, n_head=HEADS, block_size=CTX, vocab_size=256,
                         optimizer=functools.partial(torch.optim.AdamW, lr=lr), lr_scheduler=scheduler)  # fmt: skip


def _data() -> TextDataModule:
    return TextDataModule(tokenizer="byte", max_chars=20000, block_size=CTX, batch_size=BATCH, eval_batch_size=32,
                          probe_fraction=0.1, val_fraction=0.05, test_fraction=0.05, seed=0)  # fmt: skip


def _fit(cb, steps: int, quiet_trainer_kwargs, model=None, extra=(), data=None):
    L.seed_everything(0)
    model = model or _lm()
    trainer = L.Trainer(max_steps=steps, callbacks=[cb, *extra], limit_val_batches=0, **quiet_trainer_kwargs)
    trainer.fit(model, data or _data())
    return trainer, model


def _step_flops(depth: int) -> float:
    """Training FLOPs of one batch at this depth, counted on a freshly built network (independent of the callback)."""
    net = GPT(GPTConfig(n_layer=depth, d_model=WIDTH, n_head=HEADS, block_size=CTX, vocab_size=256))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        net(torch.zeros(1, CTX, dtype=torch.long))
    return 3.0 * BATCH * counter.get_total_flops()


def GrowForBudget(*, growth_phase=0.3, checks=3, decay=0.2, warmup=0.01, min_lr_ratio=0.1, fork=0.03, min_gain=0.0,
                  statistic="steps", **kw):  # fmt: skip
    """The budget schedule with these parts' options (the callback's own options in ``kw``)."""
    return GrowUntilSaturated(schedule=Budget(growth_phase=growth_phase, checks=checks, decay=decay, warmup=warmup,
                                              min_lr_ratio=min_lr_ratio),
                              decision=BudgetFork(fork=fork, min_gain=min_gain, statistic=statistic), **kw)  # fmt: skip


def _records(cb) -> list[dict]:
    """Each decision's budget figures with its action and reason (the history's ``budget`` entry)."""
    return [{**h["budget"], "action": h["action"], "reason": h["reason"]} for h in cb.history]


# -- pure parts -------------------------------------------------------------------------------
def test_wsd_fraction_written_out():
    kw = dict(warmup=0.1, decay=0.2, min_lr_ratio=0.1)
    assert wsd_fraction(0.05, **kw) == pytest.approx(0.5)  # halfway through the warmup
    assert wsd_fraction(0.1, **kw) == 1.0 and wsd_fraction(0.5, **kw) == 1.0 and wsd_fraction(0.8, **kw) == 1.0
    assert wsd_fraction(0.9, **kw) == pytest.approx(1 - 0.9 * 0.5)  # halfway down from 1 to 0.1
    assert wsd_fraction(1.0, **kw) == pytest.approx(0.1) and wsd_fraction(1.7, **kw) == pytest.approx(0.1)
    assert 0 < wsd_fraction(0.0, **kw) < 0.01  # never a step at rate exactly 0


def test_plan_points_and_problems():
    plan = BudgetPlan(total_flops=1e12, steps=1000, growth_phase=0.4, checks=4, fork=0.02, decay=0.2, warmup=0.01,
                      min_lr_ratio=0.1)  # fmt: skip
    assert plan.points == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert plan.point_flops(2) == pytest.approx(0.3e12) and plan.fork_flops == pytest.approx(0.02e12)
    kw = dict(growth_phase=0.4, checks=4, fork=0.02, decay=0.2, warmup=0.01, min_fork_steps=20)
    assert plan_problem(1000, **kw) is None
    short = plan_problem(999, **kw)  # 19 steps a fork
    assert "too short" in short and "1000 steps" in short
    assert "before the decay" in plan_problem(10**6, **{**kw, "growth_phase": 0.79})
    assert "warmup" in plan_problem(10**6, **{**kw, "warmup": 0.2})
    with pytest.raises(ValueError, match="budget"):
        BudgetPlan(total_flops=float("inf"), steps=1, growth_phase=0.4, checks=1, fork=0.1, decay=0.2, warmup=0.0,
                   min_lr_ratio=0.1)  # fmt: skip


def test_carried_gain_is_the_log_linear_extrapolation():
    final, half = torch.tensor([2.0, 3.0]), torch.tensor([2.5, 3.0])
    # 3 doublings past the final score, the loss keeps falling 0.5 per doubling for sample 0
    assert torch.allclose(carried(final, half, 3.0), torch.tensor([0.5, 3.0]))
    assert torch.allclose(carried(final, half, 0.0), final)


def test_verdict_grows_only_on_a_lower_bound_above_the_margin():
    assert budget_verdict(0.011, 0.03, 0.01) == (True, False)
    assert budget_verdict(0.009, 0.03, 0.01) == (False, False)  # not certified either way
    assert budget_verdict(0.01, 0.03, 0.01) == (False, False)  # at the margin is not above it
    assert budget_verdict(-0.02, 0.005, 0.01) == (False, True)  # certified not to pay
    assert budget_verdict(float("nan"), float("nan"), 0.0) == (False, False)


@pytest.mark.parametrize("kwargs, match", [
    ({"fork": 0.0}, "BudgetFork.fork: expected a fraction"), ({"checks": 0}, "Budget.checks: expected an integer"),
    ({"insertion": "mask"}, "insertion: expected one of"), ({"min_gain": -0.1}, "BudgetFork.min_gain: expected"),
    ({"insertion": "mask_ramp"}, "insertion: expected 'copy_ramp'"), ({"lr_schedule": "anneal"}, "lr_schedule: expected None"),
    ({"statistic": "guess"}, "BudgetFork.statistic: expected one of"),
    ({"growth_phase": 0.7, "fork": 0.2}, "before the decay"),
])  # fmt: skip
def test_bad_options_refused_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GrowForBudget(**kwargs)


# -- refusals before training ----------------------------------------------------------------------
def test_too_short_fit_says_so_before_training(quiet_trainer_kwargs):
    model = _lm()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="too short to decide anything.*at least 1000 steps"):
        _fit(GrowForBudget(fork=0.02), 200, quiet_trainer_kwargs, model=model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # not one step trained


def test_own_scheduler_refused_before_training(quiet_trainer_kwargs):
    sched = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=10)
    with pytest.raises(ValueError, match=r"configure_optimizers: schedule=Budget\(\) drives the learning rate.*StepLR.*Fix: return only the optimizer"):
        _fit(GrowForBudget(fork=0.1), 400, quiet_trainer_kwargs, model=_lm(scheduler=sched))


# -- one fit ----------------------------------------------------------------------------------------
class _Rates(Callback):
    def __init__(self):
        self.lrs = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.lrs.append(float(optimizer.param_groups[0]["lr"]))


def test_budget_fit_equal_flop_fork_rate_and_end(quiet_trainer_kwargs):
    rates = _Rates()
    cb = GrowForBudget(checks=1, growth_phase=0.3, fork=0.1, warmup=0.05, decay=0.2, min_lr_ratio=0.1,
                       statistic="carried")  # the equal-FLOP fork
    trainer, model = _fit(cb, 400, quiet_trainer_kwargs, extra=[rates])
    (record,) = _records(cb)  # one decision (grown or not, the phase ends after it)
    # equal FLOPs, counted independently: the run's steps at depth 1 against the arm's at depth 2
    run, arm = record["run_steps"] * _step_flops(1), record["arm_steps"] * _step_flops(2)
    assert abs(run - arm) <= _step_flops(2) and record["arm_steps"] < record["run_steps"]
    assert record["run_steps"] == round(0.1 * 400 * _step_flops(1) / _step_flops(1))
    # the budget: 400 steps at the start depth; the fork's arm and its scoring come out of it
    assert cb.run.plan.total_flops == pytest.approx(400 * _step_flops(1))
    assert cb.run.spent >= cb.run.plan.total_flops and trainer.global_step < 400
    per_probe = _step_flops(1) / (3 * BATCH)  # one probe sequence's forward at depth 1
    n_probe = record["n"]
    scoring = 2 * n_probe * (per_probe + _step_flops(2) / (3 * BATCH))  # halfway and final, both sides
    assert cb.run.decision_flops == pytest.approx(record["arm_steps"] * _step_flops(2) + scoring, rel=1e-6)
    # the rate: WSD of the budget's progress; the peak on the stable part, annealed at the end
    assert max(rates.lrs) == pytest.approx(3e-3)
    assert rates.lrs[0] < 0.1 * 3e-3
    assert rates.lrs[-1] == pytest.approx(3e-3 * 0.1, rel=0.05)
    assert "budget" in record["reason"] or record["action"] in ("grow", "stop")


def test_growth_adopts_the_arm(quiet_trainer_kwargs, monkeypatch):
    """Forced to grow: the run's network afterwards is the arm's (weights, output, optimizer state)."""
    seen = {}
    real_adopt = budget_cb.adopt

    def spy(network, optimizer, arm, arm_opt):
        seen["arm"] = {k: v.detach().clone() for k, v in arm.state_dict().items() if torch.is_tensor(v)}
        x = torch.arange(CTX).unsqueeze(0) % 256
        seen["x"], seen["arm_out"] = x, arm.eval()(x).detach().clone()
        arm.train()
        seen["arm_state"] = {n: {k: v.clone() for k, v in arm_opt.state[p].items()}
                             for n, p in arm.named_parameters() if p in arm_opt.state}  # fmt: skip
        copied = real_adopt(network, optimizer, arm, arm_opt)
        seen["net"] = {k: v.detach().clone() for k, v in network.state_dict().items() if torch.is_tensor(v)}
        seen["net_out"] = network.eval()(x).detach().clone()
        network.train()
        seen["net_state"] = {n: {k: v.clone() for k, v in optimizer.state[p].items()}
                             for n, p in network.named_parameters() if p in optimizer.state}  # fmt: skip
        return copied

    monkeypatch.setattr(budget_cb, "adopt", spy)
    monkeypatch.setattr(budget_cb, "budget_verdict", lambda lower, upper, margin: (True, False))
    cb = GrowForBudget(checks=2, growth_phase=0.4, fork=0.1, insertion="copy")
    trainer, model = _fit(cb, 400, quiet_trainer_kwargs)
    assert [h["action"] for h in _records(cb)] == ["grow", "grow"] and model.network.depth() == 3
    assert set(seen["arm"]) <= set(seen["net"])
    assert all(torch.equal(seen["arm"][k], seen["net"][k]) for k in seen["arm"])
    torch.testing.assert_close(seen["net_out"], seen["arm_out"])
    assert seen["net_state"].keys() == seen["arm_state"].keys()
    for name in seen["arm_state"]:
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(seen["net_state"][name][key], seen["arm_state"][name][key])
    assert cb.finished == "budget" and "the growth phase ended" in cb.stop_reason
    assert [h["function_preserving"] for h in _records(cb)] == [False, False]  # a copy changes the function
    assert all("NOT function-preserving at insertion" in h["reason"] for h in _records(cb))


def test_copy_insertion_copies_the_block_below(quiet_trainer_kwargs, monkeypatch):
    """The arm's new block starts as the block below it (G_stack); with zero, its terminal map is zero."""
    made = []
    real = budget_cb.BudgetRun._build

    def spy(self, trainer, pl_module, sites, seed):
        real(self, trainer, pl_module, sites, seed)
        blocks = self.arm.stage("h")
        made.append({k: (v.clone(), blocks[-2].state_dict()[k].clone()) for k, v in blocks[-1].state_dict().items()})

    monkeypatch.setattr(budget_cb.BudgetRun, "_build", spy)
    _fit(GrowForBudget(checks=1, growth_phase=0.2, fork=0.1, insertion="copy"), 400, quiet_trainer_kwargs)
    assert made and all(torch.equal(new, below) for new, below in made[0].values())
    made.clear()
    zero = GrowForBudget(checks=1, growth_phase=0.2, fork=0.1, insertion="zero")
    _fit(zero, 400, quiet_trainer_kwargs)
    assert not all(torch.equal(new, below) for new, below in made[0].values())
    assert _records(zero)[0]["function_preserving"] is True
    made.clear()  # copy_zero: the block below's tensors, the terminal map (both c_proj) at zero
    assert GrowForBudget(checks=1, growth_phase=0.2, fork=0.1).insertion == "copy_ramp"  # the default: below
    default = GrowForBudget(checks=1, growth_phase=0.2, fork=0.1, insertion="copy_zero")
    _fit(default, 400, quiet_trainer_kwargs)
    terminal = {k for k in made[0] if k.endswith(("attn.c_proj.weight", "attn.c_proj.bias", "mlp.c_proj.weight",
                                                      "mlp.c_proj.bias"))}  # fmt: skip
    assert len(terminal) == 4
    assert all(torch.equal(new, below) for k, (new, below) in made[0].items() if k not in terminal)
    assert all(not torch.any(made[0][k][0]) and torch.any(made[0][k][1]) for k in terminal)
    (record,) = _records(default)
    assert record["function_preserving"] is True and record["max_abs_change"] == 0.0


def test_a_stop_ends_growth_and_says_what_was_certified(quiet_trainer_kwargs, monkeypatch):
    monkeypatch.setattr(budget_cb, "budget_verdict", lambda lower, upper, margin: (False, True))
    cb = GrowForBudget(checks=3, growth_phase=0.4, fork=0.05, statistic="carried")
    _fit(cb, 600, quiet_trainer_kwargs)
    (record,) = _records(cb)  # no decision after the one that stopped growth
    assert record["action"] == "saturated" and cb.finished == "saturated" and cb.history[0]["certified"] is True
    assert record["reason"].startswith("growth ended at 1 blocks: one more block was certified not to pay for its compute")
    assert "equal FLOPs" in record["reason"] and "saturat" not in record["reason"]
    assert math.isfinite(record["carried_gain_frac"]) and math.isfinite(record["half_gain_frac"])


@pytest.mark.parametrize("statistic", ["fork", "carried", "steps"])
def test_the_decision_judges_the_gain_it_was_asked_to(quiet_trainer_kwargs, monkeypatch, statistic):
    """"carried" decides on the gain carried to the budget's end, "fork" on the fork's own, "steps" on the
    equal-steps gain less the price of fewer steps."""
    judged = []
    real = budget_cb.budget_verdict
    monkeypatch.setattr(budget_cb, "budget_verdict", lambda lo, up, margin: judged.append((lo, up)) or real(lo, up, margin))
    cb = GrowForBudget(checks=1, growth_phase=0.3, fork=0.1, statistic=statistic)
    _fit(cb, 400, quiet_trainer_kwargs)
    (record,) = _records(cb)
    key = {"fork": "fork_", "carried": "carried_", "steps": "steps_"}[statistic]
    assert judged == [(record[key + "lower_frac"], record[key + "upper_frac"])]
    assert record["carried_lower_frac"] != record["fork_lower_frac"]
    assert (record["lower_frac"], record["upper_frac"]) == judged[0]  # the judged figures, recorded as the decision's
    # every statistic's "carried" figures: the fork's gain carried on from halfway (where the run's probe loss was
    # higher: it trained on) linearly in log FLOPs, m doublings of the fork past the FLOPs spent at its opening
    assert record["half_loss_before"] > record["fork_loss_before"]
    m = math.log2(max(1.0 - record["spent"], 0.1) / 0.1)
    assert record["carried_log2_horizon"] == pytest.approx(m)
    half = record["half_gain_frac"] * record["half_loss_before"] / record["fork_loss_before"]
    fork = record["fork_gain_frac"]
    assert record["carried_gain_frac"] == pytest.approx(fork + m * (fork - half), abs=1e-9)
    assert record["carried_lower_frac"] < record["carried_gain_frac"] < record["carried_upper_frac"]
    if statistic == "steps":  # the price comes off the fork's own bounds, and only there
        assert record["steps_cost_frac"] > 0  # the run's loss falls over 400 steps: fewer steps cost
        # the equal-steps gain carried from halfway to the end, on to the deeper network's last step
        g1, g2, m = record["half_gain_frac"], record["fork_gain_frac"], record["steps_log2_steps"]
        horizon = record["steps_end_arm"] - record["opened_step"]
        assert m == pytest.approx(math.log2(horizon / record["run_steps"]))
        g1 = g1 * record["half_loss_before"] / record["fork_loss_before"]  # halfway's gain in the final loss's units
        assert record["steps_carried_gain_frac"] == pytest.approx(g2 + m * (g2 - g1), abs=1e-9)
        assert record["steps_gain_frac"] == pytest.approx(record["steps_carried_gain_frac"] - record["steps_cost_frac"])
        assert record["steps_lower_frac"] == pytest.approx(record["steps_carried_lower_frac"] - record["steps_cost_frac"])
        assert record["steps_upper_frac"] == pytest.approx(record["steps_carried_upper_frac"] - record["steps_cost_frac"])
        assert record["steps_end_arm"] < record["steps_end_run"]


def test_steps_statistic_trains_the_arm_as_many_steps_as_the_run(quiet_trainer_kwargs):
    """Equal steps under "steps" (the arm spends more FLOPs, charged), fewer under "carried" (equal FLOPs)."""
    steps = GrowForBudget(checks=1, growth_phase=0.3, fork=0.1, statistic="steps")
    _fit(steps, 400, quiet_trainer_kwargs)
    flops = GrowForBudget(checks=1, growth_phase=0.3, fork=0.1, statistic="carried")
    _fit(flops, 400, quiet_trainer_kwargs)
    (s,), (c,) = _records(steps), _records(flops)
    assert s["arm_steps"] == s["run_steps"] == c["run_steps"]
    assert c["arm_steps"] < c["run_steps"]  # 2 blocks cost about twice 1 per step
    assert "equal steps" in s["reason"] and "equal FLOPs" in c["reason"]
    assert steps.run.decision_flops > flops.run.decision_flops


def test_steps_statistic_curve_survives_a_checkpoint(quiet_trainer_kwargs):
    """The run's (step, loss) curve the price is fitted on travels in the callback's state, as floats."""
    cb = GrowForBudget(checks=1, growth_phase=0.3, fork=0.1, statistic="steps")
    _fit(cb, 400, quiet_trainer_kwargs)
    state = cb.state_dict()
    assert len(state["budget"]["curve"]) == len(cb.run.curve) > 0
    assert all(isinstance(loss, float) for _, loss in state["budget"]["curve"])
    again = GrowForBudget(checks=1, growth_phase=0.3, fork=0.1, statistic="steps")
    again.load_state_dict(state)
    assert [(a, float(b)) for a, b in again.run.curve] == [(a, float(b)) for a, b in cb.run.curve]
    steps = [a for a, _ in cb.run.curve]
    assert steps == list(range(steps[0], steps[0] + len(steps)))  # every optimizer step, in order, none twice


def test_steps_cost_against_the_curve_written_out():
    """On an exact curve L = E + A·S^(−½) the fit recovers A and prices fewer steps as the curve does; a
    right-skewed noise (losses are skewed) leaves A within 10 %; a flat curve costs nothing."""
    s = torch.arange(500, 1500, dtype=torch.float64)
    y = 1.2 + 3.0 * s.pow(-0.5)
    cost, a = steps_cost(s, y, end_run=9000.0, end_arm=6000.0)
    assert a == pytest.approx(3.0, rel=1e-6)
    assert cost == pytest.approx((1.2 + 3.0 * 6000**-0.5) - (1.2 + 3.0 * 9000**-0.5), rel=1e-6)
    g = torch.Generator().manual_seed(0)
    y_big = 1.2 + 30.0 * s.pow(-0.5)
    noisy = y_big + 0.05 * (torch.empty_like(s).exponential_(generator=g) - 1.0)
    assert steps_cost(s, noisy, end_run=9000.0, end_arm=6000.0)[1] == pytest.approx(30.0, rel=0.1)
    assert steps_cost(s, torch.full_like(s, 1.5), end_run=9000.0, end_arm=6000.0)[0] == 0.0
    assert steps_cost(s, 1.2 - 3.0 * s.pow(-0.5), end_run=9000.0, end_arm=6000.0)[0] == 0.0  # a rising curve
    # a short window (a fork after a growth): fewer bins, the same exact curve recovered; too few pairs refused
    short, a_short = steps_cost(s[:10], y[:10], end_run=9000.0, end_arm=6000.0)
    assert a_short == pytest.approx(3.0, rel=1e-6) and short == pytest.approx(cost, rel=1e-6)
    with pytest.raises(ValueError, match="at least 4"):
        steps_cost(s[:3], y[:3], end_run=9000.0, end_arm=6000.0)


def test_steps_statistic_refuses_a_training_step_without_its_loss(quiet_trainer_kwargs):
    class NoLoss(LanguageModel):
        def training_step(self, batch, batch_idx):  # a step Lightning skips: no loss comes back
            super().training_step(batch, batch_idx)
            return None

    with pytest.raises(ValueError, match="BudgetFork.statistic='steps'.*Fix: return the loss"):
        _fit(GrowForBudget(checks=1, growth_phase=0.3, fork=0.1, statistic="steps"), 400, quiet_trainer_kwargs,
             model=NoLoss(n_layer=1, d_model=WIDTH, n_head=HEADS, block_size=CTX, vocab_size=256))


def test_docs_options_table_matches_the_parts():
    """docs/budget.md's defaults are the parts' (one source: the dataclasses' fields)."""
    import dataclasses
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "budget.md").read_text()
    for part in (Budget, BudgetFork):
        for field in dataclasses.fields(part):
            row = re.search(rf"^\| `{part.__name__}\.{field.name}` \| ([^|]+) \|", text, re.M)
            assert row, (part.__name__, field.name)
            shown = row.group(1).strip().strip("`").strip('"')
            value = field.default
            assert shown == ("0" if value == 0 and not isinstance(value, bool) else str(value)), (field.name, shown)
    row = re.search(r"^\| `insertion` \| ([^|]+) \|", text, re.M)
    assert row and row.group(1).strip().strip("`").strip('"') == GrowUntilSaturated().insertion


def test_a_probe_that_was_trained_on_is_refused_before_training(quiet_trainer_kwargs, tiny_data):
    """The decisions score held-out samples: a probe that is the training data is refused at fit start."""
    from growtrain.module import ImageClassifier

    tiny_data.setup("fit")
    model = ImageClassifier(in_channels=3, num_classes=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="probe: the probe sample overlaps the training data"):
        _fit(GrowForBudget(fork=0.1, probe=tiny_data.train_dataloader), 400, quiet_trainer_kwargs, model=model,
             data=tiny_data)  # fmt: skip
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


class _StopAtEpochEnd(Callback):
    def __init__(self, epoch: int):
        self.epoch = epoch

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == self.epoch:
            trainer.should_stop = True


@pytest.mark.parametrize("insertion", ["copy_zero", "copy_ramp"])
def test_a_fit_cut_while_a_budget_fork_is_open_resumes_into_the_same_decisions(tmp_path, quiet_trainer_kwargs,
                                                                                insertion):  # fmt: skip
    """The open fork (the arm's weights and optimizer state, both sides' averages, the halfway scores),
    the FLOPs spent and the run's curve travel in the checkpoint: cut halfway through the first fork,
    the resumed fit makes the uninterrupted fit's decisions with the same figures and ends on the same
    weights. Under copy_ramp the cut comes after the ramp (a quarter of the fork) ended: the rebuilt arm
    holds the plain block, not a new mask at 0."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def fit(folder, extra=(), ckpt=None):
        L.seed_everything(0)
        cb = GrowForBudget(checks=2, growth_phase=0.5, fork=0.1, insertion=insertion, verbose=False)
        every = ModelCheckpoint(dirpath=tmp_path / folder, save_last=True, every_n_epochs=1, save_top_k=-1)
        # bounded by max_epochs: a max_steps fit resumed from an epoch-end checkpoint does not redraw that epoch's
        # batches exactly (RandomStateCheckpoint's limits, growtrain/callbacks/rng_state.py)
        trainer = L.Trainer(max_epochs=10, limit_train_batches=40, limit_val_batches=0, callbacks=[cb, every, *extra],
                            **{**quiet_trainer_kwargs, "enable_checkpointing": True})  # fmt: skip
        model = _lm()
        trainer.fit(model, _data(), ckpt_path=ckpt)
        return cb, model

    whole, model = fit("whole")
    assert [h["budget"]["opened_step"] for h in whole.history][0] == 100  # the first fork: steps 100 → 140
    cut, _ = fit("cut", extra=[_StopAtEpochEnd(2)])  # the end of epoch 2 is step 120: halfway through it
    assert cut.history == [] and cut.run.fork_state is not None
    if insertion == "copy_ramp":  # the copy was ramped in, its mask gone by the cut
        assert cut.run._ramped and cut.run.fork_state["arm_steps"] > cut.run.fork_state["arm_target"] // 4
        assert all(budget_cb.mask_value(b) is None for b in cut.run._ramped)
    resumed, again = fit("resumed", ckpt=str(tmp_path / "cut" / "last.ckpt"))
    keep = ("check", "step", "action", "sites", "depth", "gamma", "threshold", "budget", "reason")
    got, want = [{k: h[k] for k in keep} for h in resumed.history], [{k: h[k] for k in keep} for h in whole.history]
    assert [(k, a[k], b[k]) for a, b in zip(got, want) for k in keep if a[k] != b[k] and k != "budget"] == []
    assert [(k, a["budget"][k], b["budget"][k]) for a, b in zip(got, want) for k in a["budget"] if a["budget"][k] != b["budget"][k]] == []
    assert got == want
    assert resumed.run.spent == pytest.approx(whole.run.spent) and resumed.finished == whole.finished
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b) if torch.is_tensor(a) else a == b, name


def test_copy_ramp_starts_the_arm_as_the_run_and_ramps_the_copy_in_within_the_fork(quiet_trainer_kwargs, monkeypatch):
    """insertion="copy_ramp": the arm's copied block behind a mask at 0 (the arm measured as the run's
    function), the mask at arm_steps / (a quarter of the fork) after each arm step, gone before the run
    adopts the arm: the grown network holds a plain block, no mask."""
    from growtrain.masks import mask_value

    seen = []

    class Masks(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            run = cb.run
            if run.fork_state is not None and run._ramped:
                seen.append((run.fork_state["arm_steps"], run.fork_state["arm_target"], mask_value(run._ramped[0])))

    monkeypatch.setattr(budget_cb, "budget_verdict", lambda lower, upper, margin: (True, False))
    cb = GrowForBudget(checks=1, growth_phase=0.3, fork=0.1, insertion="copy_ramp")
    _, model = _fit(cb, 400, quiet_trainer_kwargs, model=_lm(depth=2), extra=[Masks()])
    (record,) = _records(cb)
    assert record["function_preserving"] is True and record["max_abs_change"] == 0.0
    ramp = seen[0][1] // 4
    assert all((m is None) == (k >= ramp) for k, _, m in seen)
    assert all(m == pytest.approx(k / ramp) for k, _, m in seen if m is not None) and seen[-1][2] is None
    assert model.network.depth() == 3 and not any(k.endswith("growtrain_mask") for k in model.state_dict())


# -- audit additions: accumulation, the carried figures, the rate's steps, a copy_ramp resume ---------------
def test_under_gradient_accumulation_the_budget_and_the_fork_count_every_micro_batch(quiet_trainer_kwargs,
                                                                                      monkeypatch):  # fmt: skip
    """accumulate_grad_batches=2: an optimizer step is 2 batches, so the budget is the fit's optimizer steps
    × 2 batches' FLOPs (counted on a fresh network), the fork's run side trains its fraction of the optimizer
    steps, and the arm trains on every micro-batch (2 forward-backward passes per arm step), each charged."""
    passes = []
    real = budget_cb.train_sides
    monkeypatch.setattr(budget_cb, "train_sides", lambda *a, **k: passes.append(1) or real(*a, **k))
    cb = GrowForBudget(checks=1, growth_phase=0.3, fork=0.1, statistic="carried")
    _fit(cb, 200, {**quiet_trainer_kwargs, "accumulate_grad_batches": 2})
    (record,) = _records(cb)
    assert cb.run.plan.total_flops == pytest.approx(200 * 2 * _step_flops(1))
    assert record["run_steps"] == round(0.1 * 200)  # 20 optimizer steps, 40 batches
    assert abs(record["run_steps"] * _step_flops(1) - record["arm_steps"] * _step_flops(2)) <= _step_flops(2)
    assert len(passes) == 2 * record["arm_steps"]  # 2 passes per arm step: a fork opens at a step's boundary
    scoring = 2 * record["n"] * (_step_flops(1) + _step_flops(2)) / (3 * BATCH)  # halfway and final, both sides
    assert cb.run.decision_flops == pytest.approx(len(passes) * _step_flops(2) + scoring, rel=1e-6)


def test_under_gradient_accumulation_every_arm_step_trains_on_all_its_micro_batches(quiet_trainer_kwargs,
                                                                                     monkeypatch):  # fmt: skip
    passes = []
    real = budget_cb.train_sides
    monkeypatch.setattr(budget_cb, "train_sides", lambda *a, **k: passes.append(1) or real(*a, **k))
    cb = GrowForBudget(checks=1, growth_phase=0.3, fork=0.1, statistic="carried")
    _fit(cb, 200, {**quiet_trainer_kwargs, "accumulate_grad_batches": 2})
    (record,) = _records(cb)
    assert len(passes) == 2 * record["arm_steps"]


def test_under_accumulation_the_curve_keeps_every_batch_the_steps_price_reads():
    """The steps price fits the run's curve from one fork's length before the fork to its decision (two fork
    lengths of optimizer steps); under accumulate_grad_batches=4 every batch of them must still be kept."""
    from collections import Counter
    from types import SimpleNamespace

    run = budget_cb.BudgetRun(SimpleNamespace(schedule=Budget(), decision=BudgetFork(fork=0.1)))
    run._total_steps, fork, acc = 200, 20, 4  # a fork of 0.1 × 200 = 20 optimizer steps
    for step in range(200):
        for _ in range(acc):
            run._record_loss(SimpleNamespace(global_step=step, accumulate_grad_batches=acc), torch.tensor(1.0))
        kept = Counter(a for a, _ in run.curve)
        assert all(kept[s] == acc for s in range(max(0, step - 2 * fork), step + 1)), step


def test_the_rate_follows_the_steps_when_smaller_batches_lag_the_flops():
    """A smaller last batch spends fewer FLOPs than the step the budget was priced on: the rate follows the
    fit's optimizer steps then, so the fit's last step is at the budget's end rate (min_lr_ratio), annealed."""
    from types import SimpleNamespace

    run = budget_cb.BudgetRun(SimpleNamespace(schedule=Budget(), decision=BudgetFork()))
    run.plan = BudgetPlan(total_flops=1000.0, steps=100, growth_phase=0.3, checks=3, fork=0.03, decay=0.2,
                          warmup=0.01, min_lr_ratio=0.1)  # fmt: skip
    run._total_steps, run.spent = 100, 900.0  # 90 % of the FLOPs at the fit's last step
    assert run.rate(SimpleNamespace(global_step=100)) == pytest.approx(0.1)
    # FLOPs ahead of the steps (a deeper network spends faster): the FLOPs
    assert run.rate(SimpleNamespace(global_step=50)) == pytest.approx(wsd_fraction(0.9, warmup=0.01, decay=0.2,
                                                                                  min_lr_ratio=0.1))  # fmt: skip
