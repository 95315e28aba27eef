"""stopping.png of a scaled-down run: a growth seed whose fit ended before any check (or before
growth ended) found no depth and is not drawn as if it had; depths are whole numbers; under
decision="trial" the right panel shows the trials' certified gains against min_gain."""

from __future__ import annotations

from growtrain.plots import plot_stopping


def _summary():
    return {"depth_kwarg": "added", "d_star": 1,
            "by_depth": {0: {"test_loss": (0.50, 0.01)}, 1: {"test_loss": (0.45, 0.02)}}}  # fmt: skip


def _labels(ax):
    return {line.get_label(): line for line in ax.get_lines()}


def test_a_seed_with_no_verdict_is_not_a_found_depth():
    rows = [{"seed": 0, "depth": 0, "test_loss": 0.52, "stopped": None, "history": []},
            {"seed": 1, "depth": 1, "test_loss": 0.46, "stopped": "saturated", "history": []}]  # fmt: skip
    left = plot_stopping(_summary(), rows).axes[0]
    lines = _labels(left)
    assert list(lines["growth (found depth)"].get_xdata()) == [1]  # only the seed whose growth ended
    unfinished = lines["growth not ended by the fit's end (depth reached, not found)"]
    assert list(unfinished.get_xdata()) == [0] and unfinished.get_fillstyle() == "none"
    assert all(float(t).is_integer() for t in left.get_xticks())  # no 0.25-block ticks


def test_under_the_trial_rule_the_right_panel_is_the_trials_bound():
    def check(blocks, lower):
        return {"depth_before": blocks, "verdicts": {"trial": {"lower_frac": lower, "min_gain": 0.01}}}

    rows = [{"seed": s, "depth": 1, "test_loss": 0.45, "stopped": "saturated",
             "history": [check(3, 0.04 + s / 100), check(4, -0.002)]} for s in (0, 1)]  # fmt: skip
    right = plot_stopping(_summary(), rows).axes[1]
    lines = _labels(right)
    assert list(lines["seed 0"].get_ydata()) == [0.04, -0.002] and list(lines["seed 1"].get_ydata()) == [0.05, -0.002]
    assert list(lines["seed 0"].get_xdata()) == [3, 4]
    assert lines["min_gain = 0.01"].get_ydata()[0] == 0.01
    assert all(float(t).is_integer() for t in right.get_xticks())


def test_the_stopping_table_does_not_call_a_run_without_a_verdict_stopped_by_none():
    """A scaled-down run whose growth seed never checked: its caption says growth did not end,
    not "seed 0: None", and its row does not read as a found depth."""
    from rich.console import Console

    from growtrain.experiments.stopping import StoppingResult

    growth = [{"seed": 0, "depth": 0, "test_loss": 0.52, "train_loss": 0.5, "epochs": 2, "flops": 1e9,
               "stopped": None, "history": []}]  # fmt: skip
    scratch = [{"seed": 0, "depth": d, "test_loss": 0.5, "train_loss": 0.5, "epochs": 2, "flops": 1e9} for d in (0, 1)]
    console = Console(width=300, record=True, file=__import__("io").StringIO())
    console.print(StoppingResult(scratch=scratch, growth=growth, depth_kwarg="added", d_star=0).table())
    text = " ".join(console.export_text().split())
    assert "seed 0: None" not in text and "seed 0: not ended" in text
    assert "growth → 0" not in text and "growth (not ended) at 0" in text


def test_the_stopping_caption_says_what_each_seeds_stop_certified():
    """The caption's "growth stopped by:" names each seed's stop as its last check's record says it (plots.outcome):
    "certified saturation" only where that check's verdict was certified, else "no certified gain";
    a budget is a budget; never the bare code value "saturated"."""
    from rich.console import Console

    from growtrain.experiments.stopping import StoppingResult

    def row(seed, stopped, last):
        return {"seed": seed, "depth": 1, "test_loss": 0.46, "train_loss": 0.4, "epochs": 9, "flops": 1e9,
                "stopped": stopped, "history": [{"action": "grow", "certified": False}, last]}  # fmt: skip

    growth = [row(0, "saturated", {"action": "saturated", "certified": False}),
              row(1, "saturated", {"action": "saturated", "certified": True}),
              row(2, "budget", {"action": "budget", "certified": False}),
              row(3, "saturated", {"action": "saturated"})]  # an older row: no "certified" kept  # fmt: skip
    scratch = [{"seed": 0, "depth": d, "test_loss": 0.5, "train_loss": 0.5, "epochs": 2, "flops": 1e9} for d in (0, 1)]
    console = Console(width=400, record=True, file=__import__("io").StringIO())
    console.print(StoppingResult(scratch=scratch, growth=growth, depth_kwarg="added", d_star=1).table())
    text = " ".join(console.export_text().split())
    assert ("growth stopped by: seed 0: no certified gain; seed 1: certified saturation; seed 2: budget; "
            "seed 3: no certified gain") in text
    assert "saturated" not in text.split("growth stopped by:")[1]


def test_an_empty_output_folder_plots_without_a_warning():
    """`stopping --train=false` on a folder with no rows yet: a figure that says so, no legend warning."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        left = plot_stopping({"depth_kwarg": "added", "d_star": None, "by_depth": {}}, []).axes[0]
    assert [t.get_text() for t in left.texts] == ["no rows yet"] and left.get_legend() is None


def test_a_folder_with_rows_keeps_its_legend():
    """The other branch: with a sweep and growth rows the left panel has its legend, no placeholder."""
    rows = [{"seed": 0, "depth": 1, "test_loss": 0.46, "stopped": "saturated", "history": []}]
    left = plot_stopping(_summary(), rows).axes[0]
    legend = left.get_legend()
    assert legend is not None and list(left.texts) == []
    assert {t.get_text() for t in legend.get_texts()} == {"scratch (mean ± sd)", "d* = 1", "growth (found depth)"}
