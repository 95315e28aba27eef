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


def gain_history():
    """A history of an earlier version's decision="gain" (removed; the growth_history.json files in
    docs/results stay plottable): grew at 11 and 20; at 29 the second block did not pay."""
    gain = lambda score, need, sat: {"rule": "gain", "score": score, "margin": need, "saturated": sat}  # noqa: E731
    base = {"gamma": 0.2, "threshold": 0.6, "margin": 0.0, "rule": "crossfit", "lower": 0.02}
    return [
        {**base, "epoch": 11, "action": "grow", "site": "layer1.1", "sites": ["layer1.1"], "depth_before": 3, "depth": 4},
        {**base, "epoch": 20, "action": "grow", "site": "layer1.2", "sites": ["layer1.2"], "depth_before": 4,
         "depth": 5, "gain": gain(0.05, 0.006, False)},
        {**base, "epoch": 29, "action": "saturated", "site": None, "sites": [], "depth_before": 5, "depth": 5,
         "gain": gain(-0.001, 0.005, True), "reason": "no certified gain: the last block did not pay"},
    ]  # fmt: skip


def test_a_gain_history_shows_the_realized_gain_panel_its_growths_and_its_stop(tmp_path):
    fig = plot_gamma_trace(gain_history(), tmp_path / "trace.png")
    gain, first, paper = fig.axes  # what decided on top
    assert _points(gain)["certified gain of the last block"] == ([20, 29], [0.05, -0.001])
    for ax in fig.axes:
        assert _vlines(ax, "C3", "-") == [11, 20] and _vlines(ax, "k", ":") == [29]
    assert {"layer1.1", "layer1.2", "stop: no certified gain"} <= set(_notes(gain))
    labels = [line.get_label() for line in gain.get_lines()]
    assert "block inserted" in labels and "growth stopped" in labels
    footer = fig._supxlabel.get_text().replace("\n", " ")
    assert "Final network: depth 5 (started at 3); blocks grown and kept: layer1.1, layer1.2." in footer
    assert "the last block did not pay" in footer
    assert (tmp_path / "trace.png").read_bytes()[:4] == b"\x89PNG"


def window(epoch, reference=None, gain=None, lower=None, upper=None, min_gain=0.01):
    """A decision="window" record's entry (growtrain/callbacks/window_check.py): the gain, its bounds and the
    probe loss at the window's start only once the window is full."""
    entry = {"window": 4, "reference_epoch": reference, "epoch": epoch, "min_gain": min_gain, "loss_now": 0.5,
             "saturated": False, "certified": False, "reason": "wait: the 4-epoch window is not full yet"}  # fmt: skip
    if gain is not None:
        saturated, certified = lower <= min_gain, upper < min_gain
        entry.update(gain_frac=gain, lower_frac=lower, upper_frac=upper, loss_before=0.6, n=200, level=0.05,
                     saturated=saturated, certified=saturated and certified)  # fmt: skip
    return entry


def window_history():
    """schedule="periodic", every 2 epochs, a 4-epoch window: waits at 1 and 3 (window not full: nothing
    compared, nothing grown), grows at 5 (the probe loss fell by a certified > 1 % since epoch 1), stops
    at 7 (its upper bound is below 1 %)."""
    base = {"gamma": 0.2, "threshold": 0.6, "margin": 0.0, "rule": "crossfit"}
    grow = lambda epoch, site, depth, entry: {**base, "epoch": epoch, "lower": 0.03, "action": "grow",  # noqa: E731
                                              "site": site, "sites": [site], "depth_before": depth,
                                              "depth": depth + 1, "certified": False, "window": entry}
    wait = lambda epoch: {**base, "epoch": epoch, "lower": 0.03, "action": "wait", "site": None,  # noqa: E731
                          "sites": [], "depth_before": 3, "depth": 3, "certified": False, "window": window(epoch)}
    return [
        wait(1),
        wait(3),
        grow(5, "layer3.1", 3, window(5, 1, 0.08, 0.05, 0.11)),
        {**base, "epoch": 7, "lower": -0.01, "action": "saturated", "site": None, "sites": [], "depth_before": 4,
         "depth": 4, "certified": True, "window": window(7, 3, 0.004, -0.002, 0.009),
         "reason": "certified saturation: the probe loss fell from epoch 3 to 7 by 0.40 %"},
    ]  # fmt: skip


