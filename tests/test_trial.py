"""The block-only trial decision (``decision="trial"``, growtrain/trial.py and the callback's
``BlockTrials``): a trial trains the inserted block alone, leaves the network bit for bit as it
was, certifies what it says, fails softly when it diverges, and is scale-free."""

from __future__ import annotations

import copy
import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from growtrain.callbacks import GrowUntilSaturated, Periodic, Rule, Trial
from growtrain.callbacks.trial_check import trial_candidates
from growtrain.data import ImageDataModule
from growtrain.module import ImageClassifier
from growtrain.models import cifar_resnet
from growtrain.trial import CHECK_EVERY, train_block, trial_test, trial_verdict


def tiny_dm(**kw) -> ImageDataModule:
    kw = dict(dataset="synthetic", image_size=8, synthetic_size=400, synthetic_classes=4, probe_size=120,
              val_size=40, batch_size=32, augment=False) | kw  # fmt: skip
    return ImageDataModule(**kw)


def batches(n=12, seed=0, batch=16):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 3, 8, 8, generator=g), torch.randint(0, 4, (batch,), generator=g)) for _ in range(n)]


def test_train_block_moves_only_the_block_and_restores_flags_and_modes():
    torch.manual_seed(0)
    net = cifar_resnet((1, 1, 1), 4, "basic", 3, 4)
    net.train()
    net.layer1[0].bn1.eval()  # a user's frozen BatchNorm stays in eval afterwards
    net.stem.weight.requires_grad_(False)  # ... and a user's frozen parameter stays frozen
    before = copy.deepcopy(net.state_dict())
    modes = {name: m.training for name, m in net.named_modules()}
    block = net.grow("layer2.1", net.new_block("layer2.1", seed=1))
    block_before = copy.deepcopy(block.state_dict())
    fit = train_block(net, net, block, iter(batches()), F.cross_entropy, steps=10, lr=1e-2)
    assert fit["steps"] == 10 and not fit["diverged"]
    # frozen means no gradient formed at all for the rest (no wasted work, nothing left behind)
    assert all(p.grad is None for p in net.parameters() if not any(p is q for q in block.parameters()))
    assert any(not torch.equal(v, block_before[k]) for k, v in block.state_dict().items() if torch.is_tensor(v))
    net.undo_growth([block], 0)
    after = net.state_dict()
    assert list(after) == list(before)
    for key in before:  # every other parameter and BatchNorm statistic, bit for bit
        assert torch.equal(after[key], before[key]) if torch.is_tensor(before[key]) else after[key] == before[key], key
    assert {name: m.training for name, m in net.named_modules()} == modes
    assert not net.stem.weight.requires_grad and net.layer1[0].conv1.weight.requires_grad


def test_train_block_trains_in_eval_mode_around_the_block():
    """Other BatchNorms use their running statistics during the trial (their buffers do not
    move); the block's own BatchNorms train."""
    torch.manual_seed(0)
    net = cifar_resnet((1, 1, 1), 4, "basic", 3, 4).train()
    block = net.grow("layer1.1", net.new_block("layer1.1", seed=1))
    seen = []
    hook = net.layer2[0].bn1.register_forward_pre_hook(lambda m, a: seen.append(m.training))
    inner = []
    hook2 = block.bn1.register_forward_pre_hook(lambda m, a: inner.append(m.training))
    train_block(net, net, block, iter(batches(3)), F.cross_entropy, steps=3)
    hook.remove(), hook2.remove()
    assert seen == [False] * 3 and inner == [True] * 3


def test_a_diverging_trial_is_a_failed_trial_not_a_crash():
    torch.manual_seed(0)
    net = cifar_resnet((1, 1, 1), 4, "basic", 3, 4)

    def bad_loss(out, y):  # a loss that blows up once the block moves
        return F.cross_entropy(out, y) * (math.inf if calls.append(1) or len(calls) > 2 else 1.0)

    calls: list = []
    block = net.grow("layer2.1", net.new_block("layer2.1", seed=1))
    fit = train_block(net, net, block, iter(batches(40)), bad_loss, steps=40)
    assert fit["diverged"] and fit["steps"] == CHECK_EVERY  # found at the first read of the losses, not at the end
    assert all(p.requires_grad for p in net.parameters())


