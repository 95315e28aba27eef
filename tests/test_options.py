"""The options of ``GrowUntilSaturated`` after the removal of 2026-12-03 (commit 858f19e) (40 options cut to 25, then one added:
``min_steps_between_checks``; docs/results/history.md), then grouped into its parts (25 → 15): when a check
comes (``schedule``: ``Converged``/``Periodic``) and what decides (``decision``: ``Trial``/``StageFork``/``Rule``).

* an option removed before the first release, or one now a field of a part, is Python's own ``TypeError``
  (no shim: 0.1.0 has no users to migrate), raised before any state is built;
* what is left: at most 15 options, none of them removed, the same in ``GrowthConfig`` and the
  callback's signature, which takes no ``**kwargs``;
* each part checks its own fields, naming them (``Converged.patience``); a part's name is the part
  with its defaults;
* the callback's checkpoint state (the current format) round-trips into the collaborators
  (``_monitor``, ``_anneal``, ``_trials``);
* a value a kept option does not take is refused naming the option, the values it takes and a fix.

The former names are written out here, not read from the package, so a name that silently comes
back fails.
"""

from __future__ import annotations

import inspect
import os
import warnings

import pytest
import torch

from growtrain.callbacks import Converged, GrowUntilSaturated
from growtrain.callbacks.anneal import LrAnneal
from growtrain.callbacks.growth_config import DECISIONS, GrowthConfig
from growtrain.callbacks.monitor import StageMonitor
from growtrain.callbacks.trial_check import BlockTrials
from growtrain.trial import DEFAULT_TRIAL_LR, TRIAL_SITES

# The 15 options removed on 2026-12-03, commit 858f19e (docs/results/history.md), each with a value an old config passed.
FORMER_OPTIONS = {
    "cooldown": 1, "probe_budget": 0.05, "tau": 0.5, "alpha_spending": "geometric", "restore_best": True,
    "trial_growth": True, "trial_lr": 1e-3, "trial_holdout": 20000, "trial_sites": 3, "top_k": 1, "max_blocks": 8,
    "projected": False, "calibrate": True, "log_sites": True, "min_delta": 0.0,
    "window": 6,  # the window rule's J, removed with decision="window" (its depth followed the interval)
}  # fmt: skip
# The options grouped into the parts before the first release (docs/callback.md, "Removed options"), each with a
# value a flat config passed: now a field of a part (or, trial_epochs, Trial.epochs), not an option.
GROUPED_OPTIONS = {
    "every_n_epochs": 2, "min_steps_between_checks": 100, "monitor": "val_loss", "mode": "max", "patience": 2,
    "min_rel_delta": 0.005, "min_stage_epochs": 2, "anneal_epochs": 5, "min_gain": 0.01, "trial_epochs": 0.5,
}  # fmt: skip


@pytest.mark.parametrize("name", list(FORMER_OPTIONS | GROUPED_OPTIONS))
def test_a_former_option_is_pythons_plain_type_error_before_any_state(name, tmp_path):
    rng = torch.random.get_rng_state()
    value = (FORMER_OPTIONS | GROUPED_OPTIONS)[name]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # delta under the trial would warn and alpha=2 would be a ValueError: Python refuses
        # the unknown keyword before the body runs, so no validation, warning or state
        with pytest.raises(TypeError) as info:
            GrowUntilSaturated(schedule="converged", delta=0.5, alpha=2.0, **{name: value})
    assert str(info.value) == f"GrowUntilSaturated.__init__() got an unexpected keyword argument '{name}'"
    assert caught == [], [str(w.message) for w in caught]
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert os.listdir(tmp_path) == []  # the working directory (conftest: tmp_path): nothing written


def test_the_trial_constants_are_the_default_decisions():
    assert (DEFAULT_TRIAL_LR, TRIAL_SITES) == (1e-3, 3)
    trials = GrowUntilSaturated(schedule="converged", verbose=False)._trials  # the default decision's collaborator uses them
    assert isinstance(trials, BlockTrials)
    assert (trials.lr, trials.sites) == (1e-3, 3)


# -- what is left ------------------------------------------------------------------------------------
def test_at_most_15_options_none_removed_and_the_callback_takes_exactly_them():
    # 25 after the first removal (+ min_steps_between_checks, − window), 15 once the schedule's and the
    # decision's options became fields of their parts
    assert len(inspect.signature(GrowUntilSaturated).parameters) <= 15
    names = GrowthConfig.names()
    assert len(names) == len(set(names)) <= 15
    assert not set(names) & set(FORMER_OPTIONS | GROUPED_OPTIONS)
    signature = inspect.signature(GrowUntilSaturated.__init__).parameters
    assert not any(p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) for p in signature.values())  # no **kwargs at all
    assert [n for n in signature if n != "self"] == names  # the same options in the same order
    defaults = {f: GrowthConfig.__dataclass_fields__[f].default for f in names}
    assert {n: signature[n].default for n in names} == defaults
    grow = GrowUntilSaturated(schedule="converged", verbose=False)
    assert not any(hasattr(grow, n) for n in FORMER_OPTIONS | GROUPED_OPTIONS)  # no attribute left behind either
    assert DECISIONS == ("budget_fork", "trial", "rule", "stage_fork")


