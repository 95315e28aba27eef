"""`growtrain fit` through GrowtrainCLI, in-process, with the shipped configs shrunk to seconds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

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
    only warning of growtrain's own is that so short a fit ran no check — nothing about its
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
    assert len(ours) == 1 and ours[0].startswith("GrowUntilSaturated: no growth check ran"), ours


def test_fit_quickstart_config_tiny(tmp_path):
    # 3 epochs are too few for a check (a val_loss plateau, then a 3-epoch stage anneal): the callback says so
    with pytest.warns(UserWarning, match=r"GrowUntilSaturated: no growth check ran in this fit of 3 epoch\(s\)"):
        cli = GrowtrainCLI(args=tiny_fit_args(tmp_path))
    assert cli.trainer.state.finished
    # the datamodule decided the head and the stem (linked at instantiation)
    assert cli.model.network.fc.out_features == 4 and cli.model.network.stem.in_channels == 3
    checkpoints = {p.name for p in tmp_path.rglob("*.ckpt")}
    assert checkpoints == {"last.ckpt", "best_train.ckpt"}
    assert (tmp_path / "config.yaml").is_file()
    hparams = torch.load(next(tmp_path.rglob("last.ckpt")), weights_only=True)["hyper_parameters"]
    assert hparams["optimizer"]["class_path"] == "torch.optim.SGD"  # the config, as plain data

    (grower,) = [c for c in cli.trainer.callbacks if type(c).__name__ == "GrowUntilSaturated"]
    # as shipped: checks on a validation-loss plateau after a stage anneal, growth judged by its realized gain
    assert (grower.monitor, grower.rule, grower.min_gain, grower.lr_schedule, grower.on_saturated) == (
        "val_loss", "crossfit", 0.01, "anneal", "anneal")  # fmt: skip
    # a plateau needs patience=2 epochs, then the stage anneal: 3 epochs hold no check (the warning above says why)
    assert grower.history == [] and grower.finished is None


# Replaces the quickstart's callbacks: checkpoints as there, and a grower that must grow once
# (paper rule, delta = 0 and a negligible t: grow as soon as any site has a gradient).
FORCED_GROWTH = """
trainer:
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {save_last: true, save_top_k: 0}
    - class_path: growtrain.callbacks.GrowUntilSaturated
      init_args: {monitor: null, rule: paper, t: 1.0e-9, delta: 0.0, max_growths: 1, verbose: false,
                  lr_schedule: continue, min_gain: null, decision: rule}  # (jsonargparse merges these into the quickstart's)
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
    assert cli.trainer.max_epochs == 300 and cli.datamodule.batch_size == 128
    assert cli.datamodule.dataset == "cifar10" and cli.model.network.fc.out_features == 10
    config = cli.model.configure_optimizers()
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    assert optimizer.defaults["lr"] == 0.1 and optimizer.defaults["momentum"] == 0.9
    assert optimizer.defaults["weight_decay"] == 5e-4
    assert dict(scheduler.milestones) == {100: 1, 150: 1} and scheduler.gamma == 0.1
    (stopper,) = [c for c in cli.trainer.callbacks if type(c).__name__ == "TrainLossEarlyStopping"]
    assert (stopper.start_epoch, stopper.patience, abs(stopper.min_delta)) == (180, 30, 1e-4)
    (checkpoint,) = [c for c in cli.trainer.callbacks if type(c).__name__ == "ModelCheckpoint"]
    assert (checkpoint.monitor, checkpoint.save_last, checkpoint.filename) == ("train_loss", True, "best_train")


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
    """A shipped config is one the code does not warn about: its callback builds without a
    warning, and under FSDP2 it names what setup would otherwise switch with a warning (the
    decision, restore_best), with a min_gain its probe can resolve."""
    import warnings

    import yaml

    from growtrain.callbacks import GrowUntilSaturated
    from growtrain.callbacks.guidance import probe_resolution

    args = _callback_args(config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GrowUntilSaturated(**args)
    strategy = ((yaml.safe_load(config.read_text()) or {}).get("trainer") or {}).get("strategy")
    if "ModelParallelStrategy" in str(strategy):
        assert args.get("decision") == "gain" and args.get("restore_best") is False, config
        assert args["min_gain"] > probe_resolution(470, args.get("alpha", 0.05)), config  # its ≈ 470 probe sequences


def test_the_fit_configs_are_found():
    names = {str(p.relative_to(CONFIGS)) for p in _fit_configs()}
    assert {"quickstart.yaml", "gpt.yaml", "hf/tiny_llama_stdlib.yaml", "fmnist/growth.yaml"} <= names, names
