"""`growtrain fit` through GrowtrainCLI, in-process, with the shipped configs shrunk to seconds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from growtrain.callbacks import Trial
from growtrain.cli import GrowtrainCLI, main

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def tiny_fit_args(root: Path, *extra: str) -> list[str]:
    return [
        "fit",
        f"--config={CONFIGS / 'quickstart.yaml'}",
        "--trainer.max_epochs=3",
        "--trainer.limit_train_batches=2",
        "--trainer.limit_val_batches=1",
        "--trainer.logger=false",
        "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={root}",
        "--data.dataset=synthetic",
        "--data.synthetic_size=256",
        "--data.synthetic_classes=4",
        "--data.image_size=8",
        "--data.probe_size=32",
        "--data.val_size=32",
        "--data.batch_size=32",
        "--model.width=4",
        "--data.train_subset=null",  # the quickstart trains on 2000 of its images; the synthetic set has fewer
        *extra,
    ]


def test_the_quickstart_as_shipped_warns_of_nothing_of_its_own(tmp_path):
    """The shipped quickstart (its own data, probe and decision), cut to one short epoch: the
    only warning of growtrain's own is that so short a fit cannot grow — nothing about its
    settings (a probe too small for min_gain, say)."""
    import warnings

    import growtrain

    args = ["fit", f"--config={CONFIGS / 'quickstart.yaml'}", "--trainer.max_epochs=1", "--trainer.limit_train_batches=2",
            "--trainer.limit_val_batches=1", "--trainer.logger=false", "--trainer.enable_progress_bar=false",
            f"--trainer.default_root_dir={tmp_path}"]  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        GrowtrainCLI(args=args)
    package = Path(growtrain.__file__).parent
    ours = [str(w.message) for w in caught if Path(w.filename).resolve().is_relative_to(package)]
    # the last anneal_epochs of max_epochs are the final anneal's: so short a fit can only say it cannot grow
    assert len(ours) == 1 and ours[0].startswith("GrowUntilSaturated: max_epochs=1 leaves no epoch to grow in"), ours


def test_fit_quickstart_config_tiny(tmp_path):
    # 3 epochs are all the final anneal's (anneal_epochs=3, reserved inside max_epochs): the callback says so
    with pytest.warns(UserWarning, match=r"GrowUntilSaturated: max_epochs=3 leaves no epoch to grow in"):
        cli = GrowtrainCLI(args=tiny_fit_args(tmp_path))
    assert cli.trainer.state.finished
    # the datamodule decided the head and the stem (linked at instantiation)
    assert cli.model.network.fc.out_features == 4 and cli.model.network.stem.in_channels == 3
    checkpoints = {p.name for p in tmp_path.rglob("*.ckpt")}
    assert checkpoints == {"last.ckpt", "best_train.ckpt", "epoch=2-step=6.ckpt"}  # last.ckpt links the latest epoch's
    assert (tmp_path / "config.yaml").is_file()
    hparams = torch.load(next(tmp_path.rglob("last.ckpt")), weights_only=True)["hyper_parameters"]
    assert hparams["optimizer"]["class_path"] == "torch.optim.SGD"  # the config, as plain data

    (grower,) = [c for c in cli.trainer.callbacks if type(c).__name__ == "GrowUntilSaturated"]
    # as shipped: checks on a validation-loss plateau after a stage anneal, growth decided by block-only trials
    assert (grower.schedule.monitor, grower.rule, grower.decision, grower.lr_schedule, grower.on_saturated) == (
        "val_loss", "crossfit", Trial(min_gain=0.01), "anneal", "anneal")  # fmt: skip
    # growth ended as a budget at the first epoch (no probe), and the rest was the final anneal
    assert [h["action"] for h in grower.history] == ["budget"] and grower.finished == "budget"
    assert "reserved for the final anneal" in grower.history[0]["reason"] and grower.history[0]["epoch"] == 0


# Replaces the quickstart's callbacks: checkpoints as there, and a grower that must grow once
# (paper rule, delta = 0 and a negligible t: grow as soon as any site has a gradient).
FORCED_GROWTH = """
trainer:
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {save_last: true, save_top_k: 0}
    - class_path: growtrain.callbacks.GrowUntilSaturated
      init_args: {schedule: periodic, rule: paper, t: 1.0e-9, delta: 0.0, max_growths: 1, verbose: false,
                  lr_schedule: continue, decision: rule, on_saturated: stop}
                  # (jsonargparse merges these into the quickstart's; on_saturated: stop reserves no final anneal)
