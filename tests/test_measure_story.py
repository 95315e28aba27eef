"""`growtrain measure` says which question it answers (the first-order value of a new block, not
the trial's or the realized gain) and, on a checkpoint whose fit ended growth, how its verdict
relates to the fit's (read from the growth callback's state in the checkpoint)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from growtrain.experiments.measure import QUESTION, fit_verdict, relation_to_fit, run_measure
from growtrain.module import ImageClassifier
from tests.test_restore import fit, tiny_dm


def _checkpoint(finished, stop_reason, last):
    state = {"finished": finished, "stop_reason": stop_reason, "history": [{"action": "grow"}, last]}
    return {"callbacks": {"ModelCheckpoint{...}": {"best_model_score": 0.1}, "GrowUntilSaturated{'monitor': None}": state}}


def test_the_fits_verdict_is_read_from_the_checkpoint_and_related():
    grow_here = SimpleNamespace(saturated=False, best_site="layer1.1")
    saturated_here = SimpleNamespace(saturated=True, best_site="layer1.1")
    trial = fit_verdict(_checkpoint("saturated", "saturated: no block tried lowers the loss by 1 %", {"trial": {"x": 1}}))
    assert trial == {"finished": "saturated", "stop_reason": "saturated: no block tried lowers the loss by 1 %",
                     "checks": 2, "decided_by": "trial"}  # fmt: skip
    text = relation_to_fit(trial, grow_here)
    assert "stopped growing (saturated: no block tried lowers the loss by 1 %)" in text and "decision='trial'" in text
    assert "grow at layer1.1" in text and "do not contradict" in text
    # the fit's side is a certification that failed, not a measured absence of gain
    assert "The fit could not certify that a trained block lowers the loss by more than min_gain" in text
    assert "measured that" not in text
    assert "This report agrees" in relation_to_fit(trial, saturated_here)
    rule = fit_verdict(_checkpoint("saturated", "why", {"rule": "crossfit"}))
    assert rule["decided_by"] == "crossfit" and "this report's question" in relation_to_fit(rule, grow_here)
    budget = fit_verdict(_checkpoint("budget", "max_growths=1 reached", {"rule": "crossfit"}))
    assert "at a budget (max_growths=1 reached), not at a verdict on depth" in relation_to_fit(budget, grow_here)
    running = fit_verdict(_checkpoint(None, None, {"rule": "crossfit"}))
    assert "had not ended growth (2 check(s))" in relation_to_fit(running, grow_here)
    assert fit_verdict({"callbacks": {}}) is None and relation_to_fit(None, grow_here) is None


def test_measure_on_a_fit_that_ended_saturated_says_how_the_verdicts_relate(tmp_path):
    """A planted fit (decision="gain", an impossible min_gain) grows once, finds the block did not
    pay, undoes it and stops; measure on its last.ckpt names its question and the fit's verdict."""
    grow, _, _ = fit(tmp_path)
    assert grow.finished == "saturated"
    result = run_measure(ImageClassifier(width=4, num_classes=4), tiny_dm(),
                         ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"), output_dir=tmp_path / "measure")  # fmt: skip
    assert result.fit == {"finished": "saturated", "stop_reason": grow.stop_reason, "checks": len(grow.history),
                          "decided_by": "gain"}  # fmt: skip
    caption = result.caption()
    assert QUESTION in caption and "first-order value of one new zero-output block" in caption
    assert f"stopped growing ({grow.stop_reason})" in caption and "realized gain of the last stage" in caption
    mine = "This report agrees" if result.report.saturated else f"This report says grow at {result.report.best_site}"
    assert mine in caption
    saved = json.loads((tmp_path / "measure" / "measure.json").read_text())
    assert saved["question"] == QUESTION and saved["fit"] == result.fit and mine in saved["relation_to_fit"]
    assert QUESTION in (tmp_path / "measure" / "measure.md").read_text()
