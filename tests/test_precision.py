"""Mixed precision on the CPU: the checks' numbers under ``precision="bf16-mixed"``.

* The probe's scores under bf16 autocast agree with float32 to a stated tolerance (the GPU
  figures are bench/gpu.py's ``precision`` section).
"""

from __future__ import annotations

import lightning as L
import torch
from torch.nn import functional as F

from growtrain import GrowUntilSaturated, ImageClassifier, measure_saturation
from tests.test_periodic import tiny_dm

# bf16 keeps 8 bits of mantissa (a relative rounding of 2^-8 ≈ 0.4 % per operation): over a few
# layers the probe's gradient norms move by up to a few percent, the mean loss by far less.
GAMMA_REL_TOL = 0.05
LOSS_MEAN_REL_TOL = 0.01


def _trained(tmp_path, precision: str, **grow):
    L.seed_everything(0)
    callbacks = [GrowUntilSaturated(verbose=False, **grow)] if grow else []
    trainer = L.Trainer(max_epochs=1, precision=precision, callbacks=callbacks, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
                        default_root_dir=tmp_path)  # fmt: skip
    model = ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], family="basic", in_channels=3,
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))  # fmt: skip
    dm = tiny_dm()
    trainer.fit(model, dm)
    return trainer, model, dm


def test_the_probes_scores_under_bf16_autocast_agree_with_float32(tmp_path):
    _, model, dm = _trained(tmp_path, "32-true")
    net, probe = model.network, list(dm.probe_dataloader())
    fp32 = measure_saturation(net, probe, F.cross_entropy, rule="paper", projected=False)
    bf16 = measure_saturation(net, probe, F.cross_entropy, rule="paper", projected=False, autocast_dtype=torch.bfloat16)
    for site in net.sites():
        a, b = fp32.record(site).grad_norm, bf16.record(site).grad_norm
        assert abs(b - a) <= GAMMA_REL_TOL * a, (site, a, b)
        assert a != b  # it did run in bf16 (else this test compares float32 with itself)
    assert bf16.gamma == max(bf16.record(s).grad_norm for s in net.sites())
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = torch.cat([F.cross_entropy(net(x), y, reduction="none").float() for x, y in probe])
    with torch.no_grad():
        full = torch.cat([F.cross_entropy(net(x), y, reduction="none") for x, y in probe])
    assert abs(float(mixed.mean() - full.mean())) <= LOSS_MEAN_REL_TOL * float(full.mean())


def test_the_probes_backward_is_loss_scaled_under_float16():
    """float16 autocast (what 16-mixed probes under): a loss of small scale (here the cross-entropy
    × 1e-3) has activation gradients below float16's range; the probe's backward is scaled, as a
    16-mixed training step's is, and every site's gradient norm matches float32's (unscaled, they
    came out 5–22 % off on this network, and 0 at × 1e-5)."""
    from growtrain.models import cifar_resnet

    torch.manual_seed(0)
    net = cifar_resnet((1, 1, 1), 8, "preact", 3, 10).eval()
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(64, 3, 16, 16, generator=g), torch.randint(0, 10, (64,), generator=g)) for _ in range(4)]

    def small(out, y):
        return 1e-3 * F.cross_entropy(out, y)

    for rule in ("paper", "crossfit"):
        fp32 = measure_saturation(net, batches, small, rule=rule, projected=False)
        fp16 = measure_saturation(net, batches, small, rule=rule, projected=False, autocast_dtype=torch.float16)
        for site in net.sites():
            a, b = fp32.record(site).grad_norm, fp16.record(site).grad_norm
            assert abs(b - a) <= 0.02 * a, (rule, site, a, b)
