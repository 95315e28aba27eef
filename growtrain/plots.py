"""Figures: the Γ̂ trace of a growth run and the depth sweep (PNG, matplotlib's Agg renderer).

Uses matplotlib's object API (``matplotlib.figure.Figure``), never ``pyplot``: no global
backend is switched, so importing this in a notebook or a headless job changes nothing.
Each function returns the ``Figure`` and writes ``path``. The callback that writes the Γ̂ trace
at the end of a fit is :class:`growtrain.callbacks.GammaTracePlot`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence


__all__ = ["plot_gamma_trace", "plot_sweep", "plot_stopping", "grew", "outcome"]


def grew(record: dict) -> bool:
    """Whether a growth check inserted a block (its ``action`` is ``"grow"``; records without
    an action: a site and not saturated)."""
    if "action" in record:
        return record["action"] == "grow"
    return record.get("site") is not None and not record.get("saturated", False)


def outcome(record: dict) -> str:
    """What a check did, in words that claim no more than its verdict certified: ``"grow"``,
    ``"budget"``, ``"certified saturation"`` (the record's ``certified``: an upper bound on one more
    block's gain below the margin) or ``"no certified gain"`` (growth ended on a lower bound that did
    not clear the margin: a gain above it was not ruled out). The record's ``action`` stays the code
    value ``"saturated"`` for both stops; every text a user reads (the check's header, the
    end-of-fit summary, this module's figure) says it with these words instead."""
    action = record.get("action")
    if action == "saturated":
        return "certified saturation" if record.get("certified") else "no certified gain"
    return str(action)


def _figure(size=(7.0, 4.0)):
    from matplotlib.figure import Figure

    return Figure(figsize=size, layout="constrained")


def _whole_epochs(ax, xs: Sequence[float]) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if xs and min(xs) == max(xs):  # one check: a few whole epochs around it, not 19.00-21.00
        ax.set_xlim(xs[0] - 1, xs[0] + 1)


def _against_need(ax, x, need, need_label: str, ylabel: str, title: str) -> None:
    """A decision panel's common part: what the statistic had to exceed, the zero line, the labels."""
    ax.plot(x, need, "_", color="C3", ms=14, mew=2, label=need_label)
    ax.axhline(0.0, color="0.6", lw=0.6)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9, loc="left")


def _trial(record: dict) -> dict | None:
    """The block-only trial verdict of a check (``decision="trial"``), if any."""
    return record.get("trial") or (record.get("verdicts") or {}).get("trial")


def _fork(record: dict) -> dict | None:
    """The stage fork's entry of a check (``decision="stage_fork"``, the periodic schedule), if any."""
    fork = record.get("fork")
    return fork if isinstance(fork, dict) else (record.get("verdicts") or {}).get("fork")


def _best_trial(trial: dict) -> dict | None:
    """The tried block the verdict rests on: the best certified lower bound among the trials that did not diverge."""
    usable = [t for t in trial.get("trials") or [] if not t.get("diverged") and t.get("lower_frac") is not None]
    return max(usable, key=lambda t: t["lower_frac"]) if usable else None


def _stop_record(history: Sequence[dict]) -> dict | None:
    """The check that ended growth (its verdict, or a budget), if one did."""
    return next((h for h in reversed(history) if h.get("action") in ("saturated", "budget")), None)


def _final_text(history: Sequence[dict], final: dict | None) -> str:
    """The network handed over and why growth stopped, for the figure's footer."""
    import textwrap

    final = final or {}
    grown = [s for h in history if grew(h) for s in (h.get("sites") or [h.get("site")])]
    kept = final.get("sites", grown)
    start = final.get("start_depth", history[0].get("depth_before"))
    depth = final.get("depth", history[-1].get("depth"))
    parts = [f"Final network: depth {depth if depth is not None else '?'}"
             + (f" (started at {start})" if start is not None else "")
             + f"; blocks grown and kept: {', '.join(map(str, kept)) or 'none'}."]  # fmt: skip
    stop = _stop_record(history)
    reason = final.get("stop_reason") or (stop or {}).get("reason")
    if stop is None and final.get("finished") is None:
        parts.append("Growth had not ended when the fit stopped (max_epochs or another callback).")
    else:
        where = f" at epoch {stop['epoch']}" if stop is not None and stop.get("epoch") is not None else ""
        # without the stop's record there is no ``certified`` to read: outcome() then claims no certification
        words = outcome(stop if stop is not None else {"action": final.get("finished")})
        parts.append(f"Growth stopped{where} ({words}): {reason}")
    lines = [line for part in parts for line in textwrap.wrap(part, 150)]
    return "\n".join(lines if len(lines) <= 5 else lines[:4] + [lines[4][:146] + " …"])