def test_a_value_a_kept_option_does_not_take_is_refused_naming_the_choices():
    """The generic refusal: the option, the values it takes, what was given, a fix."""
    with pytest.raises(ValueError) as info:
        GrowUntilSaturated(schedule="converged", rule="bonferroni")
    assert str(info.value) == "rule: expected one of ('paper', 'crossfit'); got 'bonferroni'. Fix: pass rule='paper'."
    for schedule in ("converged", "periodic"):
        with pytest.raises(ValueError) as info:
            GrowUntilSaturated(schedule=schedule, decision="guess")
        assert str(info.value) == ("decision: expected one of ('budget_fork', 'trial', 'rule', 'stage_fork') or "
                                   "BudgetFork(...) or Trial(...) or Rule(...) or StageFork(...); got 'guess'. Fix: "
                                   "pass decision='budget_fork'.")  # fmt: skip


# -- the checkpoint state round-trips -----------------------------------------------------------------
HISTORY = [
    {"check": 0, "epoch": 5, "step": 60, "action": "grow", "site": "layer1.1", "sites": ["layer1.1"], "depth": 4},
    {"check": 1, "epoch": 11, "step": 130, "action": "grow", "site": "layer2.1", "sites": ["layer2.1"], "depth": 5},
]

# what a callback mid-growth (two growths, in a stage anneal, its plateau counting) saves, key for key
EXPECTED = {
    "checks": 4, "growths": 2, "inserted": 2, "history": HISTORY, "finished": None, "stop_reason": None,
    "restart_pending": True, "start_depth": 3, "epochs_since_check": 2, "stage_epochs": 3, "last_check_step": 130,
    "best": 0.4217, "wait": 1, "anneal_done": 1, "anneal_kind": "stage", "anneal_base_lrs": [0.05, 0.025],
    "seconds": {"checks": 0.0, "fit": 0.0}, "trials": {"trials": 3},
}  # fmt: skip


def test_the_checkpoint_state_round_trips_into_the_collaborators():
    grow = GrowUntilSaturated(schedule="converged", verbose=False)
    grow.checks, grow.growths, grow.inserted = 4, 2, 2
    grow.history = [dict(h) for h in HISTORY]
    grow.restart_pending, grow.start_depth = True, 3
    grow._schedule.epochs_since_check, grow._schedule.stage_epochs, grow._schedule.last_check_step = 2, 3, 130
    grow._monitor.best, grow._monitor.wait = 0.4217, 1
    grow._anneal.done, grow._anneal.kind, grow._anneal.base_lrs = 1, "stage", [0.05, 0.025]
    grow._trials.trials = 3
    state = grow.state_dict()
    assert state == EXPECTED

    fresh = GrowUntilSaturated(schedule="converged", verbose=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh.load_state_dict(state)
    assert (fresh.checks, fresh.growths, fresh.inserted, fresh._schedule.epochs_since_check, fresh.stage_epochs) == (4, 2, 2, 2, 3)
    assert fresh.history == HISTORY and fresh.history is not state["history"]
    assert (fresh.finished, fresh.stop_reason, fresh.restart_pending, fresh.start_depth) == (None, None, True, 3)
    assert fresh._schedule.last_check_step == 130
    assert isinstance(fresh._monitor, StageMonitor) and (fresh._monitor.best, fresh._monitor.wait) == (0.4217, 1)
    assert isinstance(fresh._anneal, LrAnneal)
    assert (fresh._anneal.done, fresh._anneal.kind, fresh._anneal.base_lrs) == (1, "stage", [0.05, 0.025])
    assert fresh._anneal.active and fresh.final_epochs == 0  # a stage anneal, not the final phase
    assert fresh._trials.trials == 3
    assert fresh.state_dict() == EXPECTED


def test_a_finished_state_in_its_final_anneal_resumes_there():
    grow = GrowUntilSaturated(on_saturated="anneal", schedule=Converged(anneal_epochs=3), verbose=False)
    grow.load_state_dict(EXPECTED | {"finished": "saturated", "stop_reason": "no certified gain: x",
                                     "anneal_kind": "final", "anneal_done": 2, "restart_pending": False})  # fmt: skip
    assert (grow.finished, grow._anneal.kind, grow._anneal.done, grow.final_epochs) == ("saturated", "final", 2, 2)
    assert grow.state_dict()["anneal_kind"] == "final"
