"""Progress during a growth check (growtrain/callbacks/progress.py): the probe pass and the
block-only trials show their batches and steps in Lightning's own progress bar (a rich task or a
nested tqdm bar under the training bar), and nothing is shown when progress bars are off or on a
rank other than 0."""

from __future__ import annotations

import io
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import CustomProgress
from rich.console import Console

from growtrain.callbacks import GrowUntilSaturated, Trial, trial_check
from growtrain.callbacks.progress import NO_PROGRESS, Steps, counted, progress_for
from growtrain.data import ImageDataModule
from growtrain.models import cifar_resnet
from growtrain.module import ImageClassifier
from growtrain.saturation import measure_saturation
from growtrain.trial import train_block

TRAIN = "trial layer2.1 (1/3): train block"


def trainer_with(bar, rank_zero=True):
    return SimpleNamespace(progress_bar_callback=bar, is_global_zero=rank_zero)


class Recorder(Steps):
    """Counts what a phase reports (the tests' window onto any Steps)."""

    def __init__(self):
        self.calls, self.closed = [], 0

    def __call__(self, done, total, what):
        self.calls.append((done, total, what))

    def close(self):
        self.closed += 1


def test_nothing_is_shown_without_a_bar_with_a_disabled_one_or_off_rank_zero():
    assert progress_for(trainer_with(None)) is NO_PROGRESS  # enable_progress_bar=False
    assert progress_for(trainer_with(TQDMProgressBar(), rank_zero=False)) is NO_PROGRESS  # DDP rank ≠ 0
    assert progress_for(trainer_with(RichProgressBar(), rank_zero=False)) is NO_PROGRESS
    off = TQDMProgressBar()
    off.disable()  # what Lightning does to the bars of ranks other than 0
    assert progress_for(trainer_with(off)) is NO_PROGRESS
    assert progress_for(trainer_with(TQDMProgressBar(refresh_rate=0))) is NO_PROGRESS

    class Custom(ProgressBar):  # a bar drawn its own way: not ours to draw into
        pass

    assert progress_for(trainer_with(Custom())) is NO_PROGRESS
    assert progress_for(trainer_with(TQDMProgressBar())) is not NO_PROGRESS
    NO_PROGRESS(3, 8, "probe")  # the no-op takes the same calls
    NO_PROGRESS.close()


def test_a_rich_bar_gets_a_task_per_phase_below_the_training_task():
    bar = RichProgressBar()
    bar.progress = CustomProgress(*bar.configure_columns(None), console=Console(file=io.StringIO(), width=200),
                                  auto_refresh=False)  # fmt: skip
    epoch = bar.progress.add_task("Epoch 3", total=15, completed=15)  # the training bar, frozen at 15/15
    step = progress_for(trainer_with(bar))
    step(0, 200, TRAIN)
    step(120, 200, TRAIN)
    ours = [t for t in bar.progress.tasks if t.id != epoch]
    assert [(t.description, t.completed, t.total) for t in ours] == [(TRAIN, 120, 200)]
    screen = Console(record=True, width=200, file=io.StringIO())
    screen.print(bar.progress.get_renderable())
    text = screen.export_text()
    assert TRAIN in text and "120/200" in text and "15/15" in text
    step(3, 8, "trial layer2.1 (1/3): score on the probe")  # the next phase replaces this one
    assert [(t.description, t.completed, t.total) for t in bar.progress.tasks if t.id != epoch] == [
        ("trial layer2.1 (1/3): score on the probe", 3, 8)]
    step.close()
    assert [t.id for t in bar.progress.tasks] == [epoch]  # gone; the training task untouched
    assert bar.progress.tasks[0].completed == 15


def test_a_tqdm_bar_gets_a_nested_bar_per_phase(capsys):
    step = progress_for(trainer_with(TQDMProgressBar()))
    step(0, 200, TRAIN)
    step(120, 200, TRAIN)
    assert (step.pbar.n, step.pbar.total, step.pbar.desc) == (120, 200, TRAIN)
    # one line below the training bar (tqdm keeps a fixed position negated), cleared when done
    assert abs(step.pbar.pos) == 1 and not step.pbar.leave
    step.close()
    assert step.pbar is None
    assert TRAIN in capsys.readouterr().out


def test_counted_reports_every_batch_of_each_pass_and_ends_the_phase():
    rec = Recorder()
    data = [torch.full((2,), float(i)) for i in range(4)]
    wrapped = counted(data, rec, "probe pass")
    assert [float(b[0]) for b in wrapped] == [0.0, 1.0, 2.0, 3.0]  # the batches, unchanged
    assert rec.calls == [(k, 4, "probe pass") for k in range(5)] and rec.closed == 1
    for b in wrapped:  # abandoned mid-pass (a trial stops early): the display still ends
        break
    assert rec.calls[-1] == (0, 4, "probe pass") and rec.closed == 2
    rec = Recorder()
    list(counted(iter(data), rec, "unsized"))
    assert rec.calls[-1] == (4, None, "unsized")  # no length: an unknown total, still counted


