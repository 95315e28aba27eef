"""The options of ``GrowUntilSaturated`` after the eighth session's removal (40 options cut to 25, then one added:
``every_n_train_steps``; docs/results/history.md).

* every removed option is refused by name, with its replacement, before anything else happens;
* what is left: at most 26 options, none of them removed, the same in ``GrowthConfig`` and the
  callback's signature;
* a checkpoint the previous version wrote (its flat state dict, built here by hand) resumes into the
  new collaborators (``_monitor``, ``_anneal``, ``_trials``) and round-trips; one written mid-growth
  by ``decision="gain"`` warns that its reference is ignored;
* the removed values of kept options (``rule="relative"``, ``decision="gain"``) are refused with the fix.

The expectations are written out here, not read from ``growth_config.REMOVED``, so a name that
silently comes back (or a replacement that drifts) fails.
"""

from __future__ import annotations

import inspect
import os
import warnings

import pytest
import torch

from growtrain.callbacks import GrowUntilSaturated
from growtrain.callbacks.anneal import LrAnneal
from growtrain.callbacks.growth_config import DECISIONS, REMOVED, GrowthConfig
from growtrain.callbacks.monitor import StageMonitor
from growtrain.callbacks.trial_check import BlockTrials
from growtrain.trial import DEFAULT_TRIAL_HOLDOUT, DEFAULT_TRIAL_LR, TRIAL_SITES

# The 15 removed options, a value an old config would pass, and a word of the fix each message must give.
REMOVED_OPTIONS = {
    "cooldown": (1, "min_stage_epochs"),
    "probe_budget": (0.05, "1-2 %"),
    "tau": (0.5, "rule='crossfit'"),
    "alpha_spending": ("geometric", "tests at alpha"),
    "restore_best": (True, "decision='gain'"),
    "trial_growth": (True, "decision='trial'"),
    "trial_lr": (1e-3, "DEFAULT_TRIAL_LR"),
    "trial_holdout": (20000, "DEFAULT_TRIAL_HOLDOUT"),
    "trial_sites": (3, "TRIAL_SITES"),
    "top_k": (1, "one block"),
    "max_blocks": (8, "max_growths"),
    "projected": (False, "growtrain measure"),
    "calibrate": (True, "BatchNorm"),
    "log_sites": (True, "logs"),
    "min_delta": (0.0, "min_rel_delta"),
}


def test_the_removed_table_is_the_fifteen_options_of_issue_38():
    assert set(REMOVED) == set(REMOVED_OPTIONS)


@pytest.mark.parametrize("name", list(REMOVED_OPTIONS))
def test_a_removed_option_is_a_type_error_naming_it_and_its_fix(name, tmp_path):
    value, fix_word = REMOVED_OPTIONS[name]
    rng = torch.random.get_rng_state()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # every_n_epochs with a monitor would warn and alpha=2 would be a ValueError: the removed
        # option is refused first, before any validation, warning or state
        with pytest.raises(TypeError) as info:
            GrowUntilSaturated(every_n_epochs=3, alpha=2.0, **{name: value})
    message = str(info.value)
    assert message.startswith(f"GrowUntilSaturated: option(s) {name} were removed")
    fix = message.split("Fix:", 1)[1]  # "Fix:" is there, and the fix names the option and what to do instead
    assert f"{name}: " in fix and fix_word in fix, message
    assert caught == [], [str(w.message) for w in caught]
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert os.listdir(tmp_path) == []  # the working directory (conftest: tmp_path): nothing written


def test_a_removed_option_is_refused_even_at_its_old_default():
    # an old config that spelled out a default (calibrate: true, projected: false, max_blocks: null) is refused too
    for name, value in (("calibrate", True), ("projected", False), ("max_blocks", None), ("log_sites", True)):
        with pytest.raises(TypeError, match=rf"option\(s\) {name} were removed"):
            GrowUntilSaturated(**{name: value})


def test_several_removed_options_are_all_named_in_one_error():
    with pytest.raises(TypeError) as info:
        GrowUntilSaturated(cooldown=2, min_delta=0.01, top_k=2, verbose=False)
    message = str(info.value)
    assert "option(s) cooldown, min_delta, top_k were removed" in message
    fix = message.split("Fix:", 1)[1]
    assert "cooldown: " in fix and "min_delta: pass min_rel_delta" in fix and "top_k: " in fix


