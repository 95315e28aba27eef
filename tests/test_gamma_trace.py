"""gamma_trace.png tells the run's story: every growth, the stop and its reason, the final network;
its panels show what decided under the rule in force (synthetic histories, expected values read off
the records here, not from the plotting code)."""

from __future__ import annotations

import math
from types import SimpleNamespace

from matplotlib.colors import to_rgba

from growtrain.callbacks.gamma_plot import final_state
from growtrain.plots import plot_gamma_trace


def _points(ax):
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}


def _vlines(ax, color, style):
    """x of the vertical lines of one colour and line style (``axvline``: two equal x values)."""
    out = []
    for line in ax.get_lines():
        xs = list(line.get_xdata())
        if len(xs) == 2 and xs[0] == xs[1] and not math.isnan(xs[0]) and line.get_linestyle() == style \
                and to_rgba(line.get_color())[:3] == to_rgba(color)[:3]:  # fmt: skip
            out.append(xs[0])
    return sorted(out)


def _notes(ax):
    return [t.get_text() for t in ax.texts]


def trial(min_gain, *tried):
    """A decision="trial" record's verdict: the best lower bound among the usable trials."""
    usable = [t for t in tried if not t.get("diverged")]
    return {"lower_frac": max(t["lower_frac"] for t in usable), "min_gain": min_gain, "trials": list(tried),
            "saturated": max(t["lower_frac"] for t in usable) <= min_gain}  # fmt: skip


def t(site, gain, lower, upper):
    return {"site": site, "gain_frac": gain, "lower_frac": lower, "upper_frac": upper, "diverged": False}


def trial_history():
    base = {"gamma": 0.2, "threshold": 0.6, "margin": 0.0, "rule": "crossfit"}
    return [
        {**base, "epoch": 4, "step": 50, "lower": 0.05, "action": "grow", "site": "layer1.1", "sites": ["layer1.1"],
         "depth_before": 3, "depth": 4,
         # the verdict rests on the best *lower bound* (layer1.1), not the best estimate (layer2.1)
         "trial": trial(0.01, t("layer1.1", 0.08, 0.05, 0.11), t("layer2.1", 0.09, 0.02, 0.16))},
        {**base, "epoch": 9, "step": 110, "lower": 0.01, "action": "grow", "site": "layer2.1", "sites": ["layer2.1"],
         "depth_before": 4, "depth": 5,
         "trial": trial(0.01, {"site": "layer1.2", "diverged": True}, t("layer2.1", 0.04, 0.02, 0.06))},
        {**base, "epoch": 14, "step": 170, "lower": -0.01, "action": "saturated", "site": None, "sites": [],
         "depth_before": 5, "depth": 5,
         "reason": "no certified gain: no block tried lowers the held-out loss by more than 1 %",
         "trial": trial(0.01, t("layer1.2", 0.001, -0.003, 0.005))},
    ]  # fmt: skip


def test_under_the_trial_rule_the_trial_panel_shows_what_decided():
    history = trial_history()
    fig = plot_gamma_trace(history)
    trials, first, paper = fig.axes  # what decided on top
    best = [max((x for x in h["trial"]["trials"] if not x.get("diverged")), key=lambda x: x["lower_frac"])
            for h in history]  # fmt: skip
    lines = _points(trials)
    assert lines["best tried block: held-out gain (estimate)"] == ([4, 9, 14], [b["gain_frac"] for b in best])
    assert lines["its certified lower bound (decided)"] == ([4, 9, 14], [0.05, 0.02, -0.003])
    assert lines["min_gain: grow when the bound is above"] == ([4, 9, 14], [0.01] * 3)
    # the first-order scores only chose the sites: reported (hollow), none "decided"
    lines = _points(first)
    assert lines["best certified lower bound (reported)"] == ([4, 9, 14], [0.05, 0.01, -0.01])
    assert "best certified lower bound (decided)" not in lines and "chose the trial sites" in first.get_title(loc="left")
    assert _points(paper)[r"$\delta+t$ (paper)"] == ([4, 9, 14], [0.6] * 3)
    for ax in fig.axes:  # every panel: the growths and the stop
        assert _vlines(ax, "C3", "-") == [4, 9] and _vlines(ax, "k", ":") == [14]
    assert {"layer1.1", "layer2.1", "stop: no certified gain"} <= set(_notes(trials))  # the record has no certified
    footer = fig._supxlabel.get_text().replace("\n", " ")
    assert "Final network: depth 5 (started at 3); blocks grown and kept: layer1.1, layer2.1." in footer
    assert "Growth stopped at epoch 14 (no certified gain): no certified gain: no block tried lowers" in footer


