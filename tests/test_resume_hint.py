"""After Ctrl-C: the command that resumes the fit, and the run folder a resumed fit writes on into.

Pure functions first (``growtrain.resume``: the command for the CLI and for Python, the message,
the run folder a checkpoint belongs to, the metrics.csv rows a resume keeps), then one tiny
``growtrain fit`` interrupted by a KeyboardInterrupt at the end of its third epoch (what Ctrl-C raises):
it exits 1 and prints a command which, run as printed, resumes the fit into the same
``version_0/`` with each epoch's metrics once. A few seconds.
"""

from __future__ import annotations

import csv
import re
import shlex
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.loggers import CSVLogger

from growtrain.callbacks import GrowUntilSaturated
from growtrain.cli import GrowtrainCLI
from growtrain.module import ImageClassifier
from growtrain.resume import (CLI_ARGV_ATTRIBUTE, RunFolderCSVLogger, continue_run_folder, interrupted_message,
                              latest_checkpoint, resume_command, rows_up_to, run_folder_of)  # fmt: skip

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
LAST = "runs/quickstart/lightning_logs/version_3/checkpoints/last.ckpt"


# -- the command ---------------------------------------------------------------------------------
def test_the_cli_command_is_the_one_given_plus_the_checkpoint():
    argv = ["fit", "--config", "configs/quickstart.yaml", "--trainer.max_epochs=5"]
    assert resume_command(argv, LAST) == f"growtrain fit --config configs/quickstart.yaml --trainer.max_epochs=5 --ckpt_path {LAST}"


@pytest.mark.parametrize("earlier", [["--ckpt_path", "old.ckpt"], ["--ckpt_path=old.ckpt"]])
def test_an_earlier_ckpt_path_is_replaced_not_repeated(earlier):
    argv = ["fit", "--config=configs/quickstart.yaml", *earlier, "--data.seed=1"]
    assert resume_command(argv, LAST) == f"growtrain fit --config=configs/quickstart.yaml --data.seed=1 --ckpt_path {LAST}"


def test_paths_are_quoted_for_the_shell():
    command = resume_command(["fit", "--config", "my configs/q.yaml"], "runs/a b/last.ckpt")
    assert shlex.split(command) == ["growtrain", "fit", "--config", "my configs/q.yaml", "--ckpt_path", "runs/a b/last.ckpt"]


def test_from_python_the_command_is_trainer_fit_with_ckpt_path():
    assert resume_command(None, LAST) == f"trainer.fit(model, datamodule=datamodule, ckpt_path='{LAST}')"
    assert resume_command(None, None) == "trainer.fit(model, datamodule=datamodule)"


def test_without_a_checkpoint_the_command_starts_the_fit_again():
    argv = ["fit", "--config", "configs/quickstart.yaml", "--ckpt_path", "old.ckpt"]
    assert resume_command(argv, None) == "growtrain fit --config configs/quickstart.yaml"


def test_the_readmes_resume_command_is_the_one_printed_for_the_quickstart():
    readme = (CONFIGS.parent / "README.md").read_text()
    section = readme[readme.index("### Resuming an interrupted fit"):readme.index("### Terms")]
    (shown,) = [line for line in section.splitlines() if line.startswith("growtrain fit ")]
    last = "runs/quickstart/lightning_logs/version_0/checkpoints/last.ckpt"
    assert shown == resume_command(["fit", "--config", "configs/quickstart.yaml"], last)
    assert run_folder_of(last) == (Path("runs/quickstart/lightning_logs"), 0)  # it writes on into version_0/


# -- the message ---------------------------------------------------------------------------------
ARGV = ["fit", "--config", "configs/quickstart.yaml"]
AT_END = {"epoch": 6, "global_step": 112, "at_epoch_end": True}


def test_the_message_names_where_it_resumes_from_and_what_it_promises():
    text = interrupted_message(epoch=7, argv=ARGV, ckpt_path=LAST, saved=AT_END,
                               run_folder=str(Path(LAST).parent.parent), same_folder=True)  # fmt: skip
    lines = text.splitlines()
    assert lines[0] == ("growtrain: the fit was interrupted (Ctrl-C) in epoch 7. To resume it from its latest checkpoint "
                        "(written at the end of epoch 6, step 112), run:")  # fmt: skip
    assert lines[1] == f"  growtrain fit --config configs/quickstart.yaml --ckpt_path {LAST}"
    assert "writes on into runs/quickstart/lightning_logs/version_3/ (metrics.csv continues)" in lines[2]
    assert "so it makes the same growth checks" in lines[2]