@pytest.mark.parametrize("rule", ["crossfit", "paper"])
def test_the_probe_pass_reports_its_batches_and_measures_the_same(rule):
    """What the callback passes (``counted`` around the probe loader) leaves the report unchanged;
    the paper's rule reads the probe twice (BatchNorm calibration, then the scoring pass)."""
    torch.manual_seed(0)
    net = cifar_resnet((1, 1, 1), 4, "basic", 3, 4)
    g = torch.Generator().manual_seed(0)
    probe = [(torch.randn(16, 3, 8, 8, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(4)]
    kw = dict(rule=rule, variance=True, projected=False, probe_size=64)
    plain = measure_saturation(net, probe, F.cross_entropy, **kw)
    rec = Recorder()
    shown = measure_saturation(net, counted(probe, rec, "probe pass"), F.cross_entropy, **kw)
    assert shown.gamma == plain.gamma and [r.lower for r in shown.sites] == [r.lower for r in plain.sites]
    passes = 2 if rule == "paper" else 1
    assert rec.calls == [(k, 4, "probe pass") for k in range(5)] * passes and rec.closed == passes


def test_train_block_reports_every_step():
    torch.manual_seed(0)
    net = cifar_resnet((1, 1, 1), 4, "basic", 3, 4)
    block = net.grow("layer2.1", net.new_block("layer2.1", seed=1))
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(6)]
    seen = []
    fit = train_block(net, net, block, iter(data), F.cross_entropy, steps=5, lr=1e-3,
                      progress=lambda done, total: seen.append((done, total)))  # fmt: skip
    assert fit["steps"] == 5 and seen == [(k, 5) for k in range(1, 6)]


def tiny_dm() -> ImageDataModule:
    return ImageDataModule(dataset="synthetic", image_size=8, synthetic_size=400, synthetic_classes=4, probe_size=120,
                           val_size=40, batch_size=32, augment=False)  # fmt: skip


def fit_with_trials(tmp_path, monkeypatch, **trainer_kw):
    """One check with trials (decision="trial", the default); returns what each ``progress_for`` gave
    the trials and every call their phases made."""
    given, calls = [], []
    real = trial_check.progress_for

    class Spy(Steps):  # records every call, then lets the real Steps draw (or not)
        def __init__(self, inner):
            self.inner = inner

        def __call__(self, done, total, what):
            calls.append((done, total, what))
            self.inner(done, total, what)

        def close(self):
            self.inner.close()

    def spy(trainer):
        given.append(real(trainer))
        return Spy(given[-1])

    monkeypatch.setattr(trial_check, "progress_for", spy)
    L.seed_everything(0)
    grow = GrowUntilSaturated(schedule="periodic", max_growths=1, decision=Trial(epochs=0.5),
                              verbose=False)
    trainer = L.Trainer(max_epochs=1, callbacks=[grow, *trainer_kw.pop("callbacks", [])], logger=False,
                        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
                        default_root_dir=tmp_path, **trainer_kw)  # fmt: skip
    model = ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], family="basic", in_channels=3)
    trainer.fit(model, tiny_dm())
    assert grow.history and grow.history[0].get("trial")  # a check with trials ran
    return grow, given, calls


def test_a_fit_with_a_progress_bar_shows_each_trial(tmp_path, monkeypatch, capsys):
    grow, given, calls = fit_with_trials(tmp_path, monkeypatch, callbacks=[TQDMProgressBar()])
    assert len(given) == 1 and type(given[0]).__name__ == "_TqdmSteps"
    sites = [t["site"] for t in grow.history[0]["trial"]["trials"]]
    steps = grow.history[0]["trial"]["trials"][0]["steps"]
    for k, site in enumerate(sites):
        train = f"trial {site} ({k + 1}/{len(sites)}): train block"
        assert [(d, t) for d, t, w in calls if w == train] == [(d, steps) for d in range(1, steps + 1)]
        assert any(w == f"trial {site} ({k + 1}/{len(sites)}): score on the probe" for _, _, w in calls)
    out = capsys.readouterr().out
    assert f"trial {sites[0]} (1/{len(sites)}): train block" in out


def test_a_fit_without_a_progress_bar_shows_nothing(tmp_path, monkeypatch, capsys):
    grow, given, calls = fit_with_trials(tmp_path, monkeypatch, enable_progress_bar=False)
    assert given == [NO_PROGRESS] and calls  # the phases still report; the no-op shows nothing
    assert "train block" not in capsys.readouterr().out


def test_a_fit_with_a_progress_bar_shows_the_probe_pass(tmp_path, monkeypatch, capsys):
    fit_with_trials(tmp_path, monkeypatch, callbacks=[TQDMProgressBar()])
    assert "growth check: probe pass" in capsys.readouterr().out
