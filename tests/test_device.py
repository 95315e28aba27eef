"""Every tensor follows the network's device and dtype, checked on CPU.

There is no GPU in CI, so device-following is checked with what a CPU has:

* ``torch.set_default_device("meta")`` while a CPU network is probed and grown: a tensor
  made without ``device=`` lands on ``meta`` and the first operation mixing it with the
  network's tensors fails, so a passing run (with results equal to the run without it) shows
  that nothing in the probe takes the default device;
* float64 networks: candidates, accumulators, the report's gradients, grown blocks and the
  optimizer state of new parameters stay float64, and the reported gradient agrees with real
  insertion + autograd to float64 precision (a float32 step anywhere would lose that);
* a network split across devices (one submodule on ``meta``): a clear error naming both.

``bench/gpu.py`` runs the CUDA versions of these on a GPU machine; its CPU smoke run is here.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import growtrain.ghosts as ghosts
import growtrain.probe_pass as probe_pass
from growtrain.batches import to_device
from growtrain.decision import RULES
from growtrain import measure_saturation, replay_growth
from growtrain.models import cifar_resnet
from growtrain.optim import param_groups
from growtrain.reconfigure import add_param_groups, new_param_groups
from growtrain.saturation import candidate_blocks
try:
    from tests import helpers as H
except ImportError:  # pragma: no cover - pytest's rootdir-less import mode
    import helpers as H

ROOT = Path(__file__).resolve().parents[1]


def _net(dtype=torch.float64, family="preact"):
    return H.make_net(family, seed=0, dtype=dtype)


@pytest.fixture
def default_device_meta():
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(None)


# -- nothing takes the default device ----------------------------------------------------------
@pytest.mark.parametrize("rule", RULES)
def test_probe_ignores_the_default_device(rule):
    net, batches = _net(), H.probe_batches("preact", n=20, batch=8)
    want = measure_saturation(net, batches, H.loss_fn, rule=rule, seed=3).to_dict()
    torch.set_default_device("meta")
    try:
        got = measure_saturation(net, batches, H.loss_fn, rule=rule, seed=3).to_dict()
    finally:
        torch.set_default_device(None)
    assert got == want


def test_candidates_growth_and_replay_ignore_the_default_device(default_device_meta):
    with torch.device("cpu"):
        net = cifar_resnet((1, 1, 1), width=2, family="basic", in_channels=1, num_classes=3)
        ref = cifar_resnet((1, 1, 1), width=2, family="basic", in_channels=1, num_classes=3)
    blocks = candidate_blocks(net, seed=5)
    torch.set_default_device(None)
    want = candidate_blocks(net, seed=5)  # the same seed without a default device
    torch.set_default_device("meta")
    for name, block in blocks.items():
        for p, q in zip(block.state_dict().values(), want[name].state_dict().values()):
            assert p.device.type == "cpu" and torch.equal(p, q), name
    grown = net.grow(net.sites()[0])
    assert all(p.device.type == "cpu" for p in grown.parameters())
    added = replay_growth(ref, net.growth_log)  # a checkpoint's replay builds on the network's device
    assert len(added) == 1 and all(p.device.type == "cpu" for p in added[0].parameters())


# -- float64 end to end ------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["preact", "basic"])
def test_float64_network_candidates_report_and_growth_stay_float64(family):
    net, batches = _net(family=family), H.probe_batches(family, n=20, batch=8)
    report = measure_saturation(net, batches, H.loss_fn, rule="crossfit", seed=7)
    for r in report.sites:
        assert all(p.dtype == torch.float64 for p in r.block.parameters())
        assert all(b.dtype == torch.float64 for b in r.block.buffers() if b.is_floating_point())
        assert all(g.dtype == torch.float64 for g in r.grad)
    # Independent check: real insertion + autograd in float64. Agreement to 1e-9 holds only if
    # features, cross-gradients and sums all stayed float64 (float32 would be off by ~1e-7).
    # Without calibration: the folded calibration's half A (batch statistics) has its own oracle
    # in tests/test_crossfit.py.
    r = measure_saturation(net, batches, H.loss_fn, rule="crossfit", seed=7, calibrate=False).best_record
    oracle = H.site_oracle(net, r.site, r.block, batches)
    assert abs(r.grad_norm - oracle.grad_norm) <= 1e-9 * oracle.grad_norm
    block = net.grow(r.site, r.block)
    assert all(p.dtype == torch.float64 for p in block.parameters())


@pytest.mark.parametrize("make_optimizer", [
    lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9),
    lambda groups: torch.optim.AdamW(groups, lr=1e-3),
])  # fmt: skip
def test_optimizer_state_of_new_parameters_follows_them(make_optimizer):
    net = _net()
    net.train()
    optimizer = make_optimizer(param_groups(net))
    x, y = H.cat_batches(H.probe_batches("preact", n=8, batch=8))
    H.loss_fn(net(x), y).backward()
    optimizer.step()
    block = net.grow(net.sites()[1])
    groups, _ = new_param_groups(net, block, 0, optimizer)
    add_param_groups(optimizer, groups)
    with torch.no_grad():  # a non-zero V so that every new parameter gets a gradient
        for p in block.conv2.parameters():
            p.normal_(0, 0.1)
    optimizer.zero_grad()
    H.loss_fn(net(x), y).backward()
    optimizer.step()
    for p in block.parameters():
        for name, value in optimizer.state[p].items():
            if torch.is_tensor(value) and value.dim() > 0:
                assert value.dtype == p.dtype == torch.float64 and value.device == p.device, name


# -- bad input -----------------------------------------------------------------------------------
def test_a_network_split_across_devices_is_a_clear_error():
    net, batches = _net(), H.probe_batches("preact", n=20, batch=8)
    net.layer3.to("meta")
    with pytest.raises(ValueError, match=r"network: .*2 devices: cpu .*meta .*network\.to\(device\)"):
        measure_saturation(net, batches, H.loss_fn)
    assert net.growth_log == []  # raised before any state changed


def test_probe_batches_are_moved_to_the_network_device(monkeypatch):
    """Probe batches go through ``_to_device(batch, network device)``; the helper moves nested
    batches (checked with ``meta`` as the target, the one other device a CPU has)."""
    nested = (torch.ones(2, 3), [torch.zeros(2)], {"a": torch.ones(1)}, "label")
    moved = to_device(nested, torch.device("meta"))
    assert moved[0].is_meta and moved[1][0].is_meta and moved[2]["a"].is_meta and moved[3] == "label"

    targets = []

    def spy(obj, device):
        targets.append(torch.device(device))
        return to_device(obj, device)

    # the calibration pass (growtrain.ghosts) and the probe pass (growtrain.probe_pass) each move batches
    monkeypatch.setattr(ghosts, "to_device", spy)
    monkeypatch.setattr(probe_pass, "_to_device", spy)
    net, batches = _net(), H.probe_batches("preact", n=20, batch=8)
    measure_saturation(net, batches, H.loss_fn, calibrate=True)
    # calibration moves each input, the probe pass each input and target
    assert len(targets) == 3 * len(batches) and set(targets) == {torch.device("cpu")}


# -- bench/gpu.py smoke test -------------------------------------------------------------------
def test_gpu_bench_runs_on_cpu_quick(tmp_path, capsys):
    """In-process (a subprocess would spend most of the budget importing Lightning again)."""
    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "bench" / "gpu.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "gpu.json"
    threads = torch.get_num_threads()
    try:
        bench.main(["--device", "cpu", "--quick", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert "throughput: Lightning" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["quick"] is True
    for key in ("fit", "probe", "retained", "bad_input", "throughput"):
        assert key in result, key
    assert all(run["reload_identical"] and run["checks"] >= 1 for run in result["fit"].values())
    assert all(result["fit"][p]["grew"] >= 1 for p in ("32-true", "bf16-mixed"))  # growth forced
    assert {run["decision"] for run in result["fit"].values()} == {"rule", "stage_fork"}
    assert result["amp"]["ignored_targets_max_abs_diff"] < 1e-6
    assert all(result["amp"][p]["trials"] == 3 and not result["amp"][p]["diverged"] for p in ("32-true", "bf16-mixed"))
    assert all(run["param_devices"] == ["cpu"] for run in result["fit"].values())
    assert result["bad_input"]["host_batches_moved"] and result["bad_input"]["split_error_names_both"]
    assert result["retained"]["paper"]["leaked_tensors"] == 0
    assert result["retained"]["crossfit"]["leaked_tensors"] == 0
    for row in result["probe"]:
        assert row["time_ratio"] > 0


# -- Lightning: no per-step host synchronisation ---------------------------------------------------
_aten = torch.ops.aten
# Ops whose result depends on a device value read on the host: on a GPU each one waits for
# the device's queue to drain (item/bool/float, data-dependent shapes).
_HOST_READS = {_aten._local_scalar_dense, _aten.is_nonzero, _aten.equal, _aten.nonzero, _aten.masked_select,
               _aten._unique2, _aten.unique_dim, _aten.unique_consecutive, _aten.bincount}  # fmt: skip


class HostReads(TorchDispatchMode):
    """Records every op that reads a tensor's value on the host (boolean-mask indexing too)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        masked = func.overloadpacket is _aten.index and any(
            torch.is_tensor(i) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else [])
        )
        if func.overloadpacket in _HOST_READS or masked:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _image_module():
    from growtrain.module import ImageClassifier

    return ImageClassifier(width=2, num_classes=3, in_channels=1)