def test_a_trial_reads_its_losses_on_the_host_once_per_check_every_steps_not_per_step(monkeypatch):
    """No host sync per step: the losses are copied to the host in one piece every CHECK_EVERY
    steps (and once at the end), and the first and last batch losses are still the right ones."""
    torch.manual_seed(0)
    net = cifar_resnet((1, 1, 1), 4, "basic", 3, 4)
    block = net.grow("layer2.1", net.new_block("layer2.1", seed=1))
    seen: list[float] = []

    def loss(out, y):
        value = F.cross_entropy(out, y)
        with torch.no_grad():
            seen.append(float(value))  # the test's own read, before the counter is on
        return value

    copies = []
    real_cpu = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda t, *a, **k: copies.append(t.shape) or real_cpu(t, *a, **k))
    fit = train_block(net, net, block, iter(batches(40)), loss, steps=40)
    monkeypatch.undo()
    assert fit["steps"] == 40 and not fit["diverged"]
    assert len(copies) == math.ceil(40 / CHECK_EVERY) <= 40 // 8  # 16 + 16 + 8: three reads for 40 steps, not 40
    assert fit["loss_first"] == pytest.approx(seen[0]) and fit["loss_last"] == pytest.approx(seen[-1])


def test_a_trial_trains_and_scores_under_the_trainers_precision(tmp_path):
    """precision="bf16-mixed": the trial block's forward runs under autocast while it trains and
    while the probe is scored, as a training step's does (a block trained in float32 and scored
    in float32 would be measured in another precision than the run)."""
    from growtrain.callbacks import trial_check

    states = []
    real = trial_check.BlockTrials._one

    def one(self, trainer, pl_module, network, view, site, *a, **k):
        original = network.grow

        def grow(site_, block):
            block.register_forward_pre_hook(lambda m, args: states.append(torch.is_autocast_enabled("cpu")))
            return original(site_, block)

        network.grow = grow
        try:
            return real(self, trainer, pl_module, network, view, site, *a, **k)
        finally:
            del network.grow

    trial_check.BlockTrials._one = one
    try:
        L.seed_everything(0)
        grow = GrowUntilSaturated(schedule="periodic", decision=Trial(min_gain=0.01, epochs=0.5), max_growths=1,
                                  verbose=False)  # fmt: skip
        trainer = L.Trainer(max_epochs=1, precision="bf16-mixed", callbacks=[grow], logger=False,
                            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                            limit_val_batches=0, default_root_dir=tmp_path)  # fmt: skip
        trainer.fit(ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], family="basic", in_channels=3), tiny_dm())
    finally:
        trial_check.BlockTrials._one = real
    assert grow.history and grow.history[0]["trial"]["trials"]
    assert len(states) > 100 and all(states)  # every forward of every trial block: training and scoring


def test_a_trial_under_16_true_does_not_scale_the_loss(tmp_path):
    """precision="16-true" (half-precision weights, no loss scaling in Lightning): the trial does
    not scale its loss either — unscaling half-precision gradients is an error in torch — and its
    Adam takes an eps float16 can hold (the default 1e-8 is 0 there: every trial diverged), so the
    trials train and the check decides as under 32-true (here: 7.4 / 3.1 / 4.4 % against 7.0 / 3.9 /
    6.1 %, both grow)."""
    L.seed_everything(0)
    grow = GrowUntilSaturated(schedule="periodic", decision=Trial(min_gain=0.01), max_growths=1, verbose=False)
    trainer = L.Trainer(max_epochs=1, precision="16-true", callbacks=[grow], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
                        default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], family="basic", in_channels=3), tiny_dm())
    check = grow.history[0]
    trials = check["trial"]["trials"]
    assert len(trials) == 3 and not any(t["diverged"] for t in trials) and check["action"] == "grow"


def test_trial_test_matches_an_independent_computation():
    g = torch.Generator().manual_seed(0)
    before = 0.5 + torch.rand(4000, generator=g, dtype=torch.float64)
    after = before * 0.95 + 0.01 * torch.randn(4000, generator=g, dtype=torch.float64)
    out = trial_test(before, after, min_gain=0.01, level=0.05, seed=0)
    d = before - after
    assert out["mean"] == pytest.approx(float(d.mean()), rel=1e-12)
    assert out["gain_frac"] == pytest.approx(float(d.mean() / before.mean()), rel=1e-12)
    se = float(d.std()) / math.sqrt(d.numel())
    # bootstrap-t bounds sit within a few % of the normal ones on a near-symmetric difference
    assert out["lower"] == pytest.approx(float(d.mean()) - 1.645 * se, abs=0.3 * se)
    assert out["upper"] == pytest.approx(float(d.mean()) + 1.645 * se, abs=0.3 * se)
    assert out["paid"] and out["lower_frac"] > 0.01