def plot_gamma_trace(history: Sequence[dict], path: str | Path | None = None, title: str | None = None,
                     final: dict | None = None):  # fmt: skip
    """What decided each growth check, against the epoch at whose end it ran, and what the run did.

    Top, what decided: with ``decision="trial"`` (a ``trial`` record) the block-only trials —
    the best tried block's held-out gain (fraction of the loss), its certified lower bound and
    ``min_gain`` (grow when the bound is above it); with ``decision="stage_fork"`` (a ``fork`` record,
    the periodic schedule) the arm's paired probe gain over the run in % of the loss, its certified
    lower bound (grow when above ``min_gain``) and its upper bound ("certified saturation" when
    below), checks that only opened a fork marked at the bottom of the panel (nothing compared).
    Then the first-order test — the best site's certified (cross-fit) lower bound
    against the rule's threshold (``margin``: δ); with
    ``rule="paper"``, Γ̂ against δ+t — which decides under ``decision="rule"`` (then it is the
    top panel) and otherwise only chose the sites. Filled markers decided a check; hollow ones
    were reported only. Bottom, secondary: Γ̂ and δ+t.

    Every panel marks each growth (red) and the check that ended growth (black, dotted); the
    footer gives the final network (depth, blocks kept) and why growth stopped.

    ``history``: ``GrowUntilSaturated.history``. ``final`` (optional, from the callback):
    ``depth``, ``start_depth``, ``sites`` (the growth record's sites), ``finished``,
    ``stop_reason``; without it they come from the history. Checks without an epoch are placed
    at their ``step``.
    """
    if not history:
        raise ValueError("history: no growth checks to plot (the callback recorded none)")
    xkey = "epoch" if all(h.get("epoch") is not None for h in history) else "step"
    measured = [h for h in history if h.get("gamma") is not None]  # budget stops run no probe
    trials = [h for h in history if _trial(h) and _best_trial(_trial(h))]
    forks = [h for h in history if _fork(h)]
    paper = bool(measured) and all(h.get("rule") == "paper" for h in measured)
    rows = 2 + bool(trials) + bool(forks)
    fig = _figure((8.5, 2.3 * rows + 1.0))
    axes = fig.subplots(rows, 1, sharex=True, height_ratios=[2] * (rows - 1) + [1.2])
    # what decided comes first (the fork or the trials), then the first-order test that chose the
    # sites or decided itself, then the paper's quantities
    names = ["fork"] * bool(forks) + ["trial"] * bool(trials) + ["first", "paper"]
    panel = dict(zip(names, axes))
    first, paper_ax, trial_ax, fork_ax = panel["first"], panel["paper"], panel.get("trial"), panel.get("fork")
    # -- the first-order test: lower bound vs threshold (or Γ̂ vs δ+t for the paper rule) ---------------------
    value_key, need_key = ("gamma", "threshold") if paper else ("lower", "margin")
    pts = [h for h in measured if h.get(value_key) is not None]
    for decided in (True, False):
        sel = [h for h in pts if (not _trial(h) and not _fork(h)) == decided]
        if sel:
            first.plot([h[xkey] for h in sel], [h[value_key] for h in sel], "o", color="C0",
                       fillstyle="full" if decided else "none",
                       label=(r"$\hat\Gamma$" if paper else "best certified lower bound")
                       + (" (decided)" if decided else " (reported)"))  # fmt: skip
    needs = [h for h in pts if h.get(need_key) is not None]
    if needs:
        first.plot([h[xkey] for h in needs], [h[need_key] for h in needs], "_", color="C3", ms=14, mew=2,
                   label=r"$\delta+t$: grow above" if paper else "threshold δ: grow above")  # fmt: skip
    first.set_ylabel("gradient norm")
    what = "Γ̂ against δ+t" if paper else "certified lower bound against its threshold"
    chose = " (chose the trial sites)" if trials else " (chose the fork's sites)" if forks else ""
    first.set_title("first-order test: " + what + chose, fontsize=9, loc="left")
    # -- decision="stage_fork": the arm's paired gain over the run, its bounds, against min_gain (% of the loss) --
    if fork_ax is not None:
        _fork_panel(fork_ax, forks, xkey)
    # -- decision="trial": the best tried block's held-out gain and its lower bound vs min_gain ------------------
    if trial_ax is not None:
        tx = [h[xkey] for h in trials]
        best = [_best_trial(_trial(h)) for h in trials]
        trial_ax.plot(tx, [b["gain_frac"] for b in best], "s", color="C2", fillstyle="none",
                      label="best tried block: held-out gain (estimate)")  # fmt: skip
        trial_ax.plot(tx, [_trial(h)["lower_frac"] for h in trials], "^", color="C2",
                      label="its certified lower bound (decided)")  # fmt: skip
        _against_need(trial_ax, tx, [_trial(h)["min_gain"] for h in trials], "min_gain: grow when the bound is above",
                      "fraction of the loss", "block-only trial: the best new block's held-out loss drop against min_gain")
    # -- secondary: the paper's Γ̂ and δ+t -----------------------------------------------------------------------
    x = [h[xkey] for h in measured]
    paper_ax.plot(x, [h["gamma"] for h in measured], "o-", color="0.4", ms=3, lw=0.8, label=r"$\hat\Gamma$ (paper)")
    thresholds = [h for h in measured if h.get("threshold") is not None]
    if thresholds:
        paper_ax.plot([h[xkey] for h in thresholds], [h["threshold"] for h in thresholds], "--", color="0.6", lw=0.8,
                      label=r"$\delta+t$ (paper)")  # fmt: skip
    paper_ax.set_ylabel("gradient norm", fontsize=8)
    paper_ax.set_title("secondary: the paper's Proposition 1 quantities" + ("" if not paper else " (deciding here)"),
                       fontsize=8, loc="left")  # fmt: skip
    _mark_events(axes, history, xkey)
    for ax in axes:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: never over the data
    _whole_epochs(paper_ax, [h[xkey] for h in history])
    paper_ax.set_xlabel("epoch (a check runs at its end)" if xkey == "epoch" else "training step")
    fig.suptitle(title or "Growth checks: what decided each one", fontsize=10)
    fig.supxlabel(_final_text(history, final), fontsize=7.5, x=0.01, ha="left", multialignment="left")
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
    return fig