def fork(gain=None, lower=None, upper=None, min_gain=0.01):
    """A decision="stage_fork" record's entry (growtrain/callbacks/fork_check.py): a check that opened
    a fork carries no figures; a judged fork its gain, its bounds and the run's probe loss."""
    entry = {"open_new": True, "min_gain": min_gain, "reason": "fork: no fork was open; ..."}
    if gain is not None:
        saturated, certified = lower <= min_gain, upper < min_gain
        entry = {"site": "layer1.1, layer2.1, layer3.1", "min_gain": min_gain, "gain_frac": gain, "lower_frac": lower,
                 "upper_frac": upper, "loss_before": 0.6, "loss_now": 0.55, "n": 200, "level": 0.05, "cooled": True,
                 "saturated": saturated, "certified": saturated and certified, "reason": "..."}  # fmt: skip
    return entry


def fork_history():
    """schedule="periodic", every 2 epochs: a fork opens at 1 (nothing compared, nothing grown), pays at 3
    (the arm's blocks lowered the probe loss by a certified > 1 %: grown, a fork opens again), and does not
    at 5 (its upper bound is below 1 %: certified saturation)."""
    base = {"gamma": 0.2, "threshold": 0.6, "margin": 0.0, "rule": "crossfit"}
    sites = ["layer1.1", "layer2.1", "layer3.1"]
    return [
        {**base, "epoch": 1, "lower": 0.03, "action": "fork", "site": None, "sites": [], "depth_before": 3,
         "depth": 3, "certified": False, "fork": fork()},
        {**base, "epoch": 3, "lower": 0.03, "action": "grow", "site": sites[0], "sites": sites, "depth_before": 3,
         "depth": 6, "certified": False, "fork": {**fork(0.08, 0.05, 0.11), "next_site": sites}},
        {**base, "epoch": 5, "lower": -0.01, "action": "saturated", "site": None, "sites": [], "depth_before": 6,
         "depth": 6, "certified": True, "fork": fork(0.004, -0.002, 0.009),
         "reason": "certified saturation: with the blocks at layer1.1, layer2.1, layer3.1 ..."},
    ]  # fmt: skip


def test_under_the_stage_fork_its_panel_shows_what_decided():
    history = fork_history()
    fig = plot_gamma_trace(history)
    panel, first, paper = fig.axes  # what decided on top
    full = [h for h in history if "gain_frac" in h["fork"]]
    pct = lambda key: [100 * h["fork"][key] for h in full]  # noqa: E731  # % of the loss
    lines = _points(panel)
    assert lines["the arm's gain (estimate)"] == ([3, 5], pct("gain_frac"))
    assert lines["its certified lower bound (grow above min_gain)"] == ([3, 5], pct("lower_frac"))
    assert lines["its upper bound (certified saturation below min_gain)"] == ([3, 5], pct("upper_frac"))
    assert lines["min_gain"] == ([3, 5], [1.0, 1.0])
    # the check that only opened a fork compared nothing: marked at the panel's bottom, not drawn as a gain
    (empty,) = [line for line in panel.get_lines() if line.get_label().startswith("a fork opened")]
    assert list(empty.get_xdata()) == [1] and empty.get_transform() is panel.get_xaxis_transform()
    assert panel.get_title(loc="left").startswith("stage fork:") and panel.get_ylabel() == "% of the probe loss"
    # the first-order scores only chose the sites: reported, none "decided"
    lines = _points(first)
    assert lines["best certified lower bound (reported)"] == ([1, 3, 5], [0.03, 0.03, -0.01])
    assert "best certified lower bound (decided)" not in lines and "chose the fork's sites" in first.get_title(loc="left")
    for ax in fig.axes:
        assert _vlines(ax, "C3", "-") == [3] and _vlines(ax, "k", ":") == [5]  # the opening grew nothing
    footer = fig._supxlabel.get_text().replace("\n", " ")
    assert "Final network: depth 6 (started at 3)" in footer


