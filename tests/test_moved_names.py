"""Names that moved keep working at their old import path for one release, with a warning."""

from __future__ import annotations

import importlib

import pytest

MOVED = [
    ("growtrain.trainer", "ComputeMeter", "growtrain.callbacks"),
    ("growtrain.trainer", "forward_flops", "growtrain.callbacks"),
    ("growtrain.trainer", "growth_callbacks", "growtrain.callbacks"),
    ("growtrain.trainer", "sibling_trainer", "growtrain.experiments._training"),
    ("growtrain.trainer", "evaluate", "growtrain.experiments._training"),
    ("growtrain.plots", "GammaTracePlot", "growtrain.callbacks"),
    ("growtrain.plots", "save_gamma_trace", "growtrain.callbacks"),
]


@pytest.mark.parametrize("old, name, new", MOVED)
def test_old_path_warns_and_gives_the_same_object(old, name, new):
    with pytest.warns(DeprecationWarning, match=rf"{old}\.{name} moved to .*import it from"):
        obj = getattr(importlib.import_module(old), name)
    assert obj is getattr(importlib.import_module(new), name)


def test_unknown_names_still_raise_attribute_error():
    import growtrain.trainer

    with pytest.raises(AttributeError, match="no_such_name"):
        growtrain.trainer.no_such_name  # noqa: B018


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

    grow = GrowUntilSaturated(monitor=None)
    assert growth_callbacks([EarlyStopping(monitor="x"), grow]) == [grow]
    assert growth_callbacks(grow) == [grow] and growth_callbacks(None) == []


def test_chen_qin_names_say_where_they_went():
    import growtrain.crossfit

    with pytest.raises(AttributeError, match="chen_qin_test moved to bench/chen_qin.py"):
        growtrain.crossfit.chen_qin_test  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        growtrain.crossfit.nope  # noqa: B018