def test_the_verdict_says_what_it_certified():
    grow = {"site": "layer2.1", "paid": True, "lower_frac": 0.02, "gain_frac": 0.03, "upper_frac": 0.04, "level": 0.0167, "n": 12000}
    small = {"site": "layer3.1", "paid": False, "lower_frac": 0.001, "gain_frac": 0.003, "upper_frac": 0.005, "level": 0.0167, "n": 12000}
    wide = {"site": "layer1.1", "paid": False, "lower_frac": -0.01, "gain_frac": 0.005, "upper_frac": 0.02, "level": 0.0167, "n": 500}
    v = trial_verdict([small, grow], 0.01)
    assert not v.saturated and v.site == "layer2.1"
    assert "lowers the loss on the probe (12000 samples held out from training by index) by at least 2.00 %" in v.reason
    assert not v.certified
    v = trial_verdict([small], 0.01)
    assert v.saturated and v.certified and v.reason.startswith("certified saturation") and "at most 0.50 %" in v.reason
    assert "the probe (12000 samples held out from training by index)" in v.reason
    v = trial_verdict([small, wide], 0.01)  # wide's upper bound 2 % > min_gain: a gain above 1 % is not ruled out
    assert v.saturated and not v.certified and v.reason.startswith("no certified gain") and "not resolved" in v.reason
    assert "this probe resolves gains to about ±1.50 %" in v.reason and "larger probe" in v.reason
    assert "saturat" not in v.reason
    # a diverged trial says nothing about its block: every scored block below min_gain is not enough
    v = trial_verdict([{"site": "layer1.1", "diverged": True}, small], 0.01)
    assert v.saturated and not v.certified and "diverged" in v.reason and v.reason.startswith("no certified gain")
    assert "saturat" not in v.reason
    v = trial_verdict([{"site": "layer1.1", "diverged": True}], 0.01)
    assert v.saturated and not v.certified and "saturat" not in v.reason


def test_candidates_are_the_best_site_of_each_stage_best_first():
    class R:
        def __init__(self, name, lower):
            self.name, self.lower, self.grad_norm = name, lower, 0.0

    class Rep:
        sites = [R("layer1.0", 0.1), R("layer1.1", 0.3), R("layer2.1", 0.5), R("layer3.1", -0.2), R("layer3.2", 0.0)]

    assert trial_candidates(Rep(), 3) == ["layer2.1", "layer1.1", "layer3.2"]
    assert trial_candidates(Rep(), 1) == ["layer2.1"]


def test_adam_trials_are_scale_free_and_sgd_ones_are_not():
    """loss × 10: Adam's steps do not change (up to its eps), so the trained block and every gain
    fraction match; SGD's steps grow tenfold (the broken variant) and the block differs."""

    def trained(scale, optimizer):
        torch.manual_seed(0)
        net = cifar_resnet((1, 1, 1), 4, "basic", 3, 4)
        block = net.grow("layer2.1", net.new_block("layer2.1", seed=3))
        start = torch.cat([p.detach().flatten() for p in block.parameters()])
        loss = lambda o, y: scale * F.cross_entropy(o, y)  # noqa: E731
        if optimizer == "adam":
            train_block(net, net, block, iter(batches()), loss, steps=10, lr=1e-2)
        else:  # the broken variant: the same loop with SGD's step
            for p in net.parameters():
                p.requires_grad_(False)
            for p in block.parameters():
                p.requires_grad_(True)
            opt = torch.optim.SGD(block.parameters(), lr=1e-2)
            for x, y in batches():
                opt.zero_grad()
                loss(net(x), y).backward()
                opt.step()
        return torch.cat([p.detach().flatten() for p in block.parameters()]) - start

    def relative_change(optimizer):  # how much the block's update moves when the loss is ×10
        one, ten = trained(1.0, optimizer), trained(10.0, optimizer)
        return float((one - ten).norm() / one.norm())

    assert relative_change("adam") < 0.05  # Adam's eps is the only scale it sees
    assert relative_change("sgd") > 1.0  # the broken variant: a tenfold step


class Guard(L.Callback):
    pass


