"""Every name has one import path: the package was never released, so the pre-release
deprecation shims (``growtrain.callback``, ``growtrain.trainer.ComputeMeter``, …) are gone."""

from __future__ import annotations

import importlib

import pytest

GONE = [
    ("growtrain.trainer", "ComputeMeter"),
    ("growtrain.trainer", "forward_flops"),
    ("growtrain.trainer", "growth_callbacks"),
    ("growtrain.trainer", "sibling_trainer"),
    ("growtrain.trainer", "evaluate"),
    ("growtrain.plots", "GammaTracePlot"),
    ("growtrain.plots", "save_gamma_trace"),
    ("growtrain.crossfit", "chen_qin_test"),
    # decision.py holds the decisions only: the schedule's and the action's functions are in
    # growtrain.schedule_rules, the insertion's tolerance in growtrain.growable
    ("growtrain.decision", "should_check"),
    ("growtrain.decision", "plateau_update"),
    ("growtrain.decision", "budget_reason"),
    ("growtrain.decision", "decide_growth"),
    ("growtrain.decision", "insertion_tolerance"),
]


@pytest.mark.parametrize("module, name", GONE)
def test_old_paths_are_gone(module, name):
    with pytest.raises(AttributeError, match=name):
        getattr(importlib.import_module(module), name)


def test_removed_shim_modules_are_gone():
    # read the package directory, not the import system: an editable install of another checkout
    # can serve a module this one no longer has
    from pathlib import Path

    import growtrain

    package = Path(growtrain.__file__).parent
    assert not (package / "callback.py").exists() and not (package / "_deprecation.py").exists()
    assert not [p for p in package.rglob("*.py") if "moved_names" in p.read_text()]


def test_callbacks_package_serves_every_callback_without_warning(recwarn):
    from lightning.pytorch import Callback

    from growtrain import GrowUntilSaturated
    from growtrain.callbacks import ComputeMeter, GammaTracePlot, TrainLossEarlyStopping
    from growtrain.callbacks import GrowUntilSaturated as from_package

    assert from_package is GrowUntilSaturated
    assert all(issubclass(c, Callback) for c in (ComputeMeter, GammaTracePlot, TrainLossEarlyStopping, GrowUntilSaturated))
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning) and "growtrain" in str(w.message)]


def test_growth_callbacks_finds_only_growth_callbacks():
    from lightning.pytorch.callbacks import EarlyStopping

    from growtrain import GrowUntilSaturated
    from growtrain.callbacks import growth_callbacks

    grow = GrowUntilSaturated(schedule="periodic", decision="trial")
    assert growth_callbacks([EarlyStopping(monitor="x"), grow]) == [grow]
    assert growth_callbacks(grow) == [grow] and growth_callbacks(None) == []