def _fork_panel(ax, forks: Sequence[dict], xkey: str) -> None:
    """decision="stage_fork": per check, the cooled arm's paired probe gain over the cooled run
    (estimate, certified lower bound, upper bound; % of the run's loss) against ``min_gain``; a check
    that only opened a fork compared nothing and is marked at the panel's bottom, not as a value."""
    full = [h for h in forks if _fork(h).get("gain_frac") is not None]
    empty = [h for h in forks if _fork(h).get("gain_frac") is None]
    if full:
        fx = [h[xkey] for h in full]
        pct = lambda key: [100 * _fork(h)[key] for h in full]  # noqa: E731
        ax.plot(fx, pct("gain_frac"), "s", color="C2", fillstyle="none", label="the arm's gain (estimate)")
        ax.plot(fx, pct("lower_frac"), "^", color="C2", label="its certified lower bound (grow above min_gain)")
        ax.plot(fx, pct("upper_frac"), "v", color="C1", fillstyle="none",
                label="its upper bound (certified saturation below min_gain)")  # fmt: skip
        ax.vlines(fx, pct("lower_frac"), pct("upper_frac"), color="C2", lw=0.8, alpha=0.6)  # the bounds' interval
        _against_need(ax, fx, [100 * _fork(h)["min_gain"] for h in full], "min_gain", "% of the probe loss", "")
    if empty:
        ax.plot([h[xkey] for h in empty], [0.04] * len(empty), "|", color="0.45", ms=12, mew=2,
                transform=ax.get_xaxis_transform(), label="a fork opened: nothing compared yet")  # fmt: skip
    if not full:
        ax.text(0.5, 0.5, "no fork was judged yet: no gain measured", transform=ax.transAxes, ha="center",
                va="center", color="0.45", fontsize=8)  # fmt: skip
    ax.set_ylabel("% of the probe loss")
    ax.set_title("stage fork: the arm's paired probe gain over the run (both cooled) against min_gain", fontsize=9,
                 loc="left")  # fmt: skip