def fit_trial(tmp_path, trainer_kw=None, min_gain=0.01, **kw):
    L.seed_everything(0)
    kw = {"max_growths": 2} | kw
    grow = GrowUntilSaturated(schedule=Periodic(every_n_epochs=2, anneal_epochs=1),
                              decision=Trial(min_gain=min_gain, epochs=0.5), lr_schedule="anneal",
                              on_saturated="anneal", verbose=False, **kw)  # fmt: skip
    trainer = L.Trainer(max_epochs=8, callbacks=[grow], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
                        default_root_dir=tmp_path, **(trainer_kw or {}))  # fmt: skip
    model = ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], family="basic", in_channels=3,
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))  # fmt: skip
    return grow, model, trainer


def test_the_callbacks_trials_leave_the_network_bit_for_bit(tmp_path, monkeypatch):
    """Through the product's own path: the state (weights and BatchNorm statistics), the growth
    record and the optimizer are what they were before the trials of every check."""
    grow, model, trainer = fit_trial(tmp_path, min_gain=5.0)  # 500 %: no trial can pay
    seen = []
    original = type(grow._trials).run

    def run(self, trainer, pl_module, network, *args):
        state = copy.deepcopy(pl_module.state_dict())
        log = list(network.growth_log)
        opt = copy.deepcopy(trainer.optimizers[0].state_dict())
        out = original(self, trainer, pl_module, network, *args)
        after = pl_module.state_dict()
        seen.append(list(after) == list(state) and all(torch.equal(after[k], state[k]) if torch.is_tensor(state[k]) else after[k] == state[k] for k in state)
                    and network.growth_log == log and str(trainer.optimizers[0].state_dict()) == str(opt))
        return out

    monkeypatch.setattr(type(grow._trials), "run", run)
    trainer.fit(model, tiny_dm())
    assert seen == [True] and grow.history[0]["action"] == "saturated"
    trials = grow.history[0]["trial"]["trials"]
    assert len(trials) == 3  # one site per stage ...
    assert all(t["level"] == pytest.approx(grow.history[0]["level"] / 3) for t in trials)  # ... α split over them
    assert model.network.depth() == 3


def test_the_trial_decision_grows_and_reports_every_verdict(tmp_path):
    grow, model, trainer = fit_trial(tmp_path, min_gain=0.0, max_growths=1)
    trainer.fit(model, tiny_dm())
    first = grow.history[0]
    assert first["action"] == "grow" and first["site"] == first["trial"]["site"]
    assert model.network.depth() == 4
    verdicts = first["verdicts"]
    assert {"paper", "crossfit", "trial"} <= set(verdicts)
    assert first["gamma"] is not None and first["threshold"] is not None  # Γ̂ against δ+t at every check


@pytest.mark.parametrize("make, arg", [
    (lambda: GrowUntilSaturated(schedule="converged", decision="guess"), "decision"),
    (lambda: Trial(min_gain=None), r"Trial\.min_gain"),
    (lambda: Trial(epochs=0), r"Trial\.epochs"),
    (lambda: Trial(epochs=math.inf), r"Trial\.epochs"),
])  # fmt: skip
def test_bad_trial_options_are_refused_naming_the_argument(make, arg):
    with pytest.raises(ValueError, match=rf"^{arg}: expected .*Fix: "):
        make()


def test_the_trials_run_with_the_constants_that_replaced_their_options():
    from growtrain.trial import DEFAULT_TRIAL_EPOCHS, DEFAULT_TRIAL_LR, TRIAL_SITES

    assert (DEFAULT_TRIAL_LR, TRIAL_SITES) == (1e-3, 3)
    trials = GrowUntilSaturated(schedule="converged", decision=Trial(epochs=0.25))._trials
    assert (trials.lr, trials.sites, trials.epochs) == (DEFAULT_TRIAL_LR, 3, 0.25)
    assert GrowUntilSaturated(schedule="converged").decision.epochs == DEFAULT_TRIAL_EPOCHS
    assert GrowUntilSaturated(schedule="converged", decision="rule")._trials is None  # no trial without one to decide


def test_the_default_decision_is_the_trial_and_the_rule_is_asked_for_by_name():
    assert GrowUntilSaturated(schedule="converged").decision == Trial()
    assert GrowUntilSaturated(schedule="converged", decision="rule").decision == Rule()


def _chance_inputs(y: torch.Tensor):
    """What BlockTrials._chance reads: a trainer (only its precision plugin's input conversion)
    and a probe loader of two batches carrying the targets ``y``."""
    from types import SimpleNamespace

    trainer = SimpleNamespace(precision_plugin=SimpleNamespace(convert_input=lambda batch: batch))
    half = len(y) // 2
    return trainer, [(torch.zeros(half, 1), y[:half]), (torch.zeros(len(y) - half, 1), y[half:])]


