"""``FirstOrderRule``: ``decision="rule"``, the first-order rule of the probe pass alone.

The same interface as ``BlockTrials`` (trial) and ``PairedFork`` (stage_fork): ``judge(inputs)`` →
``(verdict, sites to grow at, the record's entry or None)``. The report already holds the rule's
verdict (``growtrain.saturation``): saturated iff no site certifies first-order gain; it grows at
the best-ranked site. Its stop is never "certified saturation" (a lower bound that did not clear
its margin leaves a gain above it unresolved).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from growtrain.callbacks.probe_check import CheckInputs
from growtrain.decision import Verdict
from growtrain.saturation_report import rank_sites

__all__ = ["FirstOrderRule"]


class FirstOrderRule:
    key = None  # no entry of its own in a check's record: the report's fields are the record
    seconds = 0.0  # no work beyond the probe pass

    def judge(self, inputs: CheckInputs) -> tuple[Verdict, list[str], dict | None]:
        report = inputs.report
        verdict = replace(report.verdicts[report.rule], saturated=report.saturated, reason=report.reason)
        return verdict, rank_sites(report, 1), None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