def test_under_the_window_rule_the_window_panel_shows_what_decided():
    history = window_history()
    fig = plot_gamma_trace(history)
    panel, first, paper = fig.axes  # what decided on top
    full = [h for h in history if "gain_frac" in h["window"]]
    pct = lambda key: [100 * h["window"][key] for h in full]  # noqa: E731  # % of the loss
    lines = _points(panel)
    assert lines["window gain (estimate)"] == ([5, 7], pct("gain_frac"))
    assert lines["its certified lower bound (grow above min_gain)"] == ([5, 7], pct("lower_frac"))
    assert lines["its upper bound (certified saturation below min_gain)"] == ([5, 7], pct("upper_frac"))
    assert lines["min_gain"] == ([5, 7], [1.0, 1.0])
    # the checks whose window was not full compared nothing: marked at the panel's bottom, not drawn as a gain
    (empty,) = [line for line in panel.get_lines() if line.get_label().startswith("window not full yet")]
    assert list(empty.get_xdata()) == [1, 3] and empty.get_transform() is panel.get_xaxis_transform()
    assert "over the last 4 epochs against min_gain" in panel.get_title(loc="left")
    assert panel.get_ylabel() == "% of the probe loss"
    # the first-order scores only chose the site: reported, none "decided"
    lines = _points(first)
    assert lines["best certified lower bound (reported)"] == ([1, 3, 5, 7], [0.03, 0.03, 0.03, -0.01])
    assert "best certified lower bound (decided)" not in lines and "chose the site to grow" in first.get_title(loc="left")
    for ax in fig.axes:
        assert _vlines(ax, "C3", "-") == [5] and _vlines(ax, "k", ":") == [7]  # the waits grew nothing
    assert {"layer3.1", "stop: certified saturation"} <= set(_notes(panel))
    footer = fig._supxlabel.get_text().replace("\n", " ")
    assert "Final network: depth 4 (started at 3); blocks grown and kept: layer3.1." in footer
    assert "Growth stopped at epoch 7 (certified saturation): certified saturation: the probe loss fell" in footer


def test_a_window_rule_fit_whose_window_never_filled_still_has_its_panel():
    """Every check waited for a full window: the panel marks them all, with no gain drawn."""
    panel, first, paper = plot_gamma_trace(window_history()[:2]).axes
    lines = _points(panel)
    assert lines["window not full yet: nothing compared (waits)"][0] == [1, 3]
    assert "window gain (estimate)" not in lines and "min_gain" not in lines
    assert "no check's window was full yet: no gain measured" in _notes(panel)


def test_a_real_window_rule_fits_history_draws_its_panel(tmp_path):
    """The callback's own records (not the synthetic ones above): a periodic fit whose window can never pay
    (min_gain = 1000 %) waits while its window is not full, then stops at the first full one."""
    from growtrain.plots import outcome
    from tests.test_periodic import periodic_fit

    grow, *_ = periodic_fit(tmp_path, max_epochs=12, min_gain=10.0)
    history = grow.history
    empty = [h["epoch"] for h in history if "gain_frac" not in h["window"]]
    full = [h for h in history if "gain_frac" in h["window"]]
    assert empty and len(full) == 1 and history[-1] is full[0] and history[-1]["action"] == "saturated"
    panel, first, paper = plot_gamma_trace(history).axes
    lines = _points(panel)
    last = history[-1]["window"]
    assert lines["window not full yet: nothing compared (waits)"][0] == empty
    assert lines["window gain (estimate)"] == ([last["epoch"]], [100 * last["gain_frac"]])
    assert lines["its certified lower bound (grow above min_gain)"] == ([last["epoch"]], [100 * last["lower_frac"]])
    assert lines["its upper bound (certified saturation below min_gain)"] == ([last["epoch"]], [100 * last["upper_frac"]])
    assert lines["min_gain"] == ([last["epoch"]], [1000.0])
    assert "over the last 2 epochs" in panel.get_title(loc="left")
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
    footer = plot_gamma_trace(gain_history(), final=final)._supxlabel.get_text().replace("\n", " ")
    assert "depth 4 (started at 3); blocks grown and kept: layer1.1." in footer
    assert "(no certified gain): the reason" in footer  # the gain's stop certifies no upper bound
