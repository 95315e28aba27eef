"""``GrowUntilSaturated``'s parts: when a check comes (``Converged``, ``Periodic``) and what decides
(``Trial``, ``StageFork``, ``Rule``), each a frozen dataclass that checks its own fields.

* a bad field is a ``ValueError`` naming it (``Converged.patience``), what was expected, what was
  given and the fix, spelled as the part is built (``Converged(patience=1)``);
* a part's name (``"periodic"``) is the part with its defaults: the same config and the same
  collaborators as the default-constructed class, whose defaults are written out here (the
  documented ones), not read from the package;
* the callback's collaborators are built from the part's fields (a field that did not reach its
  collaborator fails here);
* a LightningCLI config names the part it means (``class_path``), and gets that part: two parts
  share fields, and a plain dataclass would be matched to the first one it fits.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import growtrain
import growtrain.callbacks
from growtrain.callbacks import Converged, GrowUntilSaturated, Periodic, Rule, StageFork, Trial
from growtrain.callbacks.fork_check import PairedFork
from growtrain.callbacks.rule_check import FirstOrderRule
from growtrain.callbacks.trial_check import BlockTrials

PARTS = ("Converged", "Periodic", "Trial", "StageFork", "Rule")


# -- each part checks its own fields ---------------------------------------------------------------------
@pytest.mark.parametrize("cls, field, value, fix", [
    (Converged, "monitor", None, "Converged(monitor='train_loss')"),
    (Converged, "monitor", "", "Converged(monitor='train_loss')"),
    (Converged, "monitor", 3, "Converged(monitor='train_loss')"),
    (Converged, "mode", "up", "Converged(mode='min')"),
    (Converged, "patience", 0, "Converged(patience=1)"),
    (Converged, "patience", 1.5, "Converged(patience=1)"),
    (Converged, "patience", True, "Converged(patience=1)"),
    (Converged, "min_rel_delta", -0.1, "Converged(min_rel_delta=0.01)"),
    (Converged, "min_rel_delta", math.nan, "Converged(min_rel_delta=0.01)"),
    (Converged, "min_stage_epochs", 0, "Converged(min_stage_epochs=1)"),
    (Converged, "anneal_epochs", 0, "Converged(anneal_epochs=1)"),
    (Periodic, "every_n_epochs", 0, "Periodic(every_n_epochs=1)"),
    (Periodic, "every_n_epochs", 2.0, "Periodic(every_n_epochs=1)"),
    (Periodic, "min_steps_between_checks", 0, "Periodic(min_steps_between_checks=1)"),
    (Periodic, "anneal_epochs", 0, "Periodic(anneal_epochs=1)"),
    (Trial, "min_gain", -0.1, "Trial(min_gain=0.01)"),
    (Trial, "min_gain", None, "Trial(min_gain=0.01)"),
    (Trial, "min_gain", math.inf, "Trial(min_gain=0.01)"),
    (Trial, "epochs", 0, "Trial(epochs=0.5)"),
    (Trial, "epochs", -1.0, "Trial(epochs=0.5)"),
    (Trial, "epochs", True, "Trial(epochs=0.5)"),
    (StageFork, "min_gain", -1, "StageFork(min_gain=0.01)"),
    (StageFork, "min_gain", None, "StageFork(min_gain=0.01)"),
])  # fmt: skip
def test_a_bad_field_is_refused_naming_it_what_was_expected_given_and_the_fix(cls, field, value, fix):
    with pytest.raises(ValueError) as info:
        cls(**{field: value})
    message = str(info.value)
    assert message.startswith(f"{cls.__name__}.{field}: expected ")
    assert f"; got {value!r}. Fix: pass {fix}" in message


def test_an_interval_is_counted_in_epochs_or_in_steps_not_both():
    with pytest.raises(ValueError, match=r"^Periodic\.min_steps_between_checks: expected None when every_n_epochs is "
                                         r"given .*; got 40\. Fix: drop one of every_n_epochs and "
                                         r"min_steps_between_checks\.$"):  # fmt: skip
        Periodic(every_n_epochs=2, min_steps_between_checks=40)
    # what is in force: an interval in epochs (None: 1), or None beside an interval in steps
    assert (Periodic().every_n_epochs, Periodic(every_n_epochs=3).every_n_epochs) == (1, 3)
    assert Periodic(min_steps_between_checks=40).every_n_epochs is None


def test_the_rule_alone_has_no_field_and_a_part_is_frozen():
    with pytest.raises(TypeError):
        Rule(min_gain=0.01)  # the rule's options are the callback's rule, delta, t and alpha
    with pytest.raises(AttributeError):  # dataclasses.FrozenInstanceError
        Converged().patience = 5


# -- a name is the part with its defaults ------------------------------------------------------------------
# The documented defaults, written out: the parts' own defaults must be these.
DEFAULTS = {
    "converged": Converged(monitor="train_loss", mode="min", patience=3, min_rel_delta=0.01, min_stage_epochs=2,
                           anneal_epochs=10),
    "periodic": Periodic(every_n_epochs=1, min_steps_between_checks=None, anneal_epochs=10),
    "trial": Trial(min_gain=0.01, epochs=0.5),
    "stage_fork": StageFork(min_gain=0.01),
    "rule": Rule(),
}  # fmt: skip


def _collaborators(grow: GrowUntilSaturated) -> dict:
    s, m, d = grow._schedule, grow._monitor, grow._decider
    return {
        "schedule": (s.kind, s.every_n_epochs, s.min_stage_epochs, s.min_steps_between_checks, s.lr_schedule),
        "monitor": (m.monitor, m.mode, m.patience, m.min_rel_delta), "anneal": grow._anneal.epochs,
        "decider": (type(d).__name__, getattr(d, "min_gain", None), getattr(d, "epochs", None),
                    getattr(d, "horizon", None)),
        "state": grow.state_dict(),
    }  # fmt: skip


@pytest.mark.parametrize("schedule, decision", [
    ("converged", None), ("converged", "trial"), ("converged", "rule"),
    ("periodic", None), ("periodic", "trial"), ("periodic", "stage_fork"), ("periodic", "rule"),
])  # fmt: skip
def test_a_name_and_the_default_part_give_the_same_config_and_collaborators(schedule, decision):
    by_name = GrowUntilSaturated(schedule=schedule, decision=decision, verbose=False)
    resolved = decision or {"converged": "trial", "periodic": "stage_fork"}[schedule]  # None: the schedule's own
    by_part = GrowUntilSaturated(schedule=DEFAULTS[schedule], decision=DEFAULTS[resolved], verbose=False)
    assert by_name.config == by_part.config  # every field, the parts compared field by field
    assert (by_name.schedule, by_name.decision) == (DEFAULTS[schedule], DEFAULTS[resolved])
    assert _collaborators(by_name) == _collaborators(by_part)
    # and the names build new parts (a frozen default is not shared state between callbacks)
    assert type(by_name.schedule) is type(DEFAULTS[schedule]) and type(by_name.decision) is type(DEFAULTS[resolved])


def test_the_parts_fields_reach_their_collaborators():
    converged = GrowUntilSaturated(schedule=Converged(monitor="val_acc", mode="max", patience=7, min_rel_delta=0.2,
                                                      min_stage_epochs=4, anneal_epochs=6),
                                   decision=Trial(min_gain=0.05, epochs=0.25), verbose=False)  # fmt: skip
    assert _collaborators(converged)["schedule"][:4] == ("converged", 1, 4, None)
    assert _collaborators(converged)["monitor"] == ("val_acc", "max", 7, 0.2)
    assert converged._anneal.epochs == 6
    assert isinstance(converged._decider, BlockTrials) and converged._trials is converged._decider
    assert (converged._trials.min_gain, converged._trials.epochs) == (0.05, 0.25)
    steps = GrowUntilSaturated(schedule=Periodic(min_steps_between_checks=40, anneal_epochs=3),
                               decision=StageFork(min_gain=0.03), verbose=False)  # fmt: skip
    assert _collaborators(steps)["schedule"][:4] == ("periodic", 1, 1, 40)
    assert steps._monitor.monitor is None  # a periodic check waits for no plateau
    assert steps._anneal.epochs == 3
    assert isinstance(steps._decider, PairedFork) and steps._fork is steps._decider
    assert (steps._fork.min_gain, steps._fork.horizon) == (0.03, "40+ optimizer step(s)")
    epochs = GrowUntilSaturated(schedule=Periodic(every_n_epochs=3), verbose=False)
    assert (epochs._schedule.every_n_epochs, epochs._fork.horizon) == (3, "3 epoch(s)")
    rule = GrowUntilSaturated(schedule="converged", decision="rule", verbose=False)
    assert isinstance(rule._decider, FirstOrderRule) and rule._trials is None and rule._fork is None


# -- the parts together ------------------------------------------------------------------------------------
def test_the_stage_fork_needs_a_periodic_schedule_and_the_constant_rate():
    with pytest.raises(ValueError, match=r"^decision: expected 'stage_fork' only with schedule='periodic' .*Fix: "):
        GrowUntilSaturated(schedule="converged", decision=StageFork())
    with pytest.raises(ValueError, match=r"^lr_schedule: expected 'continue' or 'restart' with "
                                         r"decision='stage_fork' .*Fix: drop lr_schedule, or pass decision='trial'"):
        GrowUntilSaturated(schedule="periodic", lr_schedule="anneal")
    # a fixed interval with a stage anneal before each check: the trial and the rule take it
    for decision in ("trial", "rule"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            grow = GrowUntilSaturated(schedule=Periodic(every_n_epochs=2), decision=decision, lr_schedule="anneal")
        assert grow.lr_schedule == grow._schedule.lr_schedule == "anneal"
    # the default rate policy: resolved per fit under Converged, the constant rate under Periodic
    assert GrowUntilSaturated(schedule="converged").lr_schedule is None
    assert GrowUntilSaturated(schedule="periodic", decision="trial").lr_schedule == "continue"


@pytest.mark.parametrize("kw, given", [
    ({"schedule": Converged}, "an instance: Converged()"),  # the class, not a part
    ({"schedule": Trial()}, "Trial(min_gain=0.01, epochs=0.5)"),  # a decision where the schedule goes
    ({"decision": Periodic()}, "Periodic("),
    ({"schedule": "fortnightly"}, "'fortnightly'"),
])  # fmt: skip
def test_a_part_that_is_not_one_is_refused_before_any_state(kw, given):
    rng = torch.random.get_rng_state()
    arg = next(iter(kw))
    with pytest.raises(ValueError) as info:
        GrowUntilSaturated(**kw)
    message = str(info.value)
    assert message.startswith(f"{arg}: expected one of (") and given in message and "Fix: pass" in message
    assert torch.equal(torch.random.get_rng_state(), rng)


def test_the_parts_are_exported_from_growtrain_and_growtrain_callbacks():
    for name in PARTS:
        assert name in growtrain.__all__ and name in growtrain.callbacks.__all__
        assert getattr(growtrain, name) is getattr(growtrain.callbacks, name)


# -- a config names the part it means ----------------------------------------------------------------------
@pytest.mark.parametrize("given, want", [
    ({"decision": {"class_path": "growtrain.StageFork", "init_args": {"min_gain": 0.02}}, "schedule": "periodic"},
     (Periodic(), StageFork(min_gain=0.02))),
    ({"decision": {"class_path": "growtrain.Trial", "init_args": {"min_gain": 0.02}}, "schedule": "periodic"},
     (Periodic(), Trial(min_gain=0.02))),
    ({"schedule": {"class_path": "growtrain.Periodic", "init_args": {"anneal_epochs": 4}}},
     (Periodic(anneal_epochs=4), StageFork())),
    ({"schedule": {"class_path": "growtrain.Converged", "init_args": {"anneal_epochs": 4}}, "decision": "rule"},
     (Converged(anneal_epochs=4), Rule())),
    ({"schedule": "periodic", "decision": {"class_path": "growtrain.Rule"}}, (Periodic(), Rule())),
])  # fmt: skip
def test_a_cli_config_gets_the_part_its_class_path_names(given, want):
    """What LightningCLI does with a callback's init_args (jsonargparse): StageFork and Trial share
    min_gain, Converged and Periodic anneal_epochs; each config gets the class it names."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(GrowUntilSaturated, "grow")
    grow = parser.instantiate(parser.parse_object({"grow": given | {"verbose": False}})).grow
    assert (grow.schedule, grow.decision) == want
    assert type(grow.schedule) is type(want[0]) and type(grow.decision) is type(want[1])