def test_a_network_at_chance_level_is_never_called_saturated():
    from growtrain.trial import at_chance, label_entropy

    y = torch.tensor([0, 1, 2, 3] * 25)
    assert label_entropy(y) == pytest.approx(math.log(4))
    assert label_entropy(torch.randn(10)) is None  # not class targets: no claim either way
    assert at_chance(1.30, label_entropy(y)) and not at_chance(0.9, label_entropy(y))
    # the reference is the constant prediction's loss under the module's own loss: for cross-entropy
    # the label entropy (independent: −Σ p log p), for a loss × 10 ten times it — so a trained network
    # on the loss × 10 (0.2 nats → 2.0) is not "at chance" just because 2.0 ≥ 0.9·log 4
    from growtrain.module import ScaledLossClassifier
    from growtrain.trial import constant_prediction_loss

    skewed = torch.tensor([0] * 70 + [1] * 20 + [2] * 10)
    p = torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64)
    assert constant_prediction_loss(skewed, F.cross_entropy) == pytest.approx(float(-(p * p.log()).sum()), rel=1e-6)
    scaled = ScaledLossClassifier(loss_scale=10.0).probe_loss
    assert constant_prediction_loss(skewed, scaled) == pytest.approx(10 * float(-(p * p.log()).sum()), rel=1e-6)
    assert not at_chance(2.0, constant_prediction_loss(y, scaled)) and at_chance(13.0, constant_prediction_loss(y, scaled))
    assert constant_prediction_loss(torch.randn(10), F.cross_entropy) is None
    # the callback's collaborator asks with the module's own loss: a trained network on the loss × 10
    # is not at chance, an untrained one is, and the reason names the reference it used
    from growtrain.callbacks.trial_check import BlockTrials

    trainer, probe = _chance_inputs(y)
    trained, untrained = torch.full((100,), 2.0), torch.full((100,), 13.5)  # 10 × 0.2 nats, 10 × 1.35 nats
    assert BlockTrials._chance(trainer, probe, trained, scaled) is None
    reason = BlockTrials._chance(trainer, probe, untrained, scaled)
    assert reason is not None and f"{10 * math.log(4):.4g}" in reason
    assert BlockTrials._chance(trainer, probe, trained / 10, F.cross_entropy) is None
    assert constant_prediction_loss(y, F.binary_cross_entropy_with_logits) is None  # a loss of another prediction shape
    small = {"site": "layer3.1", "paid": False, "lower_frac": 0.001, "gain_frac": 0.003, "upper_frac": 0.005,
             "level": 0.0167, "n": 12000}
    v = trial_verdict([small], 0.01, chance="the network is at chance level (probe loss 1.38)")
    # small's bounds alone would certify saturation (test_the_verdict_says_what_it_certified): at chance, not
    assert v.saturated and not v.certified and v.reason.startswith("stopped at chance level")
    assert "saturat" not in v.reason
    from growtrain.callbacks.telemetry import fit_summary  # the summary's headline follows the record's certified

    history = [{"check": 0, "epoch": 1, "depth_before": 3, "depth": 3, "action": "saturated", "site": None,
                "certified": v.certified}]  # fmt: skip
    text = str(fit_summary(history, start_depth=3, final_depth=3, finished="saturated", stop_reason=v.reason,
                           metrics={}, probe_seconds=0.0, fit_seconds=1.0, no_check=None, outputs=[]).caption)
    assert "stopped at chance level" in text and "no certified gain" in text and "saturat" not in text


def test_the_chance_guard_reads_the_probes_mean_loss():
    """Per-sample probe losses that spread: the guard compares their mean (not the smallest or
    largest sample) with 90 % of the constant prediction's loss, here log 4 (balanced 4 classes,
    cross-entropy): 0.9 · log 4 = 1.2477."""
    from growtrain.callbacks.trial_check import BlockTrials

    trainer, probe = _chance_inputs(torch.tensor([0, 1, 2, 3] * 25))
    assert 0.9 * math.log(4) == pytest.approx(1.2477, abs=1e-4)
    at = torch.tensor([0.1, 2.5] * 50)  # mean 1.30 ≥ 1.2477 (smallest sample 0.1 is far below)
    below = torch.tensor([0.0, 2.4] * 50)  # mean 1.20 < 1.2477 (largest sample 2.4 is far above)
    reason = BlockTrials._chance(trainer, probe, at, F.cross_entropy)
    assert reason is not None and "probe loss 1.3 " in reason and f"{math.log(4):.4g}" in reason
    assert BlockTrials._chance(trainer, probe, below, F.cross_entropy) is None


