"""Every error the probe and growth code raises, triggered through the public API.

Each test checks the message names the argument or the batch and says what to do, and, for
errors in a fit, that it comes before any training step or leaves the model as it was.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from growtrain import GrowUntilSaturated
from growtrain.data import ImageDataModule
from growtrain.module import ImageClassifier


class CountSteps(L.Callback):
    def __init__(self):
        self.steps = 0

    def on_train_batch_start(self, *args):
        self.steps += 1


def _trainer(tmp_path, callbacks, max_epochs=2):
    return L.Trainer(max_epochs=max_epochs, callbacks=callbacks, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                     default_root_dir=tmp_path, accelerator="cpu")  # fmt: skip


def _dm(**kw) -> ImageDataModule:
    args = dict(dataset="synthetic", image_size=8, synthetic_size=128, synthetic_classes=4, probe_size=32,
                val_size=16, batch_size=16, augment=False)  # fmt: skip
    return ImageDataModule(**(args | kw))


# -- an empty probe is refused before training -------------------------------------------------
def test_empty_probe_is_refused_before_any_training_step(tmp_path):
    steps = CountSteps()
    grower = GrowUntilSaturated(schedule="periodic", decision="trial", verbose=False)
    calls = []
    real_setup = GrowUntilSaturated.setup
    grower.setup = lambda *a, **k: (calls.append("setup"), real_setup(grower, *a, **k))  # noqa: E731
    with pytest.raises(ValueError, match=r"probe_size: expected an integer >= 1 when a probe is used.*got 0"):
        _trainer(tmp_path, [steps, grower]).fit(ImageClassifier(width=4, in_channels=3, num_classes=4),
                                               _dm(probe_size=0))  # fmt: skip
    assert steps.steps == 0 and calls == ["setup"]
    assert grower.start_depth is None  # refused in setup: on_train_start never ran


def test_probe_size_zero_is_fine_without_a_probe():
    dm = _dm(probe_size=0)
    dm.setup("fit")
    assert len(dm.probe_indices) == 0 and len(dm.train_dataloader()) > 0
    with pytest.raises(ValueError, match="probe_size"):
        dm.probe_dataloader()


# -- measure_saturation: the probe pass ---------------------------------------------------------
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

from growtrain import GrowableStack  # noqa: E402
from growtrain.crossfit import crossfit_from_samples, crossfit_lower_bound  # noqa: E402
from growtrain.saturation import candidate_blocks, measure_saturation  # noqa: E402


class Res(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 3), nn.Linear(3, 4)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


def _zero_res() -> Res:
    block = Res()
    nn.init.zeros_(block.fc2.weight)
    nn.init.zeros_(block.fc2.bias)
    return block


def _stack() -> GrowableStack:
    torch.manual_seed(0)
    return GrowableStack([Res()], _zero_res, ("fc2.weight", "fc2.bias")).eval()


def _batches(n=24, batch=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 4, generator=gen), torch.randint(0, 4, (n,), generator=gen)
    return [(x[i : i + batch], y[i : i + batch]) for i in range(0, n, batch)]


def test_non_zero_output_candidate():
    net = _stack()
    cands = candidate_blocks(net)
    with torch.no_grad():
        cands["blocks.1"].block.fc2.bias.fill_(0.1)
    with pytest.raises(ValueError, match=r"candidates: the block for blocks\.1 is not zero-output"):
        measure_saturation(net, _batches(), F.cross_entropy, candidates=cands)


def test_non_scalar_loss():
    with pytest.raises(ValueError, match=r"loss_fn: expected a scalar mean loss, got shape \(8,\)"):
        measure_saturation(_stack(), _batches(), lambda out, y: F.cross_entropy(out, y, reduction="none"))


def test_non_finite_activation_gradient_with_a_finite_loss():
    def loss(out, y):
        # sqrt(0) = 0 keeps the loss finite; its derivative is inf, and inf · 0 = nan upstream
        return F.cross_entropy(out, y) + torch.sqrt(out - out.detach()).sum()

    with pytest.raises(FloatingPointError, match=r"probe batch 0: non-finite activation gradient at site blocks\.\d"):
        measure_saturation(_stack(), _batches(), loss)


@pytest.mark.parametrize("rule", ["paper", "crossfit"])
def test_nan_loss_names_the_batch(rule):
    def loss(out, y):
        value = F.cross_entropy(out, y)
        return value * float("nan") if out.shape[0] == 4 else value

    batches = _batches(n=20, batch=8)  # sizes 8, 8, 4: the NaN is in batch 2
    with pytest.raises(FloatingPointError, match=r"probe batch 2: the loss is nan; no decision was made"):
        measure_saturation(_stack(), batches, loss, rule=rule)


def test_reshuffling_probe_loader_is_fine_under_crossfit(recwarn):
    """The cross-fit check reads the probe once (its calibration is folded into the pass), so a
    loader that reshuffles only makes the A/B split random: no warning, a whole report."""
    x, y = _batches(n=24, batch=24)[0]
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
    report = measure_saturation(_stack(), loader, F.cross_entropy, rule="crossfit")
    assert (report.extra["n_a"], report.extra["n_b"]) == (12, 12)
    assert not [w for w in recwarn if "probe_loader" in str(w.message)]


def test_probe_longer_than_probe_size_warns_under_crossfit():
    with pytest.warns(UserWarning, match=r"the probe loader yielded 24 samples, not the expected n=16"):
        report = measure_saturation(_stack(), iter(_batches(n=24)), F.cross_entropy, rule="crossfit", probe_size=16)
    assert report.n == 24


def test_probe_shorter_than_probe_size_is_an_error():
    with pytest.raises(ValueError, match=r"probe_loader: it yielded 8 samples.*expected n=24.*probe_size="):
        measure_saturation(_stack(), iter(_batches(n=8)), F.cross_entropy, rule="crossfit", probe_size=24)


def test_crossfit_half_with_fewer_than_two_samples():
    # probe_size=4 announces A = 2, B = 2; the loader yields 3, so B has 1 sample
    batches = [(x[:3], y[:3]) for x, y in _batches(n=8, batch=8)]
    with pytest.warns(UserWarning, match="not the expected n=4"):
        with pytest.raises(ValueError, match=r"crossfit: half B has 1 sample\(s\); it needs at least 2"):
            measure_saturation(_stack(), iter(batches), F.cross_entropy, rule="crossfit", probe_size=4)
    with pytest.raises(ValueError, match=r"probe_size: expected .*an int ≥ 4.*got 3"):
        measure_saturation(_stack(), iter(batches), F.cross_entropy, rule="crossfit", probe_size=3)
    with pytest.raises(ValueError, match=r"xi: the cross-fit split needs n ≥ 4 samples \(2 per half\), got 3"):
        crossfit_from_samples(torch.randn(3, 2), 0.05)
    with pytest.raises(ValueError, match=r"s: a lower bound needs at least 2 samples .* got 1"):
        crossfit_lower_bound(torch.randn(1), 0.05)


@pytest.mark.parametrize("rule", ["paper", "crossfit"])
def test_inputs_and_targets_of_different_lengths(rule):
    batches = _batches(n=16, batch=8)
    batches[1] = (batches[1][0], batches[1][1][:5])
    with pytest.raises(ValueError, match=r"probe_loader: a probe batch has 8 inputs but 5 targets"):
        measure_saturation(_stack(), batches, F.cross_entropy, rule=rule)


# -- NaN loss inside a fit --------------------------------------------------------------------
@pytest.mark.parametrize("rule", ["paper", "crossfit"])
def test_nan_probe_loss_inside_a_fit_stops_it_with_the_model_unchanged(tmp_path, rule):
    def nan_loss(out, y):
        return F.cross_entropy(out, y) * float("nan")

    module = ImageClassifier(width=4, in_channels=3, num_classes=4)
    grower = GrowUntilSaturated(schedule="periodic", decision="trial", loss_fn=nan_loss, rule=rule,
                                verbose=False)
    with pytest.raises(FloatingPointError, match=r"probe batch 0: the loss is nan; no decision was made"):
        _trainer(tmp_path, [grower]).fit(module, _dm())
    assert module.network.growth_log == [] and grower.history == []
    assert all(m.training for m in module.modules())  # the check restored train mode on its way out
    assert all(p.requires_grad for p in module.parameters())


# -- corrupted or mismatched checkpoints ----------------------------------------------------------
@pytest.fixture(scope="module")
def grown_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(0)
    module = ImageClassifier(width=4, in_channels=3, num_classes=4)
    module.network.grow("layer2.1")
    trainer = L.Trainer(max_epochs=1, limit_train_batches=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, default_root_dir=root, accelerator="cpu")  # fmt: skip
    trainer.fit(module, _dm())
    path = root / "grown.ckpt"
    trainer.save_checkpoint(path)
    return path


def _edited(path, tmp_path, edit):
    checkpoint = torch.load(path, weights_only=True)
    edit(checkpoint)
    out = tmp_path / "edited.ckpt"
    torch.save(checkpoint, out)
    return out


def _resume(tmp_path, module, path):
    trainer = L.Trainer(max_epochs=2, limit_train_batches=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path, accelerator="cpu")  # fmt: skip
    trainer.fit(module, _dm(), ckpt_path=path)


LOADERS = {
    "load_from_checkpoint": lambda tmp_path, path: ImageClassifier.load_from_checkpoint(path, weights_only=True),
    "fit_ckpt_path": lambda tmp_path, path: _resume(tmp_path, ImageClassifier(width=4, in_channels=3, num_classes=4),
                                                    path),  # fmt: skip
}


@pytest.mark.parametrize("how", list(LOADERS))
def test_checkpoint_recording_an_unknown_site(tmp_path, grown_checkpoint, how):
    def edit(ck):
        ck["growtrain"]["growth"][0] = {"site": "layer9.0", "stage": "layer9", "index": 0}

    with pytest.raises(ValueError, match=r"site: 'layer9.0' is not a candidate site of this network\. Valid sites"):
        LOADERS[how](tmp_path, _edited(grown_checkpoint, tmp_path, edit))


@pytest.mark.parametrize("how", list(LOADERS))
def test_checkpoint_without_its_growth_record(tmp_path, grown_checkpoint, how):
    """The weights of the inserted block have nowhere to go: the state-dict error lists them (the
    record is in two places, the checkpoint's ``growtrain`` entry and the network's extra state)."""
    def edit(ck):
        ck.pop("growtrain")
        ck["state_dict"].pop("network._extra_state")

    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\) in state_dict: .*network\.layer2\.1\."):
        LOADERS[how](tmp_path, _edited(grown_checkpoint, tmp_path, edit))


@pytest.mark.parametrize("how", list(LOADERS))
def test_checkpoint_with_a_malformed_growth_record(tmp_path, grown_checkpoint, how):
    def edit(ck):
        ck["growtrain"]["growth"][0] = {"site": "layer2.1"}

    with pytest.raises(ValueError, match=r"growth.*record.*stage"):
        LOADERS[how](tmp_path, _edited(grown_checkpoint, tmp_path, edit))


@pytest.mark.parametrize("how", [*LOADERS, "measure"])
def test_truncated_checkpoint_file(tmp_path, grown_checkpoint, how):
    """Not torch's bare OSError('[Errno 22] Invalid argument'): the error names the file and says why."""
    path = tmp_path / "truncated.ckpt"
    path.write_bytes(grown_checkpoint.read_bytes()[:5000])
    with pytest.raises(ValueError, match=r"ckpt_path: '.*truncated\.ckpt' \(5000 bytes\) is not a complete checkpoint: "
                       r"the file is truncated.*Fix: point ckpt_path at a complete checkpoint"):  # fmt: skip
        if how == "measure":
            from growtrain.experiments.runs import load_checkpoint_into

            load_checkpoint_into(ImageClassifier(width=4, in_channels=3, num_classes=4), path)
        else:
            LOADERS[how](tmp_path, path)