def _mark_events(axes, history: Sequence[dict], xkey: str) -> None:
    """Growths (red) and the end of growth (black, dotted) on every panel,
    named on the top one; zero kept in view (a gain can be negative)."""
    stop = _stop_record(history)
    for ax in axes:
        for h in history:
            if grew(h):
                ax.axvline(h[xkey], color="C3", lw=0.8, alpha=0.6)
        if stop is not None:
            ax.axvline(stop[xkey], color="k", lw=1.0, ls=":")
        ax.set_ylim(bottom=min(0.0, ax.get_ylim()[0]))
    first = axes[0]
    for h in history:  # growths hang from the top, the stop stands on the bottom: never on each other
        if grew(h):
            text = ", ".join(h.get("sites") or [str(h.get("site"))])
            first.annotate(text, (h[xkey], 1.0), xycoords=("data", "axes fraction"), rotation=90, va="top",
                           ha="right", fontsize=7, color="C3")  # fmt: skip
        if h is stop:
            first.annotate(f"stop: {outcome(h)}", (h[xkey], 0.0), xycoords=("data", "axes fraction"), rotation=90,
                           va="bottom", ha="left", fontsize=7, color="k")  # fmt: skip
    first.axvline(float("nan"), color="C3", lw=0.8, label="block inserted")  # legend entries only
    if stop is not None:
        first.axvline(float("nan"), color="k", lw=1.0, ls=":", label="growth stopped")


def plot_sweep(rows: Sequence[dict], path: str | Path | None = None, *, depth_label: str = "depth", stop_depth=None):
    """Figure 1: train/test loss (left) and AG_max, Γ̂, δ+t (right, log scale) against depth."""
    if not rows:
        raise ValueError("rows: nothing to plot")
    rows = sorted(rows, key=lambda r: r["depth"])
    x = [r["depth"] for r in rows]
    fig = _figure((10.0, 4.0))
    left, right = fig.subplots(1, 2)
    for key, style, label in (("train_loss", "o-", "train loss"), ("test_loss", "s-", "test loss")):
        ys = [r.get(key) for r in rows]
        if any(y is not None for y in ys):
            left.plot(x, [float("nan") if y is None else y for y in ys], style, label=label)
    left.set_ylabel("loss")
    for key, style, label in (("ag_max", "o-", r"$AG_{\max}$"), ("gamma", "s-", r"$\hat\Gamma$"), ("threshold", "--", r"$\delta+t$")):
        ys = [r.get(key) for r in rows]
        if any(y is not None for y in ys):
            right.plot(x, [float("nan") if y is None else y for y in ys], style, label=label)
    right.set_yscale("log")
    right.set_ylabel("gradient norm")
    for ax in (left, right):
        ax.set_xlabel(f"depth ({depth_label})")
        if stop_depth is not None:
            ax.axvline(stop_depth, color="C3", ls=":", label=f"growth stopped ({depth_label}={stop_depth})")
        ax.legend(fontsize=8)
    fig.suptitle("Loss and activation-gradient signal across depth")
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
    return fig


