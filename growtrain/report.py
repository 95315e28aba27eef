"""Rich tables for saturation reports (terminal output only; no math here)."""

from __future__ import annotations

from rich.table import Table


def _fmt(value, digits: int = 4) -> str:
    if value is None:
        return "—"
    return f"{value:.{digits}g}"


# What a first-order stop leaves open, per rule (growtrain/decision.py's verdicts): none is an upper bound on
# the gain, so none is "saturation"; the paper's rule says what it does rule out (Proposition 1).
_FIRST_ORDER_STOP = {
    "paper": "Γ̂ ≤ δ+t: rules out Γ ≥ δ+2t only",
    "crossfit": "no site's lower bound above δ",
}


def verdict_words(report) -> str:
    """A first-order report's verdict in words that claim no more than its rule certified:
    ``"grow at SITE"``, or for a stop ``"no certified first-order gain (…)"`` — a statistic that did not
    clear its margin, never an upper bound on what a block would gain (so never "saturated")."""
    if not report.saturated:
        return f"grow at {report.best_site}"
    why = _FIRST_ORDER_STOP.get(getattr(report, "rule", None))
    return "no certified first-order gain" + (f" ({why})" if why else "")


def saturation_table(report, title: str | None = None) -> Table:
    """One row per candidate site, the decision in the caption."""
    verdict = f"[bold]{verdict_words(report)}[/]" if report.saturated else f"[yellow]{verdict_words(report)}[/]"
    title = title or f"First-order test ({report.rule} rule): {verdict}"
    caption = (
        f"Γ̂={_fmt(report.gamma)}  δ+t={_fmt(report.threshold)}  t={_fmt(report.t)}  "
        f"bound={_fmt(report.error_bound, 3)}  n={report.n}  AG_max={_fmt(report.ag_max)}"
    )
    table = Table(title=title, caption=caption)
    crossfit = any(r.lower is not None for r in report.sites)
    for col in ("site", "‖ĝ‖", "σ̂²", "V_S", "AG", "AG(Eq.2)", "V_S/AG") + (("lower",) if crossfit else ()):
        table.add_column(col, justify="right" if col != "site" else "left")
    best = report.best_record.name
    for r in report.sites:
        row = [
            f"[bold]{r.name}[/]" if r.name == best else r.name,
            _fmt(r.grad_norm),
            _fmt(r.variance),
            _fmt(r.projected),
            _fmt(r.ag),
            _fmt(r.ag_batch),
            _fmt(r.realisability, 3),
        ]
        if crossfit:
            row.append(_fmt(r.lower))
        table.add_row(*row)
    return table