def test_a_checkpoint_without_random_state_is_said_to_resume_differently():
    text = interrupted_message(epoch=7, argv=None, ckpt_path=LAST, saved=None)
    assert "fit a trainer built as this one on the same model and data:" in text
    assert f"ckpt_path='{LAST}'" in text
    assert "cannot restore the random state" in text and "RandomStateCheckpoint" in text
    assert "same growth checks" not in text and "writes on into" not in text


def test_a_mid_epoch_checkpoint_promises_nothing_about_the_batches():
    saved = {"epoch": 6, "global_step": 100, "at_epoch_end": False}
    text = interrupted_message(epoch=6, argv=ARGV, ckpt_path=LAST, saved=saved)
    assert "(written in epoch 6, at step 100)" in text
    assert "same growth checks" not in text and "cannot restore" not in text


def test_no_checkpoint_yet_says_so_and_gives_the_command_that_starts_over():
    text = interrupted_message(epoch=0, argv=ARGV, ckpt_path=None)
    assert "no checkpoint was written yet" in text and "save_last=True" in text
    assert text.splitlines()[-1] == "  growtrain fit --config configs/quickstart.yaml"


def test_the_latest_checkpoint_is_last_ckpt_or_an_unmonitored_callbacks_latest_save():
    def cb(monitor=None, best="", last=""):
        return SimpleNamespace(monitor=monitor, best_model_path=best, last_model_path=last)

    trainer = SimpleNamespace(checkpoint_callbacks=[cb("train_loss", best="b.ckpt"), cb("train_loss", last="last.ckpt")])
    assert latest_checkpoint(trainer) == "last.ckpt"
    # Lightning's default ModelCheckpoint (no monitor, no save_last) keeps only its latest save
    assert latest_checkpoint(SimpleNamespace(checkpoint_callbacks=[cb(best="epoch=3-step=8.ckpt")])) == "epoch=3-step=8.ckpt"
    # the best of a monitored callback may be epochs old: resuming from it is not resuming the fit
    assert latest_checkpoint(SimpleNamespace(checkpoint_callbacks=[cb("val_loss", best="b.ckpt")])) is None
    assert latest_checkpoint(SimpleNamespace(checkpoint_callbacks=[])) is None


# -- the run folder ------------------------------------------------------------------------------
def test_run_folder_of_a_checkpoint():
    assert run_folder_of(LAST) == (Path("runs/quickstart/lightning_logs"), 3)
    assert run_folder_of("runs/x/last.ckpt") is None  # not in a version_N/checkpoints/ folder
    assert run_folder_of("runs/version_3/ckpts/last.ckpt") is None
    assert run_folder_of("last") is None  # Lightning's "last"/"best": no folder to continue


def _checkpoint(path: Path, epoch: int, step: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"epoch": epoch, "global_step": step}, path)  # what continue_run_folder reads of one
    return path


def test_continue_run_folder_sets_the_version_of_an_automatic_csv_logger(tmp_path):
    auto = CSVLogger(tmp_path, name="lightning_logs")
    pinned = CSVLogger(tmp_path, name="lightning_logs", version=7)
    trainer = SimpleNamespace(loggers=[pinned, auto])
    ckpt = _checkpoint(tmp_path / "lightning_logs" / "version_3" / "checkpoints" / "last.ckpt", 1, 8)
    assert continue_run_folder(trainer, ckpt) == tmp_path / "lightning_logs" / "version_3"
    assert trainer.loggers[0] is pinned  # a version the user chose is kept
    assert isinstance(trainer.loggers[1], RunFolderCSVLogger) and trainer.loggers[1].version == 3
    assert trainer.loggers[1].resume_at == (1, 8)
    # a checkpoint outside this logger's folders, one that cannot be read, or none: nothing changes
    other = SimpleNamespace(loggers=[CSVLogger(tmp_path, name="lightning_logs")])
    elsewhere = _checkpoint(tmp_path / "elsewhere" / "version_3" / "checkpoints" / "last.ckpt", 1, 8)
    assert continue_run_folder(other, elsewhere) is None
    assert continue_run_folder(other, tmp_path / "lightning_logs" / "version_3" / "checkpoints" / "gone.ckpt") is None
    assert continue_run_folder(other, None) is None and type(other.loggers[0]) is CSVLogger


