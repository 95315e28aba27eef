"""Upstream messages a growtrain user cannot act on, silenced where growtrain is the entry point:
the ``growtrain`` CLI, growtrain's trainers, and a plain Python script that uses growtrain's
Lightning parts (importing ``growtrain.module`` or ``growtrain.callbacks`` — every module class
and every callback goes through one of them — installs the filters once). Each filter matches one
message, and nothing of growtrain's own is filtered:

- Lightning's "💡 Tip: For seamless cloud ..." adverts (litlogger, litmodels) and its
  "`tensorboardX` has been removed as a dependency" warning, printed when its default logger falls
  back to CSV (growtrain's configs log CSV on purpose);
- Lightning 2.6's "`isinstance(treespec, LeafSpec)` is deprecated" warning under torch >= 2.9
  (inside Lightning's own code; nothing in a user's code triggers or can fix it).

The model summary's "Total Flops 0" and the progress bar's ``v_num`` are handled by
``growtrain.experiments._training.BaseGrowTrainer``.
"""

from __future__ import annotations

import logging
import warnings

__all__ = ["quiet_upstream_noise", "NOISE"]

# Substrings of the log records and warnings dropped (one per message).
NOISE = (
    "💡 Tip: For seamless cloud",
    "`tensorboardX` has been removed as a dependency",
    "isinstance(treespec, LeafSpec)` is deprecated",
    # growtrain's trainers install their own summary (without the FLOPs it never counted)
    "Skipping setting a default `ModelSummary` callback",
)


class _DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(noise in message for noise in NOISE)


_FILTER = _DropNoise()


def quiet_upstream_noise() -> None:
    """Install the filters (idempotent; safe at import: no Lightning import, nothing else changed).

    The log filter sits on Lightning's two rank-zero loggers and drops only the records in ``NOISE``.
    The warning filters are appended, the lowest precedence: a filter the user set (``-W``,
    ``warnings.simplefilter("always")``, pytest's ``filterwarnings``) decides before them."""
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated", append=True)
    warnings.filterwarnings("ignore", message=r"Starting from v1\.9\.0, `tensorboardX` has been removed as a dependency",
                            append=True)  # fmt: skip
