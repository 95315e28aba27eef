"""The decision rules through ``measure_saturation`` and the callback's options.

* every verdict a pass can compute is reported, and the deciding rule is named;
* the callback's options fail loudly on bad input, naming the argument.
"""

from __future__ import annotations

import pytest
from torch.nn import functional as F

from growtrain import decision as dec
from growtrain.callbacks import Converged, GrowUntilSaturated, Periodic, Rule, Trial
from growtrain.saturation import measure_saturation
from tests.helpers import make_net, probe_batches


def test_every_verdict_is_reported_and_the_deciding_rule_named():
    net = make_net("basic")
    report = measure_saturation(net, probe_batches("basic", n=32), F.cross_entropy, rule="crossfit", projected=False,
                                variance=True)  # fmt: skip
    assert report.rule == "crossfit" and set(report.verdicts) == {"paper", "crossfit"}
    # without σ̂² (the cross-fit rule's default: no per-sample gradients) there is no paper verdict
    quick = measure_saturation(net, probe_batches("basic", n=32), F.cross_entropy, rule="crossfit", projected=False)
    assert set(quick.verdicts) == {"crossfit"} and quick.threshold is None
    assert [r.lower for r in quick.sites] == pytest.approx([r.lower for r in report.sites], rel=1e-9)
    chosen = report.verdicts["crossfit"]
    assert (report.saturated, report.best_site, report.margin) == (chosen.saturated, chosen.site, chosen.margin)
    d = report.to_dict()
    assert d["verdicts"]["paper"]["margin"] == pytest.approx(report.threshold)
    assert not {"reference", "tau", "ratio"} & set(d)


@pytest.mark.parametrize(
    "cls, kwargs, match",
    [
        (Converged, {"min_stage_epochs": 0},
         r"Converged\.min_stage_epochs: expected an integer >= 1; got 0\. Fix: pass Converged\(min_stage_epochs=1\)"),
        (Converged, {"min_rel_delta": -0.1}, r"Converged\.min_rel_delta: expected a finite number >= 0"),
        (Periodic, {"anneal_epochs": 0}, r"Periodic\.anneal_epochs: expected an integer >= 1"),
        (GrowUntilSaturated, {"on_saturated": "finish"}, r"on_saturated: expected one of \('stop', 'continue', 'anneal'\)"),
        (GrowUntilSaturated, {"rule": "relatve"},
         r"rule: expected one of \('paper', 'crossfit'\); got 'relatve'\. Fix: pass rule='paper'"),
    ],
)
def test_bad_options_name_the_argument(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


def test_defaults_tie_checks_to_convergence_and_judge_growth_by_its_gain():
    grow = GrowUntilSaturated(schedule="converged")
    assert (grow.rule, grow.schedule.monitor, grow.decision) == ("crossfit", "train_loss", Trial(min_gain=0.01))
    assert dec.DEFAULT_MIN_GAIN == 0.01 and GrowUntilSaturated(schedule="converged", decision="rule").decision == Rule()
    assert GrowUntilSaturated(schedule="converged", t=0.5).rule == "paper"  # t is the paper rule's threshold