def test_an_earlier_checkpoint_of_the_run_branches_into_a_new_folder(tmp_path):
    """The run's metrics.csv goes on past the epoch after the checkpoint: resuming from it is a
    new branch (e.g. from best_train.ckpt); the run's rows stay as they are, in their folder."""
    run = tmp_path / "lightning_logs" / "version_0"
    _write_csv(run / "metrics.csv", [{"epoch": e, "step": 4 * e + 3, "train_loss": 1.0} for e in range(6)])
    trainer = SimpleNamespace(loggers=[CSVLogger(tmp_path, name="lightning_logs")])
    assert continue_run_folder(trainer, _checkpoint(run / "checkpoints" / "best_train.ckpt", 2, 12)) is None
    assert type(trainer.loggers[0]) is CSVLogger and len(_read_csv(run / "metrics.csv")) == 6
    # the latest checkpoint (epoch 4; epoch 5 was interrupted and is trained again) continues the run
    assert continue_run_folder(trainer, _checkpoint(run / "checkpoints" / "last.ckpt", 4, 20)) == run


def _write_csv(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=sorted({k for r in rows for k in r}))
        writer.writeheader()
        writer.writerows(rows)


def _read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


def test_the_resumed_logger_keeps_the_rows_up_to_the_checkpoint_and_appends(tmp_path):
    metrics = tmp_path / "lightning_logs" / "version_0" / "metrics.csv"
    _write_csv(metrics, [
        {"epoch": 0, "step": 3, "train_loss": 1.0}, {"epoch": 1, "step": 7, "train_loss": 0.9},
        {"step": 8, "growth/gamma": 0.5},  # a check's row (step only), at the checkpoint's step
        {"epoch": 2, "step": 9, "train_loss": 0.8},  # the interrupted epoch: trained again after the resume
    ])  # fmt: skip
    logger = RunFolderCSVLogger(tmp_path, name="lightning_logs", version=0, resume_at=(1, 8))
    logger.log_metrics({"epoch": 2, "train_loss": 0.7}, step=9)
    logger.save()
    rows = _read_csv(metrics)
    assert [(r["epoch"], r["step"], r["train_loss"]) for r in rows] == [
        ("0", "3", "1.0"), ("1", "7", "0.9"), ("", "8", ""), ("2", "9", "0.7")]  # fmt: skip
    logger.log_metrics({"epoch": 3, "val_loss": 0.6}, step=11)  # a new column: the header grows, rows stay
    logger.save()
    rows = _read_csv(metrics)
    assert len(rows) == 5 and rows[-1]["val_loss"] == "0.6" and rows[0]["train_loss"] == "1.0"


def test_rows_up_to_a_checkpoint():
    keep = rows_up_to(1, 8)
    assert keep({"epoch": "1", "step": "8"}) and keep({"epoch": "", "step": "8"}) and keep({"other": "x"})
    assert not keep({"epoch": "2", "step": "8"}) and not keep({"epoch": "", "step": "9"})


# -- Ctrl-C in a growtrain fit ---------------------------------------------------------------------
def tiny_args(root: Path, *extra: str) -> list[str]:
    """The shipped quickstart, cut to a few seconds (synthetic 8x8 images), with its logger."""
    return [
        "fit", f"--config={CONFIGS / 'quickstart.yaml'}", "--trainer.max_epochs=4", "--trainer.limit_train_batches=2",
        "--trainer.limit_val_batches=1", "--trainer.log_every_n_steps=1", "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false", f"--trainer.default_root_dir={root}", "--data.dataset=synthetic",
        "--data.synthetic_size=256", "--data.synthetic_classes=4", "--data.image_size=8", "--data.probe_size=32",
        "--data.val_size=32", "--data.batch_size=32", "--model.width=4", "--data.train_subset=null",
        # the growth callback's: a check every epoch (after a one-epoch stage anneal), so one runs before
        # Ctrl-C, and training on to max_epochs whatever they decide
        "--trainer.callbacks.schedule=growtrain.Periodic", "--trainer.callbacks.schedule.anneal_epochs=1",
        "--trainer.callbacks.on_saturated=continue", *extra,
    ]  # fmt: skip


@pytest.fixture
def ctrl_c_in_epoch_2(monkeypatch):
    """Ctrl-C at the end of epoch 2, after its validation (logged) and before its checkpoint:
    the model's ``on_train_epoch_end`` (after the callbacks', before ModelCheckpoint's) raises
    KeyboardInterrupt, once. Lightning then ignores SIGINT for its shutdown: the handler is put
    back afterwards."""
    handler = signal.getsignal(signal.SIGINT)
    armed = [True]

    def on_train_epoch_end(self):
        if armed[0] and self.current_epoch == 2:
            armed[0] = False
            raise KeyboardInterrupt

    monkeypatch.setattr(ImageClassifier, "on_train_epoch_end", on_train_epoch_end)
    yield
    signal.signal(signal.SIGINT, handler)


