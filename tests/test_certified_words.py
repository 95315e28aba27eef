"""Certified words only where certified: every text a user reads about the end of growth — the
per-check header, the end-of-fit summary, gamma_trace.png and growth_history.json — says
"certified saturation" only for a stop whose verdict certified it (``Verdict.certified``: an
upper bound on one more block's gain below the margin), and "no certified gain" otherwise; the
word "saturated" never appears for an uncertified stop. (``growtrain measure``'s report, whose
first-order stops certify nothing: tests/test_measure_story.py; ``growtrain stopping``'s caption:
tests/test_stopping_plot.py.)"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from matplotlib.text import Text
from rich.console import Console

from growtrain import decision as dec
from growtrain import schedule_rules
from growtrain.callbacks import GrowUntilSaturated, Periodic, Trial, telemetry
from growtrain.callbacks.gamma_plot import final_state
from growtrain.data import ImageDataModule
from growtrain.models import cifar_resnet
from growtrain.module import ImageClassifier
from growtrain.plots import plot_gamma_trace
from growtrain.saturation import measure_saturation
from growtrain.trial import trial_verdict
from growtrain.fork import fork_verdict

# Code values, not words: the record's ``action`` ("grow" / "saturated" / "budget", read by
# programs) and the first-order report's ``paper_decision``; everything else is checked.
CODE_KEYS = {"action", "paper_decision"}


def claims(text: str) -> list[str]:
    """Every "saturated" / "saturation" a reader would take as a claim (names are not: the class
    ``GrowUntilSaturated``, the option ``on_saturated``)."""
    text = text.replace("GrowUntilSaturated", "").replace("on_saturated", "")
    return re.findall(r"saturat\w*", text, flags=re.IGNORECASE)


def render(renderable) -> str:
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def strings(value, key=None):
    """Every string value of a JSON document, except under the code-valued keys."""
    if isinstance(value, dict):
        return [s for k, v in value.items() if k not in CODE_KEYS for s in strings(v, k)]
    if isinstance(value, list):
        return [s for v in value for s in strings(v, key)]
    return [value] if isinstance(value, str) else []


def figure_text(fig) -> str:
    """Every text artist of the figure: titles, axis labels, legends, annotations, footer."""
    return "\n".join(t.get_text() for t in fig.findobj(Text))


SMALL = {"site": "layer3.1", "paid": False, "lower_frac": 0.001, "gain_frac": 0.003, "upper_frac": 0.005,
         "level": 0.0167, "n": 12000}  # fmt: skip
WIDE = {"site": "layer1.1", "paid": False, "lower_frac": -0.01, "gain_frac": 0.005, "upper_frac": 0.02,
        "level": 0.0167, "n": 500}  # fmt: skip
FORK = {"gain_frac": -0.005, "level": 0.05, "n": 100}

# every rule's stop, and whether it certified saturation (an upper bound below the margin)
STOPS = {
    "trial, every upper bound below min_gain": (lambda: trial_verdict([SMALL], 0.01), True),
    "trial, not resolved below min_gain": (lambda: trial_verdict([SMALL, WIDE], 0.01), False),
    "trial, a trial diverged": (lambda: trial_verdict([{"site": "layer1.1", "diverged": True}, SMALL], 0.01), False),
    "trial, at chance level": (lambda: trial_verdict([SMALL], 0.01, chance="the network is at chance level"), False),
    "stage fork, upper bound below min_gain": (
        lambda: fork_verdict({**FORK, "lower_frac": -0.02, "upper_frac": 0.005}, site="layer1.1, layer2.1",
                             min_gain=0.01, horizon="8 epoch(s)"), True),  # fmt: skip
    "stage fork, not resolved": (
        lambda: fork_verdict({**FORK, "lower_frac": -0.02, "upper_frac": 0.03}, site="layer1.1, layer2.1",
                             min_gain=0.01, horizon="8 epoch(s)"), False),  # fmt: skip
    "paper rule": (lambda: dec.paper_verdict(0.1, "layer1.1", 0.0, 0.5), False),
    "cross-fit rule": (lambda: dec.crossfit_verdict([-0.1, 0.0], ["layer1.1", "layer2.1"], 0.0, 0.01), False),
}


@pytest.fixture(scope="module")
def probed():
    """A real network and its first-order report (the header's table is the report's)."""
    torch.manual_seed(0)
    net = cifar_resnet((1, 1, 1), 4, "basic", 3, 4)
    g = torch.Generator().manual_seed(0)
    probe = [(torch.randn(16, 3, 8, 8, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(4)]
    report = measure_saturation(net, probe, F.cross_entropy, rule="crossfit", variance=True, projected=False)
    return net, report


def history_of(verdict, net, report) -> list[dict]:
    """A grow check and the stop ``verdict`` made, as the callback records them (decide_growth,
    then telemetry.check_record with the verdict's ``certified``)."""
    common = dict(growths=1, max_growths=None)
    grow = {"check": 0, "epoch": 4, "step": 40, "depth_before": 3}
    grow.update(telemetry.check_record(report, "grow", "grow: the block at layer1.1 pays", ["layer1.1"], net, 4))
    action, reason, sites = schedule_rules.decide_growth(saturated=verdict.saturated, ranked=[], reason=verdict.reason, **common)
    stop = {"check": 1, "epoch": 9, "step": 90, "depth_before": 4, verdict.rule: verdict.to_dict()}
    stop.update(telemetry.check_record(report, action, reason, sites, net, 4, certified=verdict.certified))
    return [telemetry.plain(grow), telemetry.plain(stop)]


def texts_of(history: list[dict], report) -> dict[str, str]:
    """What a user reads, place by place."""
    stop = history[-1]
    summary = telemetry.fit_summary(history, start_depth=3, final_depth=4, finished="saturated",
                                    stop_reason=stop["reason"], metrics={"val_loss": 0.5}, probe_seconds=1.0,
                                    fit_seconds=10.0, outputs=["runs/x/growth_history.json"])  # fmt: skip
    fig = plot_gamma_trace(history, final={"start_depth": 3, "depth": 4, "finished": "saturated",
                                           "stop_reason": stop["reason"]})  # fmt: skip
    return {"header": render(telemetry.check_table(report, stop)), "summary": render(summary),
            "plot": figure_text(fig), "history": "\n".join(strings(json.loads(json.dumps(history))))}  # fmt: skip


@pytest.mark.parametrize("name", list(STOPS))
def test_every_text_says_certified_saturation_only_where_the_verdict_certified_it(name, probed):
    make, certified = STOPS[name]
    verdict = make()
    assert verdict.saturated and verdict.certified is certified  # the field is the verdict's, from its numbers
    net, report = probed
    history = history_of(verdict, net, report)
    stop = history[-1]
    assert stop["action"] == "saturated" and stop["certified"] is certified and stop["saturated"] is certified
    assert stop[verdict.rule]["certified"] is certified  # the verdict's dict in the history carries it too
    texts = texts_of(history, report)
    if certified:
        for place, text in texts.items():
            assert "certified saturation" in text, place
        assert "no certified gain" not in texts["header"] + texts["summary"]
        return
    for place, text in texts.items():
        assert claims(text) == [], (place, text)
    # and the stop says what it is instead, in the header, the summary's headline and the figure's stop mark
    for place in ("header", "summary", "plot"):
        assert "no certified gain" in texts[place], place
    assert "stopped growing: no certified gain" in texts["summary"]
    assert "stop: no certified gain" in texts["plot"] and "(no certified gain)" in texts["plot"]


def test_the_logged_saturated_metric_is_one_only_at_a_certified_stop(probed):
    net, report = probed
    logged = []
    trainer = SimpleNamespace(loggers=[SimpleNamespace(log_metrics=lambda m, step: logged.append(m))], global_step=9)
    for name, (make, certified) in STOPS.items():
        record = history_of(make(), net, report)[-1]
        telemetry.log_check(trainer, report, record)
        assert logged[-1]["growth/saturated"] == float(certified), name
        # per-site figures are always logged and kept (log_sites was removed)
        assert {f"growth/{r.name}/grad_norm": float(r.grad_norm) for r in report.sites}.items() <= logged[-1].items()
        assert record["site_scores"] == telemetry.plain([r.to_dict() for r in report.sites]), name


def test_check_record_certifies_nothing_it_was_not_told_and_no_grow(probed):
    """A caller that passes no ``certified`` gets the conservative record; a grow is never a stop."""
    net, report = probed
    told_nothing = telemetry.check_record(report, "saturated", "no certified gain: x", [], net, 4)
    assert told_nothing["saturated"] is False and told_nothing["certified"] is False
    grow = telemetry.check_record(report, "grow", "grow: x", ["layer1.1"], net, 4, certified=True)
    assert grow["saturated"] is False and grow["certified"] is False
    budget = telemetry.check_record(None, "budget", "max_growths=1 reached", [], net, 4, certified=True)
    assert budget["certified"] is False
    assert "budget" in telemetry.check_table(None, {**budget, "check": 2, "epoch": 9, "step": 90})


def tiny_dm(**kw) -> ImageDataModule:
    kw = dict(dataset="synthetic", image_size=8, synthetic_size=200, synthetic_classes=4, probe_size=40,
              val_size=40, batch_size=32, augment=False) | kw  # fmt: skip
    return ImageDataModule(**kw)


def test_a_real_fit_that_stops_uncertified_never_says_saturated(tmp_path, monkeypatch):
    """Through the callback: the paper's rule with a huge t stops at the first check (Γ̂ ≤ δ+t
    bounds the gain below δ+2t only: not certified). The printed header and summary, the
    written growth_history.json and the figure all say "no certified gain"."""
    printed = []
    monkeypatch.setattr(telemetry, "rank_zero_info", printed.append)  # no progress bar: the texts are logged
    L.seed_everything(0)
    grow = GrowUntilSaturated(schedule="periodic", decision="rule", rule="paper", t=1e3, verbose=True)
    trainer = L.Trainer(max_epochs=3, callbacks=[grow], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
                        default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(ImageClassifier(width=4, num_classes=4), tiny_dm())
    assert [h["action"] for h in grow.history] == ["saturated"] and grow.finished == "saturated"
    saved = json.loads(Path(telemetry.history_path(trainer)).read_text())
    assert saved[0]["saturated"] is False and saved[0]["certified"] is False
    fig = plot_gamma_trace(grow.history, final=final_state(grow))
    texts = {"header and summary": "\n".join(printed), "history": "\n".join(strings(saved)),
             "plot": figure_text(fig)}  # fmt: skip
    assert any("growth check 0" in m for m in printed) and any("stopped growing" in m for m in printed)
    for place, text in texts.items():
        assert claims(text) == [], (place, text)
        # the rule's own reason says "no certified first-order gain"; the header, summary and figure "no certified gain"
        assert "no certified" in text and (place == "history" or "no certified gain" in text), place


def test_a_real_fit_that_stops_certified_says_so(tmp_path, monkeypatch):
    """Through the callback: with min_gain = 500 % every tried block's upper bound is below it,
    a certified stop; the header, summary and record say "certified saturation"."""
    printed = []
    monkeypatch.setattr(telemetry, "rank_zero_info", printed.append)
    L.seed_everything(0)
    grow = GrowUntilSaturated(schedule=Periodic(every_n_epochs=2, anneal_epochs=1), lr_schedule="anneal",
                              on_saturated="anneal", decision=Trial(min_gain=5.0, epochs=0.5), verbose=True)  # fmt: skip
    trainer = L.Trainer(max_epochs=8, callbacks=[grow], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
                        default_root_dir=tmp_path)  # fmt: skip
    model = ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], family="basic", in_channels=3,
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))  # fmt: skip
    trainer.fit(model, tiny_dm(synthetic_size=400, probe_size=120))
    stop = grow.history[-1]
    assert stop["reason"].startswith("certified saturation")  # the verdict's own words (trial.py)
    assert stop["certified"] is True and stop["saturated"] is True
    assert "certified saturation" in "\n".join(m for m in printed if "growth check" in m)