def test_a_stage_fork_fit_whose_fork_was_never_judged_still_has_its_panel():
    """The only check opened a fork: the panel marks it, with no gain drawn."""
    panel, first, paper = plot_gamma_trace(fork_history()[:1]).axes
    lines = _points(panel)
    assert lines["a fork opened: nothing compared yet"][0] == [1]
    assert "the arm's gain (estimate)" not in lines and "min_gain" not in lines
    assert "no fork was judged yet: no gain measured" in _notes(panel)


def test_a_real_stage_fork_fits_history_draws_its_panel(tmp_path):
    """The callback's own records (not the synthetic ones above): a periodic fit whose fork can never pay
    (min_gain = 1000 %) opens one at its first check and stops when it is judged at the next."""
    from growtrain.plots import outcome
    from growtrain.callbacks import StageFork
    from tests.test_periodic import periodic_fit

    grow, *_ = periodic_fit(tmp_path, max_epochs=12, decision=StageFork(min_gain=10.0), rule="crossfit", t=None)
    history = grow.history
    empty = [h["epoch"] for h in history if "gain_frac" not in h["fork"]]
    full = [h for h in history if "gain_frac" in h["fork"]]
    assert empty == [0] and len(full) == 1 and history[-1] is full[0] and history[-1]["action"] == "saturated"
    panel, first, paper = plot_gamma_trace(history).axes
    lines = _points(panel)
    last = history[-1]["fork"]
    assert lines["a fork opened: nothing compared yet"][0] == empty
    assert lines["the arm's gain (estimate)"] == ([1], [100 * last["gain_frac"]])
    assert lines["its certified lower bound (grow above min_gain)"] == ([1], [100 * last["lower_frac"]])
    assert lines["its upper bound (certified saturation below min_gain)"] == ([1], [100 * last["upper_frac"]])
    assert lines["min_gain"] == ([1], [1000.0])
    assert f"stop: {outcome(history[-1])}" in _notes(panel)

def test_a_fit_that_ended_before_growth_did_says_so():
    history = trial_history()[:2]
    fig = plot_gamma_trace(history)
    assert all(_vlines(ax, "k", ":") == [] for ax in fig.axes)
    assert "Growth had not ended when the fit stopped" in fig._supxlabel.get_text().replace("\n", " ")


def test_the_callbacks_final_state_is_the_footer():
    """The callback's network, not the history's records, is the final architecture the figure names."""
    network = SimpleNamespace(depth=lambda: 4, growth_log=[{"site": "layer1.1", "stage": "layer1", "index": 1}])
    callback = SimpleNamespace(_network=network, start_depth=3, finished="saturated", stop_reason="the reason")
    final = final_state(callback)
    assert final == {"start_depth": 3, "finished": "saturated", "stop_reason": "the reason", "depth": 4,
                     "sites": ["layer1.1"]}  # fmt: skip
    footer = plot_gamma_trace(trial_history(), final=final)._supxlabel.get_text().replace("\n", " ")
    assert "depth 4 (started at 3); blocks grown and kept: layer1.1." in footer  # not the history's depth 5
    assert "(no certified gain): the reason" in footer  # the trial's stop record certifies no upper bound