def test_ctrl_c_prints_the_command_that_resumes_into_the_same_folder(tmp_path, ctrl_c_in_epoch_2, capsys):
    args = tiny_args(tmp_path)
    with pytest.raises(SystemExit) as exited:
        GrowtrainCLI(args=args)
    assert exited.value.code == 1  # Lightning's exit status after Ctrl-C
    run = tmp_path / "lightning_logs" / "version_0"
    out = capsys.readouterr().out
    assert "growtrain: the fit was interrupted (Ctrl-C) in epoch 2. To resume it from its latest checkpoint (written at " \
           "the end of epoch 1, step 4), run:" in out  # fmt: skip
    (command,) = [line.strip() for line in out.splitlines() if line.startswith("  growtrain fit ")]
    assert command == "growtrain " + shlex.join([*args, "--ckpt_path", str(run / "checkpoints" / "last.ckpt")])
    assert f"writes on into {run}/ (metrics.csv continues)" in out
    assert (run / "gamma_trace.png").is_file()  # GammaTracePlot writes it on Ctrl-C too (the summary names it)
    # Lightning wrote what epoch 2 logged (its validation) when it shut down; the resume trains epoch 2 again
    assert sorted(r["epoch"] for r in _read_csv(run / "metrics.csv") if r.get("val_loss")) == ["0", "1", "2"]

    tokens = shlex.split(command)
    resumed = GrowtrainCLI(args=tokens[1:])  # the command as printed, after `growtrain`
    assert getattr(resumed.trainer, CLI_ARGV_ATTRIBUTE) == tokens[1:]
    epochs = resumed.trainer.current_epoch
    assert epochs == 4 and Path(resumed.trainer.log_dir) == run
    assert sorted(p.name for p in run.parent.iterdir()) == ["version_0"]
    rows = _read_csv(run / "metrics.csv")  # every epoch once: the interrupted epoch's rows were dropped
    assert sorted(int(r["epoch"]) for r in rows if r.get("val_loss")) == list(range(epochs))
    assert sorted(int(r["epoch"]) for r in rows if r.get("train_loss")) == list(range(epochs))


@pytest.mark.skipif(GrowUntilSaturated.on_exception is Callback.on_exception,
                    reason="GrowUntilSaturated.on_exception (its summary on Ctrl-C) is not in growth.py yet")
def test_ctrl_c_prints_the_growth_summary_before_the_command(tmp_path, ctrl_c_in_epoch_2, capsys, monkeypatch):
    from growtrain.callbacks import telemetry

    printed = []  # without a rich bar the summary goes through rank_zero_info (whatever logging's state): read it there
    monkeypatch.setattr(telemetry, "rank_zero_info", lambda message: printed.append(str(message)))
    with pytest.raises(SystemExit):
        GrowtrainCLI(args=tiny_args(tmp_path))
    summary = "\n".join(printed)
    assert re.search(r"GrowUntilSaturated: depth 3 → \d", summary) and "check" in summary  # the fit so far
    assert "growtrain: the fit was interrupted (Ctrl-C)" in capsys.readouterr().out


@pytest.mark.parametrize("config", ["configs/quickstart.yaml", "configs/resnet.yaml", "configs/paper/gpt2_small.yaml"])
def test_the_shipped_configs_last_ckpt_is_the_last_epoch_even_when_the_monitor_does_not_improve(config, tmp_path):
    """The configs' checkpoint callbacks, as written, on a run whose train_loss rises every epoch:
    last.ckpt (what the resume command names) must be the last epoch's, not the best one's (a
    monitored ModelCheckpoint writes save_last only on the epochs it saves a top-k file)."""
    import lightning as L
    import yaml
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    specs = [c for c in yaml.safe_load((CONFIGS.parent / config).read_text())["trainer"]["callbacks"]
             if c["class_path"].endswith("ModelCheckpoint")]  # fmt: skip
    assert specs
    callbacks = [ModelCheckpoint(dirpath=tmp_path, **spec.get("init_args", {})) for spec in specs]

    class Rising(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def training_step(self, batch, batch_idx):
            self.log("train_loss", float(self.current_epoch), on_step=False, on_epoch=True)  # worse every epoch
            return (self.w * batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = L.Trainer(max_epochs=3, callbacks=callbacks, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(Rising(), DataLoader(TensorDataset(torch.ones(4, 1)), batch_size=2))
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["epoch"] == 2  # the third epoch's
