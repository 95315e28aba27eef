"""The mission's own line, bare: what ``GrowUntilSaturated()`` with no arguments does.

    OMP_NUM_THREADS=1 python experiments/bare_default.py runs/bare_default

``Trainer(callbacks=[GrowUntilSaturated()], max_epochs=100)`` on ``ImageClassifier(in_channels=1)``
and ``ImageDataModule()`` (the embedded Fashion-MNIST subset, its defaults: augmentation on,
2,000 probe images), one thread, seed 0 — the callback docstring's quick start, as a new user
runs it. Every option is the default; the only additions are a ``ModelCheckpoint`` that keeps
``last.ckpt`` every epoch (so a cut run resumes from its last epoch, with the callback's state)
and a CSV logger. Writes ``OUT/history.json`` (every check: epoch, action, reason, depth) and
``OUT/summary.json`` (depth, stop reason, test loss, wall and check seconds).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from growtrain import GrowUntilSaturated, ImageClassifier  # noqa: E402
from growtrain.data import ImageDataModule  # noqa: E402


def main(out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    L.seed_everything(0)
    grow = GrowUntilSaturated()  # the defaults, nothing else
    # the latest epoch and last.ckpt linking it (save_top_k=0 would write last.ckpt only when the fit ends)
    last = ModelCheckpoint(dirpath=out / "checkpoints", save_last="link", save_top_k=1, every_n_epochs=1)
    trainer = L.Trainer(max_epochs=100, callbacks=[grow, last], logger=CSVLogger(out, name="logs"),
                        default_root_dir=out, enable_progress_bar=False)  # fmt: skip
    module, data = ImageClassifier(in_channels=1), ImageDataModule()
    ckpt = out / "checkpoints" / "last.ckpt"
    start = time.perf_counter()
    trainer.fit(module, data, ckpt_path=str(ckpt) if ckpt.exists() else None)
    wall = time.perf_counter() - start
    test = trainer.test(module, data, verbose=False)[0]
    history = [{k: h.get(k) for k in ("epoch", "action", "reason", "depth_before", "sites", "certified")}
               for h in grow.history]  # fmt: skip
    summary = {
        "start_depth": grow.start_depth, "depth": module.network.depth(), "growths": len(module.network.growth_log),
        "checks": len(grow.history), "finished": grow.finished, "stop_reason": grow.stop_reason,
        "lr_schedule": grow.lr_schedule, "decision": grow.decision.name, "epochs": trainer.current_epoch,
        "test": test, "wall_s_this_process": round(wall, 1), "check_s": round(grow.check_seconds, 1), "fit_s": round(grow.fit_seconds, 1),
        "command": "OMP_NUM_THREADS=1 python experiments/bare_default.py " + str(out),
    }  # fmt: skip
    (out / "history.json").write_text(json.dumps(history, indent=1))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/bare_default"))