def _language_module():
    from growtrain.lm import LanguageModel

    return LanguageModel(n_layer=1, d_model=8, n_head=2, block_size=8, vocab_size=16)


@pytest.mark.parametrize("kind", ["image", "language"])
def test_a_step_reads_no_device_value_on_the_host(kind):
    """The loss, metric updates and logging calls of a training/validation step: no op that
    would synchronise with a GPU (the metrics are read once per epoch, at compute)."""
    gen = torch.Generator().manual_seed(0)
    if kind == "image":
        module = _image_module()
        batches = [(torch.randn(b, 1, 8, 8, generator=gen), torch.randint(0, 3, (b,), generator=gen)) for b in (6, 2)]
    else:
        module = _language_module()
        batches = [(t[:, :-1], t[:, 1:]) for t in (torch.randint(0, 16, (b, 9), generator=gen) for b in (4, 1))]
    module.log = lambda *args, **kwargs: None  # no Trainer here: logging is Lightning's (checked below)
    module.eval()  # BatchNorm on running statistics, so the recomputation below sees the same outputs
    for stage in ("train", "val"):
        for batch in batches:
            with HostReads() as reads:
                module._shared_step(batch, stage)
            assert reads.ops == [], (stage, reads.ops)
    # The epoch loss is still the sample- (token-) weighted mean over batches of unequal size,
    # recomputed here with plain cross-entropy sums over all samples (tokens) at once.
    with torch.no_grad():
        logits = [module(x) for x, _ in batches]
        flat = torch.cat([lg.reshape(-1, lg.shape[-1]) for lg in logits])
        target = torch.cat([y.reshape(-1) for _, y in batches])
        want = torch.nn.functional.cross_entropy(flat, target, reduction="sum") / target.numel()
    got = module.metrics["val_loss"].compute()
    assert torch.allclose(got, want, rtol=1e-5), (got, want)
    if kind == "language":  # perplexity = exp of that mean, as torchmetrics' Perplexity defines it
        assert torch.allclose(module.metrics["val_ppl"].compute(), want.exp(), rtol=1e-5)