def test_the_summary_table_shows_what_the_trial_certified():
    """decision="trial": the summary's row shows the number that decided (the best trial's
    certified gain, % of the probe loss), beside the first-order lower bound that only chose
    the sites; a run without trials shows no such column."""
    import io

    from rich.console import Console

    from growtrain.callbacks.telemetry import fit_summary

    def render(history):
        console = Console(width=200, record=True, file=io.StringIO())
        console.print(fit_summary(history, start_depth=3, final_depth=4, finished="saturated", stop_reason="x",
                                  metrics={}, probe_seconds=0.0, fit_seconds=1.0, no_check=None, outputs=[]))  # fmt: skip
        return console.export_text()

    history = [{"check": 0, "epoch": 5, "depth_before": 3, "action": "grow", "site": "layer2.1", "lower": 0.147,
                "trial": {"lower_frac": 0.0206, "site": "layer2.1"}},
               {"check": 1, "epoch": 9, "depth_before": 4, "action": "saturated", "site": None, "lower": -0.017,
                "trial": {"lower_frac": -0.0075, "site": "layer1.0"}}]  # fmt: skip
    text = render(history)
    assert "block gain ≥ %" in text and "first-order ≥" in text
    rows = [line for line in text.splitlines() if line.startswith("│")]
    assert "2.06" in rows[0] and "0.147" in rows[0] and "-0.75" in rows[1]
    assert "block gain" not in render([{k: v for k, v in h.items() if k != "trial"} for h in history])


def test_an_untrained_fit_is_stopped_as_not_saturated(tmp_path):
    """Through the callback: a learning rate of 0 leaves the network at chance; the stop says so."""
    L.seed_everything(0)
    grow = GrowUntilSaturated(schedule="periodic", decision="trial", max_growths=1, verbose=False)
    trainer = L.Trainer(max_epochs=2, callbacks=[grow], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
                        default_root_dir=tmp_path)  # fmt: skip
    model = ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], family="basic", in_channels=3,
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.0))  # fmt: skip
    model.network.fc.weight.data.zero_(), model.network.fc.bias.data.zero_()  # uniform predictions
    trainer.fit(model, tiny_dm(synthetic_size=200))
    assert grow.finished == "saturated" and grow.stop_reason.startswith("stopped at chance level")


def test_the_trials_training_batches_are_the_train_loaders_pass_after_pass():
    """What a trial block trains on: the training loader's batches, every sample of every pass
    (none is set aside: nothing of the training data is scored), for as many passes as it takes."""
    from types import SimpleNamespace

    from torch.utils.data import DataLoader, TensorDataset

    from growtrain.callbacks.trial_check import BlockTrials

    x = torch.arange(64, dtype=torch.float32).view(64, 1).repeat(1, 3)
    y = torch.arange(64) % 4
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
    trainer = SimpleNamespace(train_dataloader=loader, precision_plugin=SimpleNamespace(convert_input=lambda b: b))
    batches = BlockTrials._train_batches(trainer)
    passes = [sorted(int(v) for _ in range(8) for v in next(batches)[0][:, 0]) for _ in range(3)]
    assert passes == [list(range(64))] * 3
    batches.close()
    empty = SimpleNamespace(train_dataloader=[], precision_plugin=trainer.precision_plugin)
    assert list(BlockTrials._train_batches(empty)) == []  # an empty loader ends the trial's batches, no endless loop


def test_a_fit_without_a_root_dir_writes_into_the_tests_own_directory(tmp_path):
    """The suite leaves no file in the checkout: the working directory of every test is its own
    temporary directory (tests/conftest.py), where a Trainer's default outputs land."""
    from pathlib import Path

    assert Path.cwd() == tmp_path and Path.cwd() != Path(__file__).resolve().parents[1]
    L.seed_everything(0)
    grow = GrowUntilSaturated(schedule="periodic", decision="rule", max_growths=0, verbose=False)  # fmt: skip
    trainer = L.Trainer(max_epochs=1, callbacks=[grow], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0)  # no root dir
    trainer.fit(ImageClassifier(width=4, num_classes=4, in_channels=3), tiny_dm())
    assert (tmp_path / "growth_history.json").exists()  # the default outputs landed here