"""


def test_fit_grows_and_resumes_through_the_cli(tmp_path):
    (tmp_path / "grow.yaml").write_text(FORCED_GROWTH)
    grow = f"--config={tmp_path / 'grow.yaml'}"
    cli = GrowtrainCLI(args=tiny_fit_args(tmp_path, grow))
    grown = cli.model.network.growth_log
    assert len(grown) == 1
    # `fit --ckpt_path` loads with weights_only=True and must rebuild the grown network
    last = next(tmp_path.rglob("last.ckpt"))
    resumed = GrowtrainCLI(args=tiny_fit_args(tmp_path, grow, f"--ckpt_path={last}", "--trainer.max_epochs=4"))
    assert resumed.trainer.current_epoch == 4
    assert resumed.model.network.growth_log == grown
    assert [g["name"] for g in resumed.trainer.optimizers[0].param_groups] == ["base", "growth0"]


@pytest.mark.parametrize("where", ["flag", "abbreviation", "config"])
def test_typo_in_a_key_is_a_parser_error(where, tmp_path, capsys):
    typo = {"flag": "--trainer.max_epohcs=1", "abbreviation": "--trainer.max_epoch=1"}.get(where)
    if where == "config":
        (tmp_path / "typo.yaml").write_text("trainer:\n  max_epohcs: 1\n")
        typo = f"--config={tmp_path / 'typo.yaml'}"
    with pytest.raises(SystemExit) as error:
        GrowtrainCLI(args=tiny_fit_args(tmp_path, typo))
    assert error.value.code != 0
    assert "max_epo" in capsys.readouterr().err


def test_no_top_level_optimizer_key(tmp_path, capsys):
    # LightningCLI's top-level optimizer would be built once and go stale after growth.
    with pytest.raises(SystemExit):
        GrowtrainCLI(args=tiny_fit_args(tmp_path, "--optimizer=torch.optim.Adam"))


def test_resnet_config_is_the_paper_recipe():
    cli = GrowtrainCLI(args=[f"--config={CONFIGS / 'resnet.yaml'}", "--trainer.logger=false"], run=False)
    assert cli.trainer.max_epochs == 1800 and cli.datamodule.batch_size == 128  # 300 epochs a stage, 6 stages
    assert cli.datamodule.dataset == "cifar10" and cli.model.network.fc.out_features == 10
    config = cli.model.configure_optimizers()
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    assert optimizer.defaults["lr"] == 0.1 and optimizer.defaults["momentum"] == 0.9
    assert optimizer.defaults["weight_decay"] == 5e-4
    assert dict(scheduler.milestones) == {100: 1, 150: 1} and scheduler.gamma == 0.1
    # it grows: each stage by Table 5's protocol, checked once converged (its early stopping is the plateau)
    (grow,) = [c for c in cli.trainer.callbacks if type(c).__name__ == "GrowUntilSaturated"]
    when = grow.schedule
    assert (when.kind, when.monitor, when.patience, when.min_stage_epochs) == ("converged", "train_loss", 30, 180)
    assert (grow.lr_schedule, grow.decision.name, grow.max_growths, grow.on_saturated) == ("restart", "trial", 5, "stop")
    assert cli.trainer.max_epochs >= 300 * (1 + grow.max_growths)
    best, latest = [c for c in cli.trainer.callbacks if type(c).__name__ == "ModelCheckpoint"]
    assert (best.monitor, best.save_top_k, best.filename) == ("train_loss", 1, "best_train")  # best_train ...
    assert (latest.monitor, latest.save_last) == (None, "link")  # ... and last


def test_a_missing_archive_without_network_is_one_line_naming_the_file_and_the_fix(tmp_path, monkeypatch, capsys):
    import urllib.request

    def offline(*args, **kwargs):
        raise OSError("no network")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    with pytest.raises(SystemExit) as error:
        main(["fit", f"--config={CONFIGS / 'resnet.yaml'}", f"--data.root={tmp_path / 'cifar10'}",
              f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=false", "--trainer.max_epochs=1"])
    assert error.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: download of ") and "Traceback" not in "\n".join(err)
    assert err[-1].endswith(f"Fix: download it by hand and put it at {tmp_path / 'cifar10' / 'cifar-10-python.tar.gz'}.")


def test_help_exits_cleanly(capsys):
    with pytest.raises(SystemExit) as error:
        main(["fit", "--help"])
    assert error.value.code == 0
    assert "--model" in capsys.readouterr().out


# -- every output of a run follows --trainer.default_root_dir ----------------------------------
def _shipped_configs() -> list[Path]:
    return sorted(CONFIGS.rglob("*.yaml"))


@pytest.mark.parametrize("config", _shipped_configs(), ids=lambda p: str(p.relative_to(CONFIGS)))
def test_no_shipped_config_pins_the_logger_directory(config):
    """A logger with its own save_dir keeps metrics.csv and growth_history.json where the config
    says, whatever --trainer.default_root_dir is; the configs leave the logger to Lightning's
    default, which writes under default_root_dir."""
    import yaml

    trainer = (yaml.safe_load(config.read_text()) or {}).get("trainer") or {}
    loggers = trainer.get("logger")
    loggers = loggers if isinstance(loggers, list) else [loggers]
    for logger in loggers:
        if isinstance(logger, dict):
            assert "save_dir" not in (logger.get("init_args") or {}), (config, logger)


def test_default_root_dir_moves_every_output(tmp_path, monkeypatch):
    """The quickstart config with its logger as shipped (no --trainer.logger override), run from
    another working directory: checkpoints, metrics.csv, growth_history.json, the Γ̂ trace and
    config.yaml all land under --trainer.default_root_dir, nothing in the working directory."""
    import warnings

    import growtrain

    cwd, root = tmp_path / "cwd", tmp_path / "out"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    (tmp_path / "grow.yaml").write_text(FORCED_GROWTH)
    args = [a for a in tiny_fit_args(root, f"--config={tmp_path / 'grow.yaml'}") if a != "--trainer.logger=false"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli = GrowtrainCLI(args=args)
    assert len(cli.model.network.growth_log) == 1
    assert list(cwd.iterdir()) == []
    names = {p.name for p in root.rglob("*") if p.is_file()}
    assert {"last.ckpt", "metrics.csv", "growth_history.json", "gamma_trace.png", "config.yaml"} <= names, names
    log_dir = Path(cli.trainer.log_dir)
    assert log_dir.is_relative_to(root)
    assert (log_dir / "metrics.csv").is_file() and (log_dir / "growth_history.json").is_file()
    # growtrain's own code warns about nothing in a normal run (third-party deprecations aside)
    package = Path(growtrain.__file__).parent
    ours = [w for w in caught if Path(w.filename).resolve().is_relative_to(package)]
    assert not ours, [f"{w.filename}:{w.lineno}: {w.message}" for w in ours]


def test_a_fit_of_no_epoch_warns_once_shows_its_depth_and_names_only_files_it_wrote(tmp_path, monkeypatch):
    """`growtrain fit --config configs/quickstart.yaml --trainer.max_epochs=0` (shrunk, with its default
    logger): growtrain warns once that no check ran; the summary gives the depth the network has (no check,
    no growth: 3 → 3, though training never started), says why in one line instead of repeating the
    warning, and names no metrics.csv: nothing was logged, so none was written."""
    import io
    import warnings

    from rich.console import Console

    import growtrain
    from growtrain.callbacks import telemetry

    printed: list[str] = []

    def capture(trainer, renderable, **kw):
        buffer = io.StringIO()
        Console(file=buffer, width=300, color_system=None).print(renderable)
        printed.append(buffer.getvalue())

    monkeypatch.setattr(telemetry, "print_renderable", capture)
    args = [a for a in tiny_fit_args(tmp_path, "--trainer.max_epochs=0") if a != "--trainer.logger=false"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli = GrowtrainCLI(args=args)
    package = Path(growtrain.__file__).parent
    ours = [str(w.message) for w in caught if Path(w.filename).resolve().is_relative_to(package)]
    assert len(ours) == 1 and ours[0].startswith("GrowUntilSaturated: no growth check ran in this fit of 0 epoch(s)")
    assert ours[0].endswith("Fix: train longer (trainer.max_epochs or max_steps).")  # no plateau advice: no epoch was judged
    (summary,) = printed
    assert summary.startswith("GrowUntilSaturated: depth 3 → 3: no growth check ran — no training epoch ended")
    assert "the warning above says what to change" in summary
    assert "Fix:" not in summary and "growth_history.json" not in summary  # the warning is not printed twice
    assert cli.trainer.logger is not None and not list(tmp_path.rglob("metrics.csv"))
    assert "metrics.csv" not in summary and "outputs:" not in summary and "checkpoints:" not in summary


def _fit_configs() -> list[Path]:
    """The shipped configs whose own header runs them with ``growtrain fit --config <it>``."""
    return [p for p in _shipped_configs() if f"growtrain fit --config configs/{p.relative_to(CONFIGS)}" in p.read_text()]


@pytest.mark.parametrize("config", _fit_configs(), ids=lambda p: str(p.relative_to(CONFIGS)))
def test_every_fit_config_writes_under_runs_not_the_working_directory(config):
    """Without default_root_dir Lightning writes ./lightning_logs/ (and checkpoints in it) into
    whatever directory the command ran from."""
    import yaml

    trainer = (yaml.safe_load(config.read_text()) or {}).get("trainer") or {}
    assert str(trainer.get("default_root_dir", "")).startswith("runs/"), config


def _callback_args(config: Path) -> dict | None:
    import yaml

    trainer = (yaml.safe_load(config.read_text()) or {}).get("trainer") or {}
    for cb in trainer.get("callbacks") or []:
        if isinstance(cb, dict) and str(cb.get("class_path", "")).endswith("GrowUntilSaturated"):
            return dict(cb.get("init_args") or {})
    return None


@pytest.mark.parametrize("config", [p for p in _shipped_configs() if _callback_args(p) is not None],
                         ids=lambda p: str(p.relative_to(CONFIGS)))  # fmt: skip
def test_no_shipped_config_makes_the_callback_warn(config):
    """A shipped config is one the code does not warn about nor refuse: its callback builds without
    a warning as LightningCLI builds it (jsonargparse), each part the class its ``class_path`` names
    (StageFork and Trial share min_gain: a config must not get the other), and under FSDP2 its
    strategy is one that setup accepts (data parallel only)."""
    import importlib
    import warnings
    from types import SimpleNamespace

    import yaml
    from jsonargparse import ArgumentParser

    from growtrain.callbacks import GrowUntilSaturated
    from growtrain.callbacks.sharded import check_model_parallel

    args = _callback_args(config)
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(GrowUntilSaturated, "grow")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        grow = parser.instantiate(parser.parse_object({"grow": args})).grow
    for part in ("schedule", "decision"):
        if isinstance(args.get(part), dict):  # class_path: module.Name
            module, _, name = args[part]["class_path"].rpartition(".")
            assert type(getattr(grow, part)) is getattr(importlib.import_module(module), name), (config, part)
    strategy = ((yaml.safe_load(config.read_text()) or {}).get("trainer") or {}).get("strategy")
    if "ModelParallelStrategy" in str(strategy):
        # what setup checks under FSDP2 (data parallel only: tensor_parallel_size 1), without a GPU
        fsdp = SimpleNamespace(_device_mesh=None, _tensor_parallel_size=1, _data_parallel_size=2)
        check_model_parallel(SimpleNamespace(strategy=fsdp, world_size=2))
        with pytest.raises(RuntimeError, match=r"^strategy: .*tensor_parallel_size=2 .*Fix: "):
            check_model_parallel(SimpleNamespace(strategy=SimpleNamespace(
                _device_mesh=None, _tensor_parallel_size=2, _data_parallel_size=1), world_size=2))


def test_the_fit_configs_are_found():
    names = {str(p.relative_to(CONFIGS)) for p in _fit_configs()}
    assert {"quickstart.yaml", "gpt.yaml", "hf/tiny_llama_stdlib.yaml", "fmnist/growth.yaml"} <= names, names


# -- a run that fails in its setup leaves no folder that looks like a run ---------------------------------
def test_a_setup_error_leaves_no_empty_version_folder(tmp_path):
    """A missing data root fails in the datamodule's setup, after the logger created version_0/:
    the error comes out unchanged and no empty version_0/ (nor an empty lightning_logs/) is left."""
    from growtrain.data import DatasetNotFoundError

    run = tmp_path / "run"
    args = ["fit", f"--config={CONFIGS / 'quickstart.yaml'}", "--data.dataset=fashion-mnist",
            f"--data.root={tmp_path / 'nowhere'}", f"--trainer.default_root_dir={run}",
            "--trainer.enable_progress_bar=false"]  # fmt: skip
    with pytest.raises(DatasetNotFoundError, match=r"fashion-mnist: IDX files not found\. Looked in: .*nowhere"):
        GrowtrainCLI(args=args)
    assert not (run / "lightning_logs").exists(), sorted(str(p) for p in run.rglob("*"))


def test_only_folders_a_failed_run_wrote_nothing_to_are_removed(tmp_path):
    """An empty version folder goes, and one holding only the CLI's config.yaml and hparams.yaml
    before any step; one holding anything else, or written after training steps, stays."""
    from types import SimpleNamespace

    from growtrain.trainer import remove_unwritten_log_dirs

    def logger(version: str, *files: str):
        folder = tmp_path / "lightning_logs" / version
        folder.mkdir(parents=True)
        for name in files:
            (folder / name).write_text("x")
        return SimpleNamespace(log_dir=str(folder), _experiment=object(), name="lightning_logs")

    empty, setup_only = logger("version_0"), logger("version_1", "config.yaml", "hparams.yaml")
    metrics = logger("version_2", "config.yaml", "metrics.csv")
    trained = SimpleNamespace(loggers=[empty, setup_only, metrics], global_step=5)
    assert remove_unwritten_log_dirs(trained) == [empty.log_dir]  # steps trained: its config.yaml is kept
    fresh = SimpleNamespace(loggers=[setup_only, metrics], global_step=0)
    assert remove_unwritten_log_dirs(fresh) == [setup_only.log_dir]  # metrics.csv: version_2 stays
    assert sorted(p.name for p in (tmp_path / "lightning_logs").iterdir()) == ["version_2"]
    for name in ("config.yaml", "metrics.csv"):
        (tmp_path / "lightning_logs" / "version_2" / name).unlink()
    (tmp_path / "lightning_logs" / "version_2").rmdir()
    earlier = logger("version_3", "config.yaml")  # a resumed run's folder: only an empty one may go
    assert remove_unwritten_log_dirs(SimpleNamespace(loggers=[earlier], global_step=0), frozenset()) == []
    (tmp_path / "lightning_logs" / "version_3" / "config.yaml").unlink()
    assert remove_unwritten_log_dirs(SimpleNamespace(loggers=[earlier], global_step=0)) == [
        earlier.log_dir, str(tmp_path / "lightning_logs")]  # the logger's folder, left empty, goes too  # fmt: skip


def test_a_failed_resume_keeps_the_earlier_runs_config(tmp_path):
    """Through the wrapped entry point: a failure with a ckpt_path never removes the setup files of the
    folder it may have written on into; without one it does (before any step)."""
    from growtrain import trainer as T

    folder = tmp_path / "lightning_logs" / "version_0"
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text("x")
    logger = type("Logger", (), {"log_dir": str(folder), "_experiment": object(), "name": "lightning_logs"})()

    def failing(self, model, ckpt_path=None):
        raise RuntimeError("setup failed")

    wrapped = T._tidy_on_failure(failing)
    fake = type("Fake", (), {"loggers": [logger], "global_step": 0})()
    with pytest.raises(RuntimeError, match="setup failed"):
        wrapped(fake, None, ckpt_path="some.ckpt")
    assert (folder / "config.yaml").is_file()
    with pytest.raises(RuntimeError, match="setup failed"):
        wrapped(fake, None)
    assert not folder.exists()
