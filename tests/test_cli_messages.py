"""What the command line says: `growtrain --help` describes growtrain and lists every
subcommand, the growth callback's arguments are discoverable, and growtrain's own validation
errors are the first and clearest line (no usage dump, no union-type dump, the YAML file named)."""

from __future__ import annotations

import os
from pathlib import Path

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
    from growtrain.callbacks import Converged, GrowUntilSaturated
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
    assert grow.schedule == Converged(monitor="val_loss") and cli.trainer.max_epochs == 60
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
    assert "--trainer.callbacks.schedule" in out and "--trainer.callbacks.decision" in out


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


# -- options removed from GrowUntilSaturated before 0.1.0: no shim, the parser's own error, before anything runs --
def _refused(args, capsys) -> str:
    """``main(args)`` exits with status 2 (jsonargparse's parse error, as for any unknown key); its stderr."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main(args)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("flag", ["--trainer.callbacks.init_args.projected=true", "--trainer.callbacks.projected=true"])
def test_a_former_option_on_the_command_line_is_the_parsers_error_naming_it(tmp_path, capsys, flag):
    run = tmp_path / "run"
    err = _refused(tiny_fit_args(run, flag), capsys)
    assert "'projected'" in err and "GrowUntilSaturated" in err, err
    assert not run.exists()  # refused before any training or output folder


def test_a_former_option_in_a_config_file_is_the_parsers_error_before_any_output(tmp_path, capsys):
    """restore_best under the callback's init_args in a --config YAML: the parser names it; nothing is
    trained or written."""
    run = tmp_path / "run"
    (tmp_path / "old.yaml").write_text(
        "trainer:\n  callbacks:\n"
        "    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n      init_args: {save_last: true}\n"
        "    - class_path: growtrain.callbacks.GrowUntilSaturated\n"
        "      init_args: {schedule: periodic, restore_best: false}\n"
    )  # fmt: skip
    err = _refused(tiny_fit_args(run, f"--config={tmp_path / 'old.yaml'}"), capsys)
    assert "'restore_best'" in err and "GrowUntilSaturated" in err, err
    assert not run.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["old.yaml"]


CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
CONFIGS = sorted(CONFIG_DIR.rglob("*.yaml"))


def test_the_shipped_configs_are_found():
    assert any(p.name == "quickstart.yaml" for p in CONFIGS) and len(CONFIGS) > 5, CONFIGS


def _growth_init_args(node):
    """Every ``init_args`` of a ``GrowUntilSaturated`` anywhere in a parsed YAML document."""
    if isinstance(node, dict):
        if str(node.get("class_path", "")).endswith("GrowUntilSaturated"):
            yield node.get("init_args") or {}
        for value in node.values():
            yield from _growth_init_args(value)
    elif isinstance(node, list):
        for value in node:
            yield from _growth_init_args(value)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: str(p.relative_to(CONFIG_DIR)))
def test_no_shipped_config_gives_the_growth_callback_an_option_it_does_not_have(config):
    """``growtrain fit`` and the experiments would refuse it: every option a shipped config gives
    GrowUntilSaturated is one of its current options."""
    import yaml

    from growtrain.callbacks.growth_config import GrowthConfig

    given = {k for args in _growth_init_args(yaml.safe_load(config.read_text())) for k in args}
    assert given - set(GrowthConfig.names()) == set()


def test_the_shipped_configs_give_the_growth_callback_options():
    import yaml  # the check above is not vacuous: most shipped configs grow

    assert sum(1 for p in CONFIGS for _ in _growth_init_args(yaml.safe_load(p.read_text()))) >= 8