# -- what a trial trains on and what it scores, by dataset index -------------------------------------
class _Ledger:
    """Which dataset indices every forward of the trials ran on, by identity, not by value.

    ``TensorImages`` (the datamodule's in-memory train and probe sets, rows of one storage) records
    each fetch's storage indices; a forward pre-hook on the module takes the fetch made since the
    previous forward, so a forward on anything but the samples just fetched (a batch set aside
    earlier, a re-used tensor) is an anomaly. Loaders have no workers: a fetch is the ``next()``
    that hands the batch on. A forward with gradients is the trial's training, one without is
    scoring. Only calls inside ``BlockTrials.run`` count."""

    def __init__(self):
        self.active, self.pending = False, None
        self.trained: list[int] = []
        self.scored: list[int] = []
        self.anomalies: list[str] = []
        self.train_dtypes: set = set()
        self.by_hand: list[float] = []  # the probe's mean cross-entropy before each check, computed here

    def fetched(self, dataset, indices: torch.Tensor) -> None:
        if self.active:  # a fetch nobody forwards (the chance guard's targets, train_block's last) is dropped
            self.pending = indices.tolist()

    def forward(self, module, args) -> None:
        if not self.active:
            return
        x = args[0]
        if self.pending is None or len(self.pending) != x.shape[0]:
            self.anomalies.append(f"a forward of {x.shape[0]} samples, {self.pending and len(self.pending)} fetched")
        elif torch.is_grad_enabled():
            self.trained += self.pending
            self.train_dtypes.add(x.dtype)
        else:
            self.scored += self.pending
        self.pending = None


def _instrumented_trial_fit(tmp_path, monkeypatch, dm):
    """One check of ``decision="trial"`` (no block can pay min_gain=500 %) with every dataset
    fetch and forward inside the trials on the ledger; returns the callback and the ledger."""
    from growtrain.callbacks.trial_check import BlockTrials
    from growtrain.data.datamodule import TensorImages

    ledger = _Ledger()
    getitems, getitem = TensorImages.__getitems__, TensorImages.__getitem__

    def fetch_many(self, idx):
        ledger.fetched(self, self.indices[torch.as_tensor(idx, dtype=torch.long)])
        return getitems(self, idx)

    def fetch_one(self, i):
        ledger.fetched(self, self.indices[torch.as_tensor([i], dtype=torch.long)])
        return getitem(self, i)

    run = BlockTrials.run

    def recorded_run(self, trainer, pl_module, network, report, probe, loss_fn, level):
        modes = [(m, m.training) for m in pl_module.modules()]
        pl_module.eval()
        with torch.no_grad():  # the probe's per-sample cross-entropy, by hand: the loader's own batches
            losses = [F.cross_entropy(pl_module(x), y, reduction="none") for x, y in dm.probe_dataloader()]
        for m, was in modes:
            m.training = was
        ledger.by_hand.append(float(torch.cat(losses).double().mean()))
        hook = pl_module.register_forward_pre_hook(ledger.forward)
        ledger.active = True
        try:
            return run(self, trainer, pl_module, network, report, probe, loss_fn, level)
        finally:
            ledger.active = False
            hook.remove()

    monkeypatch.setattr(TensorImages, "__getitems__", fetch_many)
    monkeypatch.setattr(TensorImages, "__getitem__", fetch_one)
    monkeypatch.setattr(BlockTrials, "run", recorded_run)
    grow, model, trainer = fit_trial(tmp_path, min_gain=5.0)
    trainer.fit(model, dm)
    return grow, ledger


@pytest.fixture
def augmented_dm():
    # augmented (a new crop and flip each time a sample is drawn, so no fingerprint recognises it);
    # 240 training images in batches of 32: 7 batches an epoch, so a trial's 100 steps make 14 passes
    return tiny_dm(augment=True, synthetic_size=400, probe_size=120, val_size=40, batch_size=32)


def test_the_trial_scores_the_probe_alone_and_never_trains_on_it(tmp_path, monkeypatch, augmented_dm):
    grow, ledger = _instrumented_trial_fit(tmp_path, monkeypatch, augmented_dm)
    trials = grow.history[0]["trial"]["trials"]
    assert len(trials) == 3 and not any(t["diverged"] for t in trials)
    assert ledger.anomalies == []  # every forward ran on the samples fetched for it: nothing set aside earlier
    probe, train = augmented_dm.probe_indices.tolist(), set(augmented_dm.train_indices.tolist())
    # scored: the probe, whole, in its order, once before the trials and once after each; nothing else
    assert ledger.scored == probe * (1 + len(trials))
    # trained: training samples only (every one of them, over 14 passes), never a scored one
    assert set(ledger.trained) == train and not set(ledger.trained) & set(ledger.scored)
    assert len(ledger.trained) == sum(t["steps"] for t in trials) * augmented_dm.batch_size
    assert ledger.train_dtypes == {torch.float32}  # as a training step sees them: normalised (and augmented)