def test_a_file_that_is_not_a_checkpoint_is_named(tmp_path):
    from growtrain.ckpt_file import checkpoint_problem

    (tmp_path / "notes.ckpt").write_text("hello")
    (tmp_path / "empty.ckpt").write_bytes(b"")
    assert "is not a torch checkpoint (it starts with b'hell')" in checkpoint_problem(tmp_path / "notes.ckpt")
    assert "is empty" in checkpoint_problem(tmp_path / "empty.ckpt")
    with pytest.raises(ValueError, match=r"empty\.ckpt' \(0 bytes\) is empty"):
        ImageClassifier.load_from_checkpoint(tmp_path / "empty.ckpt")


def test_fit_from_a_checkpoint_into_a_differently_grown_model(tmp_path, grown_checkpoint):
    module = ImageClassifier(width=4, in_channels=3, num_classes=4)
    module.network.grow("layer3.1")
    with pytest.raises(ValueError, match=r"records: the network's existing growth differs from the recorded growth"):
        _resume(tmp_path, module, grown_checkpoint)


def test_fit_from_a_checkpoint_of_another_width(tmp_path, grown_checkpoint):
    with pytest.raises(RuntimeError, match=r"size mismatch for network\."):
        _resume(tmp_path, ImageClassifier(width=8, in_channels=3, num_classes=4), grown_checkpoint)


