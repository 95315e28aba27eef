"""Checkpoints written by growtrain before the option removal of the eighth session (commit ba9df4c; docs/results/history.md), read by
tests/test_old_checkpoints.py. Made with that commit on the path (a worktree of it at /work/frozen):

    cd /tmp/oldck && PYTHONPATH=/work/frozen OMP_NUM_THREADS=1 python tests/data/old_checkpoints/make.py

then old_trial.ckpt and old_gain.ckpt copied here (the last.ckpt of each fit: 2 epochs, 2 growths by
the block-only trial; 1 epoch, 1 growth by the stage-gain decision, its reference and snapshot kept).
"""
import shutil, lightning as L, torch
from lightning.pytorch.callbacks import ModelCheckpoint
from growtrain.callbacks import GrowUntilSaturated
from growtrain.data import ImageDataModule
from growtrain.module import ImageClassifier
torch.set_num_threads(1)
for name, opts in {"trial": dict(decision="trial", min_gain=0.0, trial_epochs=0.2, trial_holdout=0),
                   "gain": dict(decision="gain", min_gain=0.0, restore_best=True)}.items():
    L.seed_everything(0)
    dm = ImageDataModule(dataset="synthetic", image_size=8, synthetic_size=300, synthetic_classes=4, probe_size=64,
                         val_size=16, batch_size=32, augment=False)
    model = ImageClassifier(width=4, num_classes=4)
    grow = GrowUntilSaturated(monitor=None, every_n_epochs=1, rule="paper", t=1e-9, max_growths=3, verbose=False,
                              cooldown=0, alpha_spending="constant", **opts)
    ck = ModelCheckpoint(dirpath=f"/tmp/oldck/{name}", save_last=True, save_top_k=0)
    tr = L.Trainer(max_epochs=1 if name == "gain" else 2, callbacks=[grow, ck], logger=False, enable_progress_bar=False,
                   enable_model_summary=False, limit_val_batches=1, default_root_dir=f"/tmp/oldck/{name}")
    tr.fit(model, dm)
    print(name, [h["action"] for h in grow.history], model.network.depth())
    shutil.copy(f"/tmp/oldck/{name}/last.ckpt", f"/tmp/oldck/old_{name}.ckpt")
