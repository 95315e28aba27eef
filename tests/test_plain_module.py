"""A plain LightningModule (no growtrain mixin, a plain optimizer over ``self.parameters()``)
grown by the callback: its checkpoint restores by ``torch.load`` + ``load_state_dict`` into a
fresh module and by ``load_from_checkpoint``, with the grown network's outputs, and a fit cut
after a growth resumes into the uninterrupted run (the same weights, bit for bit, and the same
optimizer layout and state) on a plain shuffling loader, with no RandomStateCheckpoint added. Tiny CPU runs; about twenty seconds.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.nn import functional as F

from growtrain.callbacks import GrowUntilSaturated, Periodic
from growtrain.data import ImageDataModule
from growtrain.growable import grown_blocks
from growtrain.models import cifar_resnet

# the datamodule has a validation split the plain module does not use: Lightning says so, once per fit
pytestmark = pytest.mark.filterwarnings("ignore:You passed in a `val_dataloader` but have no `validation_step`")


class PlainModule(L.LightningModule):
    """What a user writes: a growable network as a submodule, and nothing from growtrain else."""

    def __init__(self, scheduler: bool = False):
        super().__init__()
        self.scheduler = scheduler
        self.network = cifar_resnet(width=4, num_classes=4)

    def forward(self, x):
        return self.network(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        if not self.scheduler:
            return optimizer
        # LambdaLR: its per-group lr_lambdas are not in its state dict, so the callback must extend them
        return [optimizer], [torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 0.8**epoch)]


class Crash(L.Callback):
    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 3:
            raise RuntimeError("simulated crash")


def _fit(root: Path, *, crash: bool = False, ckpt: str | None = None, scheduler: bool = False):
    L.seed_everything(0)
    # a plain shuffling loader (torch's global generator) and no RandomStateCheckpoint: the callback keeps
    # the random state in the checkpoint itself, so the resumed fit draws the uncut fit's batches
    data = ImageDataModule(dataset="synthetic", image_size=8, synthetic_size=240, synthetic_classes=4, probe_size=48,
                val_size=16, batch_size=32, augment=False)  # fmt: skip
    module = PlainModule(scheduler)
    # t tiny: each check (the ends of epochs 1 and 3) grows one block
    grow = GrowUntilSaturated(schedule=Periodic(every_n_epochs=2), decision="trial", rule="paper", t=1e-9,
                              max_growths=2, lr_schedule="continue", verbose=False)  # fmt: skip
    callbacks = [grow, ModelCheckpoint(dirpath=root, save_last=True, every_n_epochs=1)] + ([Crash()] if crash else [])
    trainer = L.Trainer(max_epochs=5, callbacks=callbacks, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, deterministic=True,
                        default_root_dir=root)  # fmt: skip
    if crash:
        with pytest.raises(RuntimeError, match="simulated crash"):
            trainer.fit(module, data)
    else:
        trainer.fit(module, data, ckpt_path=ckpt)
    return module, trainer


def _outputs(module: L.LightningModule) -> torch.Tensor:
    module.eval()
    with torch.no_grad():
        return module(torch.randn(6, 3, 8, 8, generator=torch.Generator().manual_seed(1)))


@pytest.fixture(scope="module", params=[False, True], ids=["no-scheduler", "lambdalr"])
def full(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("full")
    # one thread, as the tests that compare with it run (the function-scoped _one_thread fixture is set up after this)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        module, trainer = _fit(root, scheduler=request.param)
    finally:
        torch.set_num_threads(threads)
    assert len(module.network.growth_log) == 2 and module.network.depth() == 5
    return root, module, trainer, request.param


def test_a_plain_modules_grown_checkpoint_loads_into_a_fresh_module(full):
    root, module, _, scheduler = full
    raw = torch.load(root / "last.ckpt", weights_only=True)  # plain data throughout
    # the callback's copy of the record (no module mixin writes one): what an FSDP2 resume reads first
    assert raw["growtrain"]["growth"] == module.network.growth_log and len(module.network.growth_log) == 2

    fresh = PlainModule(scheduler)  # ungrown: the state dict's growth record rebuilds it before its blocks load
    assert fresh.network.depth() == 3
    fresh.load_state_dict(raw["state_dict"])  # strict
    assert fresh.network.growth_log == module.network.growth_log
    torch.testing.assert_close(_outputs(fresh), _outputs(module), rtol=0, atol=0)

    loaded = PlainModule.load_from_checkpoint(root / "last.ckpt", scheduler=scheduler)
    assert loaded.network.depth() == 5
    torch.testing.assert_close(_outputs(loaded), _outputs(module), rtol=0, atol=0)


def test_an_ungrown_networks_weights_without_a_record_load_strictly():
    """No record (a network never grown, or weights from outside growtrain): nothing to replay, and
    the missing extra state is not an error."""
    source = PlainModule()
    state = {k: v for k, v in source.state_dict().items() if not k.endswith("_extra_state")}
    fresh = PlainModule()
    fresh.load_state_dict(state)  # strict
    torch.testing.assert_close(_outputs(fresh), _outputs(source), rtol=0, atol=0)


def test_a_fresh_fit_of_a_grown_plain_module_keeps_the_users_optimizer_groups(full, tmp_path):
    """Not a resume: the user's configure_optimizers layout is theirs (every parameter in their one
    group), and the callback records where the fit's checkpoints went (the Ctrl-C message reads it)."""
    root, module, _, scheduler = full
    grown = PlainModule.load_from_checkpoint(root / "last.ckpt", scheduler=scheduler)
    data = ImageDataModule(dataset="synthetic", image_size=8, synthetic_size=240, synthetic_classes=4, probe_size=48,
                           val_size=16, batch_size=32, augment=False)  # fmt: skip
    grow = GrowUntilSaturated(schedule=Periodic(every_n_epochs=2), decision="trial", max_growths=0,
                              lr_schedule="continue", verbose=False)
    trainer = L.Trainer(max_epochs=1, callbacks=[grow, ModelCheckpoint(dirpath=tmp_path, save_last=True)],
                        logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(grown, data)
    (group,) = trainer.optimizers[0].param_groups
    assert {id(p) for p in group["params"]} == {id(p) for p in grown.parameters()}
    assert grow.last_save is not None and grow.last_save["epoch"] == 0


def test_a_grown_state_dict_without_its_growth_record_does_not_load_silently(full):
    _, module, _, _ = full
    state = {k: v for k, v in module.state_dict().items() if not k.endswith("_extra_state")}
    with pytest.raises(RuntimeError, match="Unexpected key"):
        PlainModule().load_state_dict(state)  # the grown blocks' keys have nowhere to go
    with pytest.raises(ValueError, match="extra state"):
        PlainModule().load_state_dict({**module.state_dict(), "network._extra_state": "{\"blocks\": 2}"})


# Resumed into the checkpoint folder of the run it continues: Lightning's warning, not growtrain's.
@pytest.mark.filterwarnings(
    r"ignore:Checkpoint directory .* exists and is not empty:UserWarning:lightning\.pytorch\.callbacks\.model_checkpoint"
)
def test_a_plain_module_cut_after_a_growth_resumes_into_the_uninterrupted_fit(full, tmp_path):
    _, uncut, uncut_trainer, scheduler = full
    cut, _ = _fit(tmp_path, crash=True, scheduler=scheduler)
    assert len(cut.network.growth_log) == 1  # cut after the first growth
    resumed, trainer = _fit(tmp_path, ckpt=str(tmp_path / "last.ckpt"), scheduler=scheduler)

    assert resumed.network.growth_log == uncut.network.growth_log
    a, b = uncut.state_dict(), resumed.state_dict()
    assert a.keys() == b.keys()
    for key in a:  # the weights, and the growth record (the network's extra state)
        assert torch.equal(a[key], b[key]) if torch.is_tensor(a[key]) else a[key] == b[key], key
    # growth's layout: the user's group, then one zero-state group per growth, in growth order
    opt, want = trainer.optimizers[0], uncut_trainer.optimizers[0]
    assert [len(g["params"]) for g in opt.param_groups] == [len(g["params"]) for g in want.param_groups]
    assert [g.get("name") for g in opt.param_groups] == [None, "growth0", "growth1"]
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in want.param_groups]  # the schedule too
    for block_now, block_then in zip(grown_blocks(resumed.network), grown_blocks(uncut.network)):
        for p, q in zip(block_now.parameters(), block_then.parameters()):
            assert torch.equal(opt.state[p]["momentum_buffer"], want.state[q]["momentum_buffer"])