# -- no silent cross-entropy ------------------------------------------------------------------
class Regressor(L.LightningModule):
    """A plain LightningModule regressing 4 floats with MSE; no probe_loss."""

    def __init__(self):
        super().__init__()
        from tests.helpers import mlp_stack

        self.net = mlp_stack()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.mse_loss(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _regression_data(n=64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return list(zip(x, x.flip(1) * 0.5))


@pytest.mark.parametrize("given", [None, "mse", "soft_labels"])
def test_float_targets_of_the_outputs_shape_need_a_loss_named(tmp_path, given):
    """Cross-entropy on regression targets would score nonsense without a word: with no loss_fn and
    no probe_loss it is refused before any training step, naming loss_fn and the fix; naming the
    loss (MSE, or cross-entropy itself for soft labels) is accepted."""
    data = _regression_data()
    probe = DataLoader(data[:32], batch_size=16)
    loss = {"mse": torch.nn.functional.mse_loss, "soft_labels": torch.nn.functional.cross_entropy}.get(given)
    steps = CountSteps()
    grower = GrowUntilSaturated(schedule="periodic", rule="paper", decision="rule", probe=probe,
                                loss_fn=loss, verbose=False)  # fmt: skip
    trainer = _trainer(tmp_path, [steps, grower], max_epochs=1)
    model = Regressor()
    if given is None:
        with pytest.raises(ValueError, match=r"^loss_fn: .*cross-entropy.*floats of the output's shape \(16, 4\).*"
                                             r"Fix: pass GrowUntilSaturated\(loss_fn=") as info:
            trainer.fit(model, DataLoader(data[32:], batch_size=16))
        assert "Regressor.probe_loss" in str(info.value) and steps.steps == 0
    else:
        trainer.fit(model, DataLoader(data[32:], batch_size=16))
        assert steps.steps == 2 and len(grower.history) == 1
