"""One default per concept across the entry points (documented where they differ on purpose)."""

from __future__ import annotations

import inspect

import pytest
import torch

from growtrain import GrowUntilSaturated, measure_saturation
from growtrain.callbacks.growth_config import GrowthConfig
from growtrain.decision import DEFAULT_RULE
from growtrain.experiments import run_measure, run_sweep
from growtrain.module import ImageClassifier
from growtrain.trainer import GrowTrainer


def _default(fn, name):
    return inspect.signature(fn).parameters[name].default


def test_measure_resolves_its_rule_like_the_callback(tiny_data):
    torch.manual_seed(0)
    model = ImageClassifier(width=4, num_classes=4)
    default = run_measure(model, tiny_data)
    with_t = run_measure(model, tiny_data, t=0.5)
    assert default.report.rule == DEFAULT_RULE == GrowUntilSaturated(schedule="periodic", decision="trial").rule
    assert with_t.report.rule == "paper" == GrowUntilSaturated(schedule="periodic", decision="trial", t=0.5).rule
    assert all(r.projected is not None for r in default.report.sites)  # measure reports V_S


def test_documented_defaults():
    # the decision entry points: the same rule resolution, no V_S
    assert _default(GrowTrainer.measure, "rule") is None and _default(run_measure, "rule") is None
    # the callback never computes V_S: no option asks for it (projected was removed)
    assert "projected" not in GrowthConfig.names() and not hasattr(GrowUntilSaturated(schedule="periodic",
                                                                                      decision="trial"), "projected")
    # measure is the V_S report: projected on; the sweep is a decision-free Figure 1: off
    assert _default(GrowTrainer.measure, "projected") is True and _default(run_measure, "projected") is True
    assert _default(GrowTrainer.sweep, "projected") is False and _default(run_sweep, "projected") is False
    # the paper's quantities: measure_saturation and the Figure 1 sweep keep Proposition 1
    assert _default(measure_saturation, "rule") == "paper"
    assert _default(GrowTrainer.sweep, "rule") == _default(run_sweep, "rule") == "paper"
    for fn in (GrowTrainer.measure, GrowTrainer.sweep, run_measure, run_sweep, measure_saturation):
        assert _default(fn, "alpha") == 0.05 and _default(fn, "delta") == 0.0


@pytest.mark.parametrize("bad", ["Paper", "none"])
def test_measure_refuses_unknown_rules(bad, tiny_data):
    with pytest.raises(ValueError, match="rule"):
        run_measure(ImageClassifier(width=4, num_classes=4), tiny_data, rule=bad)
