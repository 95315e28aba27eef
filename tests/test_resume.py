"""Kill-and-resume of a grown run; load_from_checkpoint; weights_only checkpoints.

An uninterrupted run and a run that crashes after a growth and is resumed from its last
checkpoint with ``trainer.fit(ckpt_path=...)`` must end with the same architecture and
bit-identical weights (CPU, ``deterministic=True``, ``seed_everything``). The train sampler is
seeded by epoch (``set_epoch``), because Lightning does not checkpoint the global RNG that a
plain shuffling DataLoader draws from. Whole file: about half a minute.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.optim.lr_scheduler import MultiStepLR, StepLR
from torch.utils.data import DataLoader, Sampler

from growtrain.callbacks import GrowUntilSaturated, Periodic
from growtrain.data import ImageDataModule
from growtrain.data.datamodule import _as_batch
from growtrain.module import ImageClassifier


class EpochSampler(Sampler[int]):
    """A shuffle that depends on the epoch only (Lightning calls ``set_epoch``)."""

    def __init__(self, length: int, seed: int = 0):
        self.length, self.seed, self.epoch = length, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * 10_000 + self.epoch)
        return iter(torch.randperm(self.length, generator=g).tolist())

    def __len__(self) -> int:
        return self.length


class ResumableData(ImageDataModule):
    def train_dataloader(self) -> DataLoader:
        ds = self._subset("train", self.train_indices, train=True)
        return DataLoader(ds, batch_size=self.batch_size, sampler=EpochSampler(len(ds)), drop_last=True,
                          collate_fn=_as_batch)  # fmt: skip


class Crash(L.Callback):
    def __init__(self, epoch: int):
        self.epoch = epoch

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == self.epoch:
            raise RuntimeError("simulated crash")


SCHEDULES = {
    "continue": (lambda opt: MultiStepLR(opt, milestones=[2, 4], gamma=0.5), 3),
    # crash at epoch 2's start: the checkpoint of epoch 1 holds a pending scheduler restart
    "restart": (lambda opt: StepLR(opt, step_size=1, gamma=0.7), 2),
    # checks counted in optimizer steps (5 an epoch, a check 8 steps after the last: epochs 1 and 3);
    # crash at epoch 2's start: a resume that lost the last check's step (10) would check at epoch 2
    "steps": (lambda opt: MultiStepLR(opt, milestones=[2, 4], gamma=0.5), 2),
}


def _run(root: Path, mode: str, *, crash: int | None = None, ckpt: str | None = None):
    L.seed_everything(0)
    data = ResumableData(dataset="synthetic", image_size=8, synthetic_size=240, synthetic_classes=4,
                         probe_size=48, val_size=16, batch_size=32, augment=False)  # fmt: skip
    scheduler, _ = SCHEDULES[mode]
    module = ImageClassifier(width=4, num_classes=4, optimizer=lambda p: torch.optim.AdamW(p, lr=5e-3),
                             lr_scheduler=scheduler)  # fmt: skip
    # t tiny: every check grows; checks at the ends of epochs 1 and 3
    # steps: the rule decides
    every = ({"schedule": Periodic(min_steps_between_checks=8), "decision": "rule", "lr_schedule": "continue"}
             if mode == "steps" else {"schedule": Periodic(every_n_epochs=2), "decision": "trial", "lr_schedule": mode})
    grow = GrowUntilSaturated(rule="paper", t=1e-9, max_growths=2, verbose=False, **every)
    callbacks = [grow, ModelCheckpoint(dirpath=root, save_last=True, every_n_epochs=1)]
    if crash is not None:
        callbacks.append(Crash(crash))
    trainer = L.Trainer(max_epochs=5, callbacks=callbacks, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, deterministic=True,
                        default_root_dir=root)  # fmt: skip
    if crash is not None:
        with pytest.raises(RuntimeError, match="simulated crash"):
            trainer.fit(module, data)
    else:
        trainer.fit(module, data, ckpt_path=ckpt)
    return module, grow, trainer


# Resumed into the checkpoint folder of the run it continues, as a user resumes: Lightning warns
# that the folder is not empty. Its noise, not growtrain's; filtered for this test only.
@pytest.mark.filterwarnings(
    r"ignore:Checkpoint directory .* exists and is not empty:UserWarning:lightning\.pytorch\.callbacks\.model_checkpoint"
)
@pytest.mark.parametrize("mode", sorted(SCHEDULES))
def test_kill_and_resume_matches_an_uninterrupted_run(tmp_path, mode):
    full, full_cb, full_trainer = _run(tmp_path / "full", mode)
    assert [h["action"] for h in full_cb.history] == ["grow", "grow"]
    assert [h["epoch"] for h in full_cb.history] == [1, 3]
    if mode == "steps":
        assert [h["step"] for h in full_cb.history] == [10, 20]

    crashed, crashed_cb, _ = _run(tmp_path / "crashed", mode, crash=SCHEDULES[mode][1])
    assert len(crashed.network.growth_log) == 1  # it crashed after the first growth only
    last = tmp_path / "crashed" / "last.ckpt"
    resumed, resumed_cb, resumed_trainer = _run(tmp_path / "crashed", mode, ckpt=str(last))

    assert resumed.network.growth_log == full.network.growth_log and len(full.network.growth_log) == 2
    assert resumed_cb.history == full_cb.history  # callback state (incl. check index) round-tripped
    a, b = full.state_dict(), resumed.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]) if torch.is_tensor(a[key]) else a[key] == b[key], key
    opt_a, opt_b = full_trainer.optimizers[0], resumed_trainer.optimizers[0]
    assert [g["name"] for g in opt_a.param_groups] == [g["name"] for g in opt_b.param_groups] == ["base", "growth0", "growth1"]
    assert [g["lr"] for g in opt_a.param_groups] == [g["lr"] for g in opt_b.param_groups]


def test_load_from_checkpoint_rebuilds_the_grown_model_and_loads_weights_only(tmp_path):
    module, grow, _ = _run(tmp_path, "continue")
    path = tmp_path / "last.ckpt"
    raw = torch.load(path, weights_only=True)  # plain data throughout
    assert len(raw["growtrain"]["growth"]) == 2
    (state,) = [v for k, v in raw["callbacks"].items() if k.startswith("GrowUntilSaturated")]
    assert state["growths"] == 2 and [h["site"] for h in state["history"]] == [r["site"] for r in raw["growtrain"]["growth"]]

    loaded = ImageClassifier.load_from_checkpoint(path)
    assert loaded.network.growth_log == module.network.growth_log
    assert loaded.network.depth() == module.network.depth() == 5
    x = torch.randn(6, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    module.eval(), loaded.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), module(x), rtol=0, atol=0)
