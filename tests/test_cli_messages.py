"""What the command line says: `growtrain --help` describes growtrain and lists every
subcommand, the growth callback's arguments are discoverable, and growtrain's own validation
errors are the first and clearest line (no usage dump, no union-type dump, the YAML file named)."""

from __future__ import annotations

import os

import pytest

from growtrain.cli import GrowtrainCLI, main
from growtrain.trainer import EXPERIMENTS
from tests.test_cli_fit import tiny_fit_args


def test_top_level_help_describes_growtrain_and_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    raw = capsys.readouterr().out
    out = " ".join(raw.split())
    assert "growtrain: train a residual network" in out and "Lightning Trainer command line tool" not in out
    listed = {line.split()[0] for line in raw.splitlines() if line.startswith("    ") and line.split()}
    assert {"fit", "validate", "test", "predict", *EXPERIMENTS} <= listed, listed
    assert all(name in out.split("Subcommands:")[1] for name in EXPERIMENTS)  # the description names them too


def test_the_first_command_in_the_help_works_without_a_checkout(tmp_path, monkeypatch, capsys, recwarn):
    """configs/quickstart.yaml exists only in a checkout: the help says so, and the command it
    gives for anywhere else parses and builds a growing run from a directory with no configs,
    seeded with 0 without Lightning's "No seed found" warning (it has no seed_everything line)."""
    from growtrain.callbacks import GrowUntilSaturated
    from growtrain.cli import START_ANYWHERE

    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "in a checkout of the repository" in out and START_ANYWHERE in out
    command = START_ANYWHERE.split()
    assert command[:2] == ["growtrain", "fit"]
    monkeypatch.chdir(tmp_path)
    cli = GrowtrainCLI(args=[*command[2:], "--trainer.logger=false"], run=False)
    (grow,) = [c for c in cli.trainer.callbacks if isinstance(c, GrowUntilSaturated)]
    assert grow.monitor == "val_loss" and cli.trainer.max_epochs == 60
    assert cli.trainer.default_root_dir == "runs/first" and list(tmp_path.iterdir()) == []  # nothing written yet
    assert cli.config.seed_everything == 0 and os.environ.get("PL_GLOBAL_SEED") == "0"
    assert not [w for w in recwarn if "No seed found" in str(w.message)]


def test_fit_help_says_how_to_list_the_growth_callbacks_arguments(capsys):
    with pytest.raises(SystemExit) as done:
        main(["fit", "--help"])
    assert done.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "growtrain fit --trainer.callbacks.help growtrain.callbacks.GrowUntilSaturated" in out
    with pytest.raises(SystemExit) as done:  # ... and that command works
        main(["fit", "--trainer.callbacks.help", "growtrain.callbacks.GrowUntilSaturated"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "--trainer.callbacks.min_gain" in out and "--trainer.callbacks.monitor" in out


def test_a_models_validation_error_is_the_first_line(tmp_path, capsys):
    args = tiny_fit_args(tmp_path, "--model.width=-1")
    with pytest.raises(ValueError, match=r"^width: expected a positive integer, got -1$") as info:
        GrowtrainCLI(args=args)
    assert info.value.__suppress_context__  # not chained to jsonargparse's union dump
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main(args)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "error: width: expected a positive integer, got -1\n" in err
    assert "Union" not in err and "Traceback" not in err


def test_a_yaml_error_names_its_file_and_comes_first(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  max_epochs: [1\n")
    with pytest.raises(SystemExit) as done:
        main(["fit", f"--config={bad}"])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: Problems parsing config") and repr(str(bad)) in err
    assert "<unicode string>" not in err and "usage:" not in err