def test_progress_bar_loss_is_a_host_copy_refreshed_every_log_every_n_steps(tmp_path):
    import lightning as L

    from growtrain.data import ImageDataModule

    seen = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append((batch_idx, float(outputs["loss"]), trainer.progress_bar_metrics["loss"]))

    dm = ImageDataModule(dataset="synthetic", image_size=8, channels=1, synthetic_size=160, synthetic_classes=3,
                         probe_size=16, val_size=16, batch_size=16, augment=False)  # fmt: skip
    trainer = L.Trainer(max_epochs=1, limit_train_batches=6, limit_val_batches=0, log_every_n_steps=3,
                        callbacks=[Record()], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path, accelerator="cpu")  # fmt: skip
    trainer.fit(_image_module(), dm)
    shown = {i: bar for i, _, bar in seen}
    losses = {i: loss for i, loss, _ in seen}
    assert len(seen) == 6
    for i in range(6):  # the bar shows the loss of the latest multiple of 3
        assert shown[i] == pytest.approx(losses[i - i % 3], rel=1e-6), (i, shown, losses)
    assert losses[1] != losses[0]  # (the steps' losses do differ)


@pytest.mark.parametrize("rule", ["paper", "crossfit"])
def test_a_fit_in_64_true_precision_grows(tmp_path, rule):
    """Probe batches go through the precision plugin, like training batches (float64 here)."""
    import lightning as L

    from growtrain import GrowUntilSaturated
    from growtrain.data import ImageDataModule

    dm = ImageDataModule(dataset="synthetic", image_size=8, synthetic_size=120, synthetic_classes=3, probe_size=16,
                         val_size=8, batch_size=16, augment=False, channels=1)  # fmt: skip
    module = _image_module()
    kw = dict(t=1e-9) if rule == "paper" else {}
    grow = GrowUntilSaturated(rule=rule, schedule="periodic", decision="trial", max_growths=1, verbose=False, **kw)
    trainer = L.Trainer(max_epochs=1, precision="64-true", callbacks=[grow], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        default_root_dir=tmp_path, accelerator="cpu")  # fmt: skip
    trainer.fit(module, dm)
    assert len(grow.history) == 1 and grow.history[0]["rule"] == rule  # the check ran in float64
    assert len(module.network.growth_log) == (1 if rule == "paper" else int(grow.history[0]["action"] == "grow"))
    assert all(p.dtype == torch.float64 for p in module.parameters())
