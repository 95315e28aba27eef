"""``GammaTracePlot``: writes the Γ̂ trace of each growth callback as ``gamma_trace.png`` at fit end."""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch import Callback

from growtrain.callbacks._select import growth_callbacks
from growtrain.plots import plot_gamma_trace

__all__ = ["GammaTracePlot", "save_gamma_trace", "final_state"]


def save_gamma_trace(trainer, pl_module=None) -> list[Path]:
    """Write ``gamma_trace.png`` for each growth callback of ``trainer`` next to its logs.

    Has the signature of ``Callback.on_fit_end(trainer, pl_module)``; call it on every rank
    (``trainer.log_dir`` broadcasts under DDP/FSDP2), rank 0 writes; a
    callback that recorded no checks is skipped. The figure is
    :func:`growtrain.plots.plot_gamma_trace` of ``GrowUntilSaturated.history``.
    """
    folder = Path(trainer.log_dir or trainer.default_root_dir)  # every rank: log_dir is a collective (broadcast)
    if not trainer.is_global_zero:
        return []
    callbacks = [cb for cb in growth_callbacks(trainer.callbacks) if getattr(cb, "history", None)]
    paths = []
    for i, cb in enumerate(callbacks):
        path = folder / ("gamma_trace.png" if i == 0 else f"gamma_trace_{i}.png")
        plot_gamma_trace(cb.history, path, final=final_state(cb))
        paths.append(path)
    return paths


def final_state(callback) -> dict:
    """What the run handed over, for the figure's footer: the network's depth and growth record
    now (after any undo), where growth started, and how and why it ended."""
    network = getattr(callback, "_network", None)
    out = {"start_depth": getattr(callback, "start_depth", None), "finished": getattr(callback, "finished", None),
           "stop_reason": getattr(callback, "stop_reason", None)}  # fmt: skip
    if network is not None:
        depth = getattr(network, "depth", None)
        out["depth"] = int(depth()) if callable(depth) else None
        out["sites"] = [dict(r).get("site") for r in getattr(network, "growth_log", [])]
    return out


class GammaTracePlot(Callback):
    """Writes ``gamma_trace.png`` (see :func:`save_gamma_trace`) when ``fit`` ends, or is stopped
    by Ctrl-C."""

    def on_fit_end(self, trainer, pl_module) -> None:
        save_gamma_trace(trainer, pl_module)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        # Ctrl-C: the growth summary printed on interrupt names gamma_trace.png among the outputs,
        # so write it. One process only: save_gamma_trace finds its folder with a collective.
        if isinstance(exception, KeyboardInterrupt) and trainer.world_size == 1:
            save_gamma_trace(trainer, pl_module)