def test_an_unknown_option_is_a_type_error_listing_the_options():
    with pytest.raises(TypeError) as info:
        GrowUntilSaturated(patiense=3)
    message = str(info.value)
    assert "unexpected option(s) ['patiense']" in message and "'patience'" in message


def test_the_trial_constants_are_what_the_removed_options_messages_say():
    assert (DEFAULT_TRIAL_LR, DEFAULT_TRIAL_HOLDOUT, TRIAL_SITES) == (1e-3, 20000, 3)
    assert "(1e-3)" in REMOVED["trial_lr"] and "(20,000)" in REMOVED["trial_holdout"]
    assert "TRIAL_SITES = 3" in REMOVED["trial_sites"]
    trials = GrowUntilSaturated(verbose=False)._trials  # the default decision's collaborator uses them
    assert isinstance(trials, BlockTrials)
    assert (trials.lr, trials.holdout, trials.sites) == (DEFAULT_TRIAL_LR, DEFAULT_TRIAL_HOLDOUT, TRIAL_SITES)


# -- what is left ------------------------------------------------------------------------------------
def test_at_most_26_options_none_removed_and_the_callback_takes_exactly_them():
    # 25 after the removal, + every_n_train_steps (ninth session: the check interval and window in
    # optimizer steps, docs/callback.md says why)
    names = GrowthConfig.names()
    assert len(names) == len(set(names)) <= 26
    assert not set(names) & set(REMOVED_OPTIONS)
    signature = inspect.signature(GrowUntilSaturated.__init__).parameters
    given = [n for n, p in signature.items() if n != "self" and p.kind is not p.VAR_KEYWORD]
    assert given == names  # the same options in the same order: none dropped between the two
    defaults = {f: GrowthConfig.__dataclass_fields__[f].default for f in names}
    assert {n: signature[n].default for n in names} == defaults
    grow = GrowUntilSaturated(verbose=False)
    assert not any(hasattr(grow, n) for n in REMOVED_OPTIONS)  # no attribute left behind either
    assert DECISIONS == ("trial", "window", "rule", "fork")


def test_the_removed_values_of_kept_options_are_refused_with_the_fix():
    with pytest.raises(ValueError) as info:
        GrowUntilSaturated(rule="relative")
    message = str(info.value)
    assert message.startswith("rule: expected one of ('paper', 'crossfit'); got 'relative'. Fix: pass rule='crossfit'")
    for kwargs in ({"decision": "gain"}, {"decision": "gain", "schedule": "periodic"}):
        with pytest.raises(ValueError) as info:
            GrowUntilSaturated(**kwargs)
        message = str(info.value)
        assert message.startswith("decision: expected one of ('trial', 'window', 'rule', 'fork'); got 'gain'. "
                                  "Fix: pass decision='trial'"), message  # fmt: skip
        assert "schedule='periodic'" in message.split("Fix:")[1]


# -- an old checkpoint resumes ----------------------------------------------------------------------
HISTORY = [
    {"check": 0, "epoch": 5, "step": 60, "action": "grow", "site": "layer1.1", "sites": ["layer1.1"], "depth": 4},
    {"check": 1, "epoch": 11, "step": 130, "action": "grow", "site": "layer2.1", "sites": ["layer2.1"], "depth": 5},
]


def old_state(**changes) -> dict:
    """The flat state dict the previous version (the four mixins) wrote, key for key."""
    state = {
        "checks": 4, "growths": 2, "inserted": 2, "alpha_index": 3, "wait": 1, "cooldown_left": 1,
        "epochs_since_check": 2, "stage_epochs": 3, "trained_since_check": 1280, "history": HISTORY, "best": 0.4217,
        "finished": None, "stop_reason": None, "restart_pending": True, "start_depth": 3, "anneal_done": 1,
        "anneal_kind": "stage", "anneal_base_lrs": [0.05, 0.025], "gain_reference": None, "gain_signature": None,
        "snapshot": None, "trials": {"trials": 3},
    }  # fmt: skip
    return state | changes


# what the new version keeps of it, under the same keys (the rest belonged to removed options)
KEPT = {"checks", "growths", "inserted", "wait", "epochs_since_check", "stage_epochs", "history", "best", "finished",
        "stop_reason", "restart_pending", "start_depth", "anneal_done", "anneal_kind", "anneal_base_lrs", "trials"}
