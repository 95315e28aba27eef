"""Rich tables for saturation reports (terminal output only; no math here)."""

from __future__ import annotations

from rich.table import Table


def _fmt(value, digits: int = 4) -> str:
    if value is None:
        return "—"
    return f"{value:.{digits}g}"


def saturation_table(report, title: str | None = None) -> Table:
    """One row per candidate site, the decision in the caption."""
    verdict = "[green]saturated[/]" if report.saturated else f"[yellow]grow at {report.best_site}[/]"
    title = title or f"Saturation ({report.rule} rule): {verdict}"
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
