"""When growth must end so that the final phase fits: pure functions of the epoch budget.

With ``on_saturated="anneal"`` the final anneal (``anneal_epochs``) is reserved inside
``max_epochs`` under both schedules (converged and periodic): once no more than that is left,
growth ends as a budget and the anneal trains the network handed over, so no fit hands over a
network cut mid-stage. No Lightning here: the callback passes the trainer's numbers.
"""

from __future__ import annotations

__all__ = ["final_reserved", "no_room"]


def _bounded(max_epochs: int | None, on_saturated: str, finished: str | None) -> bool:
    return on_saturated == "anneal" and finished is None and max_epochs is not None and max_epochs >= 0


def final_reserved(max_epochs: int | None, current_epoch: int, anneal_epochs: int, on_saturated: str,
                   finished: str | None) -> str | None:  # fmt: skip
    """At the end of epoch ``current_epoch``: the budget reason when growth must end now, else ``None``."""
    if not _bounded(max_epochs, on_saturated, finished):
        return None
    left = max_epochs - (current_epoch + 1)
    if left > anneal_epochs:
        return None
    return (f"max_epochs={max_epochs}: the last {anneal_epochs} epoch(s) are reserved for the final anneal "
            f"({left} left after epoch {current_epoch})")  # fmt: skip


def no_room(max_epochs: int | None, current_epoch: int, anneal_epochs: int, on_saturated: str,
            finished: str | None) -> str | None:  # fmt: skip
    """At the start of training: why this fit cannot grow at all, or ``None``."""
    if not _bounded(max_epochs, on_saturated, finished) or max_epochs - current_epoch > anneal_epochs + 1:
        return None
    return (f"max_epochs={max_epochs} leaves no epoch to grow in: the last anneal_epochs={anneal_epochs} are "
            "reserved for the final anneal (on_saturated='anneal'), so growth ends at the first epoch as a budget. "
            "Fix: raise max_epochs, lower anneal_epochs, or pass on_saturated='stop'.")  # fmt: skip