def test_the_trials_n_is_the_probes_size_and_its_loss_before_is_the_probes_cross_entropy(
        tmp_path, monkeypatch, augmented_dm):  # fmt: skip
    grow, ledger = _instrumented_trial_fit(tmp_path, monkeypatch, augmented_dm)
    check = grow.history[0]["trial"]
    assert [t["n"] for t in check["trials"]] == [augmented_dm.probe_size] * 3
    assert [t["n_probe"] for t in check["trials"]] == [augmented_dm.probe_size] * 3
    assert not {"n_holdout", "probe_gain_frac"} & set().union(*check["trials"])  # nothing else was scored
    assert len(ledger.by_hand) == 1
    assert [t["loss_before"] for t in check["trials"]] == pytest.approx([ledger.by_hand[0]] * 3, rel=1e-6)
    for t in check["trials"]:  # the gain is the loss before less the loss after, as fractions of the former
        assert t["gain_frac"] == pytest.approx(t["mean"] / t["loss_before"], rel=1e-9)
    assert f"the probe ({augmented_dm.probe_size} samples held out from training by index)" in check["reason"]


def _leaky_probe(dm):
    """The datamodule's probe loader with one training sample's dataset index added."""
    from growtrain.data.datamodule import TensorImages

    dm.setup("fit")
    indices = torch.cat([dm.probe_indices, dm.train_indices[:1]])
    return dm._loader(TensorImages(*dm._loaded()["train"], indices), train=False)


@pytest.mark.parametrize("leak", ["probe loader", "datamodule split"])
def test_a_probe_sharing_one_index_with_the_training_data_is_refused_before_any_trial(tmp_path, monkeypatch, leak):
    from growtrain.callbacks.trial_check import BlockTrials

    dm = tiny_dm()
    kw = {}
    if leak == "probe loader":
        kw["probe"], match = _leaky_probe(dm), r"1 sample index\(es\) are in both the probe and the train set"
    else:
        dm.setup("fit")
        dm._split = (dm._split[0], torch.cat([dm._split[1], dm._split[0][:1]]), dm._split[2])
        match = r"share 1 sample\(s\)"
    runs = []
    monkeypatch.setattr(BlockTrials, "run", lambda *a: runs.append(1))
    grow, model, trainer = fit_trial(tmp_path, **kw)
    with pytest.raises(ValueError, match=rf"^probe: .*{match}.*Fix: "):
        trainer.fit(model, dm)
    assert runs == [] and trainer.global_step == 0


class _ReloadedWithALeak(ImageDataModule):
    """A datamodule whose train loader, reloaded after the first epoch, also holds one probe sample."""

    def train_dataloader(self):
        from growtrain.data.datamodule import TensorImages

        self.calls = getattr(self, "calls", 0) + 1
        indices = self.train_indices if self.calls == 1 else torch.cat([self.train_indices, self.probe_indices[:1]])
        return self._loader(TensorImages(*self._loaded()["train"], indices), train=True)


def test_a_train_loader_reloaded_onto_a_probe_sample_is_refused_at_the_trial(tmp_path):
    """Refused at the start of training is not enough: the trial trains on the loader of its own
    epoch, and one reloaded since (reload_dataloaders_every_n_epochs) must not hold a probe sample."""
    dm = _ReloadedWithALeak(dataset="synthetic", image_size=8, synthetic_size=400, synthetic_classes=4,
                            probe_size=120, val_size=40, batch_size=32, augment=False)  # fmt: skip
    grow, model, trainer = fit_trial(tmp_path, {"reload_dataloaders_every_n_epochs": 1})
    match = r"^probe: .*1 sample index\(es\) are in both the probe and the train set"
    with pytest.raises(ValueError, match=match) as info:
        trainer.fit(model, dm)
    assert any(entry.path.name == "trial_check.py" for entry in info.traceback)  # raised by the trial itself
    assert dm.calls >= 2 and trainer.current_epoch >= 1 and grow.history == []  # trained, then refused at the trial