# -- audit additions: the combinations GrowthConfig refuses, each in both directions -------------------------
@pytest.mark.parametrize("kw, match", [
    ({"schedule": "budget", "decision": "trial"}, r"decision: expected 'budget_fork' exactly under schedule=Budget"),
    ({"schedule": "converged", "decision": "budget_fork"}, r"decision: expected 'budget_fork' exactly under"),
    ({"schedule": "budget", "on_saturated": "stop"}, r"on_saturated: expected None under schedule='budget'"),
    ({"schedule": "periodic", "insertion": "copy"}, r"insertion: expected 'zero' under schedule='periodic'"),
    ({"schedule": "converged", "insertion": "copy_zero"}, r"insertion: expected 'zero' under schedule='converged'"),
])  # fmt: skip
def test_a_schedule_refuses_the_parts_it_cannot_drive(kw, match):
    with pytest.raises(ValueError, match=match):
        GrowUntilSaturated(**kw)


def test_a_budgets_warmup_and_end_rate_are_fractions_in_0_1_closed_at_0():
    from growtrain.callbacks import Budget

    assert Budget(warmup=0, min_lr_ratio=0).warmup == 0.0  # no warmup, a decay to 0: allowed
    assert isinstance(Budget(warmup=0).warmup, float)
    for field, value in (("warmup", -0.01), ("warmup", 1.0), ("min_lr_ratio", -0.1), ("min_lr_ratio", 1.0)):
        with pytest.raises(ValueError, match=rf"Budget.{field}: expected a fraction in \[0, 1\)"):
            Budget(**{field: value})