def plot_stopping(summary: dict, growth_rows: Sequence[dict], path: str | Path | None = None):
    """Left: the scratch sweep's test loss against depth (mean ± sd), ``d*`` and each growth
    seed's found depth marked (AutoGrow's Figure 5 style). Right: with ``min_gain``, every growth
    seed's certified gain at each check, with ``min_gain`` (``decision="trial"``: the best tried
    block's lower bound; ``"stage_fork"``: the fork's); empty under ``decision="rule"``. A growth
    run that found no depth (its fit ended before growth did) is drawn hollow."""
    fig = _figure((10.0, 4.0))
    left, right = fig.subplots(1, 2)
    label = summary.get("depth_kwarg", "depth")
    by_depth = summary.get("by_depth", {})
    if by_depth:
        xs = sorted(int(d) for d in by_depth)
        mean = [by_depth[d]["test_loss"][0] if d in by_depth else by_depth[str(d)]["test_loss"][0] for d in xs]
        sd = [(by_depth[d] if d in by_depth else by_depth[str(d)])["test_loss"][1] or 0.0 for d in xs]
        left.errorbar(xs, mean, yerr=sd, fmt="o-", capsize=3, label="scratch (mean ± sd)")
        if summary.get("d_star") is not None:
            left.axvline(summary["d_star"], color="C2", ls="--", label=f"d* = {summary['d_star']}")
    # a growth run whose fit ended before growth did (no check, or none that stopped it) found no
    # depth: it is drawn hollow, at the depth it had, and not called "found"
    found = [g for g in growth_rows if g.get("stopped")]
    unfinished = [g for g in growth_rows if not g.get("stopped")]
    if found:
        left.plot([g["depth"] for g in found], [g["test_loss"] for g in found], "v", color="C3", ms=9, ls="none",
                  label="growth (found depth)")  # fmt: skip
    if unfinished:
        left.plot([g["depth"] for g in unfinished], [g["test_loss"] for g in unfinished], "v", color="C3", ms=9,
                  ls="none", fillstyle="none", label="growth not ended by the fit's end (depth reached, not found)")  # fmt: skip
    from matplotlib.ticker import MaxNLocator

    left.xaxis.set_major_locator(MaxNLocator(integer=True))  # depths are whole blocks
    left.set_xlabel(f"depth ({label})")
    left.set_ylabel("test loss")
    if left.get_legend_handles_labels()[0]:  # no rows (e.g. --train=false on an empty output folder): no legend
        left.legend(fontsize=8)
    else:
        left.text(0.5, 0.5, "no rows yet", transform=left.transAxes, ha="center", va="center", color="0.5")
    trials = [[h for h in g.get("history", []) if (h.get("verdicts") or {}).get("trial")] for g in growth_rows]
    # a fork verdict with a bound: a judged fork (a check that opened one compared nothing)
    forks = [[h for h in g.get("history", []) if ((h.get("verdicts") or {}).get("fork") or {}).get("lower_frac")
              is not None] for g in growth_rows]  # fmt: skip
    if any(trials):
        _plot_trials(right, growth_rows, trials)
    elif any(forks):
        _plot_trials(right, growth_rows, forks, key="fork", ylabel="the fork's certified gain / the run's loss")
    fig.suptitle("Growth until saturated vs a from-scratch depth sweep")
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
    return fig


def _plot_trials(ax, growth_rows: Sequence[dict], trials: Sequence[Sequence[dict]], key: str = "trial",
                 ylabel: str = "best tried block: certified gain / loss") -> None:  # fmt: skip
    """decision="trial": each growth seed's best tried block's certified held-out gain (lower
    bound, fraction of the loss) against the blocks at the check, with ``min_gain``;
    ``key="fork"``: the stage fork's certified gain of its arm over the run, likewise."""
    from matplotlib.ticker import MaxNLocator

    min_gain = None
    for i, (g, hist) in enumerate(zip(growth_rows, trials)):
        if hist:
            verdicts = [h["verdicts"][key] for h in hist]
            ax.plot([h["depth_before"] for h in hist], [v["lower_frac"] for v in verdicts], "o-", color=f"C{i}",
                    label=f"seed {g['seed']}")  # fmt: skip
            min_gain = verdicts[0]["min_gain"]
    if min_gain is not None:
        ax.axhline(min_gain, color="C3", ls=":", label=f"min_gain = {min_gain:.2g}")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("blocks at the check")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