DROPPED = {"alpha_index", "cooldown_left", "trained_since_check", "gain_reference", "gain_signature", "snapshot"}


def test_an_old_checkpoint_state_loads_into_the_new_collaborators():
    old = old_state()
    assert set(old) == KEPT | DROPPED
    grow = GrowUntilSaturated(verbose=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no gain reference: nothing to warn about
        grow.load_state_dict(old)
    assert (grow.checks, grow.growths, grow.inserted, grow.epochs_since_check, grow.stage_epochs) == (4, 2, 2, 2, 3)
    assert grow.history == HISTORY and grow.history is not HISTORY
    assert (grow.finished, grow.stop_reason, grow.restart_pending, grow.start_depth) == (None, None, True, 3)
    assert isinstance(grow._monitor, StageMonitor) and (grow._monitor.best, grow._monitor.wait) == (0.4217, 1)
    assert isinstance(grow._anneal, LrAnneal)
    assert (grow._anneal.done, grow._anneal.kind, grow._anneal.base_lrs) == (1, "stage", [0.05, 0.025])
    assert grow._anneal.active and grow.final_epochs == 0  # a stage anneal, not the final phase
    assert grow._trials.trials == 3

    state = grow.state_dict()
    assert set(state) == KEPT | {"last_check_step"}  # new in the ninth session; an old state has none:
    assert state["last_check_step"] == HISTORY[-1]["step"]  # its last check's step
    assert {k: state[k] for k in KEPT} == {k: old[k] for k in KEPT}
    again = GrowUntilSaturated(verbose=False)
    again.load_state_dict(state)
    assert again.state_dict() == state


def test_a_finished_old_checkpoint_in_its_final_anneal_resumes_there():
    old = old_state(finished="saturated", stop_reason="no certified gain: x", anneal_kind="final", anneal_done=2,
                    gain_reference={"losses": [0.5, 0.4]}, restart_pending=False)  # fmt: skip
    grow = GrowUntilSaturated(on_saturated="anneal", anneal_epochs=3, verbose=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # growth had ended: its gain reference judged nothing more
        grow.load_state_dict(old)
    assert (grow.finished, grow._anneal.kind, grow._anneal.done, grow.final_epochs) == ("saturated", "final", 2, 2)
    state = grow.state_dict()
    assert {k: state[k] for k in KEPT} == {k: old[k] for k in KEPT} and not set(state) & DROPPED


def test_an_older_anneal_without_its_kind_was_the_final_one():
    old = old_state(finished="saturated", anneal_done=1)
    del old["anneal_kind"]
    grow = GrowUntilSaturated(verbose=False)
    grow.load_state_dict(old)
    assert (grow._anneal.kind, grow._anneal.done) == ("final", 1)


def test_an_old_checkpoint_mid_growth_by_decision_gain_warns_that_its_reference_is_ignored():
    old = old_state(gain_reference={"losses": [0.5, 0.4], "epoch": 11}, gain_signature=[0.1, 0.2])
    grow = GrowUntilSaturated(verbose=False)
    with pytest.warns(UserWarning, match=r"written by decision='gain' \(removed") as caught:
        grow.load_state_dict(old)
    message = next(str(w.message) for w in caught if "decision='gain'" in str(w.message))
    assert "decision='trial'" in message  # what the resumed fit decides by
    assert (grow.checks, grow._monitor.best, grow._trials.trials) == (4, 0.4217, 3)  # the rest still loaded
    assert "gain_reference" not in grow.state_dict()


def test_an_old_checkpoint_loads_into_the_window_and_rule_decisions():
    for kwargs, part in (({"schedule": "periodic"}, "window"), ({"decision": "rule", "min_gain": None}, None)):
        grow = GrowUntilSaturated(verbose=False, **kwargs)
        grow.load_state_dict(old_state())
        state = grow.state_dict()
        assert grow._trials is None and "trials" not in state  # the old trial count belongs to no part here
        assert (grow._monitor.best, grow._anneal.kind, grow.checks) == (0.4217, "stage", 4)
        if part == "window":
            assert grow._window.entries == [] and state["window"] == {"entries": []}
        else:
            assert grow._window is None and "window" not in state
