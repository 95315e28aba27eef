"""The experiment subcommands end to end through GrowtrainCLI (in-process), on a tiny config:
``fit`` (Γ̂ trace next to the logs) → ``measure`` / ``match`` on its grown checkpoint,
``sweep`` marked with its growth history, ``compare``; plus ``--help`` and a typo."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import yaml

from growtrain.cli import GrowtrainCLI

logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

# A width-4 ResNet-8 on 8×8 synthetic images; the growth callback's t is tiny, so its first
# check always grows (max_growths 1). in_channels / num_classes come from the datamodule.
TINY = """
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  max_epochs: 2
  limit_train_batches: 2
  limit_val_batches: 0
  limit_test_batches: 1
  log_every_n_steps: 1  # fewer batches an epoch than Lightning's default interval (50)
  num_sanity_val_steps: 0
  enable_progress_bar: false
  enable_model_summary: false
  default_root_dir: {root}
  callbacks:
    - class_path: growtrain.callbacks.GrowUntilSaturated
      init_args: {{schedule: periodic, t: 1.0e-6, max_growths: 1, on_saturated: continue, verbose: false, decision: rule}}
model:
  class_path: growtrain.module.ImageClassifier
  init_args: {{width: 4}}
data:
  class_path: growtrain.data.ImageDataModule
  init_args: {{dataset: synthetic, image_size: 8, channels: 3, synthetic_size: 160, synthetic_classes: 4,
              probe_size: 32, val_size: 16, batch_size: 16}}
"""


def write_config(folder: Path) -> Path:
    path = folder / "tiny.yaml"
    path.write_text(TINY.format(root=folder / "root"))
    return path


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli")
    config = write_config(folder)
    cli = GrowtrainCLI(args=["fit", "--config", str(config)])
    log_dir = Path(cli.trainer.log_dir)
    (ckpt,) = log_dir.rglob("*.ckpt")
    return config, log_dir, ckpt, cli


def test_fit_with_the_growth_callback_writes_the_gamma_trace(fitted):
    _, log_dir, _, cli = fitted
    assert len(cli.model.network.growth_log) == 1
    history = json.loads((log_dir / "growth_history.json").read_text())
    assert history[0]["action"] == "grow"
    assert (log_dir / "gamma_trace.png").read_bytes()[:4] == b"\x89PNG"


def test_measure_loads_the_grown_checkpoint(fitted, tmp_path):
    config, _, ckpt, cli = fitted
    GrowtrainCLI(args=["measure", "--config", str(config), f"--ckpt_path={ckpt}", f"--output_dir={tmp_path}"])
    saved = json.loads((tmp_path / "measure.json").read_text())
    assert [s["site"] for s in saved["sites"]] == [s.name for s in cli.model.network.sites()]  # grown sites
    assert all(s["projected"] is not None and s["ag_coordinate"] > 0 for s in saved["sites"])
    # the whole config beside the results, unset (None) values included, as Lightning saves its own
    kept = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert "max_time" in kept["trainer"] and kept["trainer"]["max_time"] is None, sorted(kept["trainer"])


def test_match_reports_the_immediate_loss_change(fitted, tmp_path):
    config, _, ckpt, _ = fitted
    GrowtrainCLI(args=[
        "match", "--config", str(config), f"--ckpt_path={ckpt}", "--seeds=[0, 1]", "--steps=10", "--samples=32",
        "--alpha=0.01", f"--output_dir={tmp_path}",
    ])  # fmt: skip
    saved = json.loads((tmp_path / "match.json").read_text())
    assert len(saved["runs"]) == 2 and saved["summary"]["gain_train"] is not None
    assert "Δ_train" in (tmp_path / "match.md").read_text()


def test_sweep_marks_where_growth_stopped(fitted, tmp_path):
    config, log_dir, _, _ = fitted
    GrowtrainCLI(args=[
        "sweep", "--config", str(config), "--depths=0..1", f"--growth_history={log_dir / 'growth_history.json'}",
        f"--output_dir={tmp_path}",
    ])  # fmt: skip
    saved = json.loads((tmp_path / "sweep.json").read_text())
    assert [r["depth"] for r in saved["rows"]] == [0, 1] and saved["stop_depth"] == 1  # 4 blocks = added 1
    assert all(r["ag_max"] > 0 and r["test_loss"] > 0 for r in saved["rows"])
    assert (tmp_path / "sweep.png").stat().st_size > 0


def test_compare_fills_scratch_and_growth_from_real_runs(tmp_path):
    config = write_config(tmp_path)
    out = tmp_path / "compare"
    # the tiny config has no TrainLossEarlyStopping: compare says every arm is capped (asserted,
    # not filtered: the suite keeps growtrain's own warnings visible)
    with pytest.warns(UserWarning, match="no growtrain.callbacks.TrainLossEarlyStopping"):
        GrowtrainCLI(args=["compare", "--config", str(config), "--seeds=[0]", "--compute_matched=false",
                           f"--output_dir={out}"])  # fmt: skip
    saved = json.loads((out / "compare.json").read_text())
    (row,) = saved["summary"]
    for metric in ("train_loss", "test_loss", "test_acc"):
        assert row[f"scratch_{metric}"] is not None and row[f"growth_{metric}"] is not None
    runs = {r["arm"]: r for r in saved["runs"]}
    assert runs["growth"]["growth_log"] and runs["scratch"]["arch"] == runs["growth"]["arch"]
    lines = (out / "compare.md").read_text().splitlines()
    assert "Train loss Scratch" in lines[2] and "—" not in lines[4]  # every cell of the row filled
    assert (out / "runs.jsonl").read_text().count("\n") == 2


@pytest.mark.parametrize("subcommand", ["compare", "measure", "sweep", "match"])
def test_help(subcommand, capsys):
    with pytest.raises(SystemExit) as done:
        GrowtrainCLI(args=[subcommand, "--help"])
    assert done.value.code == 0
    assert "--output_dir" in capsys.readouterr().out


def test_typo_is_a_parser_error(tmp_path, capsys):
    config = write_config(tmp_path)
    with pytest.raises(SystemExit) as error:
        GrowtrainCLI(args=["fit", "--config", str(config), "--trainer.max_epochs=1", "--data.dataset=synthetic", "--oops=1"])
    assert error.value.code != 0
    err = capsys.readouterr().err
    assert "oops" in err and "error" in err.lower()


TINY_GPT = """
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  max_epochs: 1
  limit_train_batches: 2
  limit_val_batches: 1
  limit_test_batches: 1
  log_every_n_steps: 1  # fewer batches an epoch than Lightning's default interval (50)
  num_sanity_val_steps: 0
  enable_progress_bar: false
  enable_model_summary: false
  default_root_dir: {root}
model:
  class_path: growtrain.lm.LanguageModel
  init_args: {{n_layer: 1, d_model: 16, n_head: 2, block_size: 8, vocab_size: 256}}
data:
  class_path: growtrain.data.TextDataModule
  init_args: {{path: {corpus}, tokenizer: byte, block_size: 8, batch_size: 4, probe_fraction: 0.2,
              val_fraction: 0.1, test_fraction: 0.1}}
"""


def test_sweep_runs_on_a_language_model_config(tmp_path):
    # The CLI links the datamodule's num_classes/in_channels into every model; a LanguageModel
    # has neither, and rebuilding it at another depth must not pass them on.
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 200)
    config = tmp_path / "gpt.yaml"
    config.write_text(TINY_GPT.format(root=tmp_path / "root", corpus=corpus))
    GrowtrainCLI(args=["sweep", "--config", str(config), "--depths=1..2", f"--output_dir={tmp_path / 'out'}"])
    saved = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert [r["depth"] for r in saved["rows"]] == [1, 2] and all(r["ag_max"] > 0 for r in saved["rows"])


def test_measure_reports_checkpoint_arguments_that_override_the_config(fitted, tmp_path):
    """The checkpoint is width 4; a config asking for width 8 is overridden, and that is said."""
    config, _, ckpt, _ = fitted
    with pytest.warns(UserWarning, match=r"ckpt_path: .* differ from the config's model section \(width: config 8, "
                      r"checkpoint 4\); the model is built with the checkpoint's"):  # fmt: skip
        cli = GrowtrainCLI(args=["measure", "--config", str(config), f"--ckpt_path={ckpt}", "--model.width=8",
                                 f"--output_dir={tmp_path}"])  # fmt: skip
    assert cli.model.hparams.width == 4


def test_measure_refuses_another_split_than_the_checkpoints_before_writing(fitted, tmp_path, capsys):
    """The fit trained on the split of seed 0; measure with --data.init_args.seed=7 is one error line
    naming the argument, the expected and given values and the fix, and no measure folder is made;
    --allow_other_split=true measures, warns, and the saved report says which split differed."""
    from growtrain.cli import main

    config, _, ckpt, _ = fitted
    root = tmp_path / "root"
    args = ["measure", "--config", str(config), f"--ckpt_path={ckpt}", f"--trainer.default_root_dir={root}",
            "--data.init_args.seed=7"]  # fmt: skip
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: data.init_args.seed: expected seed=0, the split {str(ckpt)!r} was trained with; "
                          "got seed=7: the probe is carved out of the training images by that split")  # fmt: skip
    assert "Fix: pass --data.init_args.seed=0 (in Python: the datamodule with seed=0); or allow_other_split=True " \
           "(--allow_other_split=true)" in err and err.count("\n") == 1  # fmt: skip
    assert not (root / "measure").exists()
    warned = r"allow_other_split: measuring .* trained with seed=0, on the split seed=7"
    with pytest.warns(UserWarning, match=warned) as w:
        GrowtrainCLI(args=args + ["--allow_other_split=true"])
    assert sum(str(x.message).startswith("allow_other_split:") for x in w) == 1  # once, not once per look at the split
    saved = json.loads((root / "measure" / "measure.json").read_text())
    assert saved["split"]["differs"] == ["seed"] and "not held-out" in (root / "measure" / "measure.md").read_text()
    # the fit's last check, read from the checkpoint, grew: said; the configured callback (seed 0) drew check 0's
    # candidates with seed 0·1000 + 0, measure's own default: not a reason
    assert saved["last_check"]["check"] == 0 and saved["last_check"]["action"] == "grow"
    assert any(r.startswith("that check then grew the network at") for r in saved["differences"])
    assert not any(r.startswith("candidate blocks") for r in saved["differences"]), saved["differences"]


def test_measure_of_a_truncated_checkpoint_names_the_file(fitted, tmp_path):
    config, _, ckpt, _ = fitted
    bad = tmp_path / "cut.ckpt"
    bad.write_bytes(ckpt.read_bytes()[:3000])
    with pytest.raises(ValueError, match=r"ckpt_path: '.*cut\.ckpt' \(3000 bytes\) is not a complete checkpoint"):
        GrowtrainCLI(args=["measure", "--config", str(config), f"--ckpt_path={bad}", f"--output_dir={tmp_path}"])


def test_measure_never_overwrites_an_earlier_result_and_says_where_it_wrote(fitted, tmp_path, capsys):
    config, _, ckpt, _ = fitted
    root = tmp_path / "root"
    args = ["measure", "--config", str(config), f"--ckpt_path={ckpt}", f"--trainer.default_root_dir={root}"]
    GrowtrainCLI(args=args)
    first = (root / "measure" / "measure.json").read_text()
    GrowtrainCLI(args=args)
    assert (root / "measure" / "measure.json").read_text() == first  # untouched
    assert (root / "measure_1" / "measure.json").is_file()
    out = capsys.readouterr().out
    assert f"measure: results in {root / 'measure'}/ (config.yaml, measure.json, measure.md)" in out
    assert f"measure: results in {root / 'measure_1'}/" in out
    with pytest.raises(FileExistsError, match=r"output_dir: '.*measure' already holds measure.json from an earlier "
                       r"measure, and growtrain never overwrites a result\. Fix: pass another --output_dir"):  # fmt: skip
        GrowtrainCLI(args=args + [f"--output_dir={root / 'measure'}"])


def _wrote(name, out) -> None:
    """GrowTrainer._wrote for experiment ``name`` and folder ``out``, as rank 0 (read with capsys)."""
    from types import SimpleNamespace

    from growtrain.trainer import GrowTrainer

    GrowTrainer._wrote(SimpleNamespace(is_global_zero=True), name, out)


def test_an_experiment_says_where_each_trainings_checkpoints_are(tmp_path, capsys):
    """`stopping` and the other experiments keep one folder per training (its checkpoints/ and
    metrics.csv) under the output folder: the closing lines name them, not only the files."""
    out = tmp_path / "stopping"
    for run in ("growth_abc_seed0", "scratch_added0_seed0", "scratch_added1_seed0"):
        (out / run / "checkpoints").mkdir(parents=True)
    (out / "plots").mkdir()  # a folder without checkpoints/ is not a training's
    (out / "runs.jsonl").write_text("")
    _wrote("stopping", out)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"stopping: results in {out}/ (runs.jsonl)"
    assert lines[1] == (f"stopping: each training's checkpoints/ and metrics.csv in its folder under {out}/: "
                        "growth_abc_seed0, scratch_added0_seed0, scratch_added1_seed0")  # fmt: skip


@pytest.mark.parametrize("count", [12, 13])
def test_the_trainings_line_names_at_most_twelve_folders(tmp_path, capsys, count):
    """A sweep of many trainings: up to 12 folders are named; beyond that the first 12 and the count."""
    out = tmp_path / "sweep"
    names = [f"scratch_added{i:02d}_seed0" for i in range(count)]
    for run in names:
        (out / run / "checkpoints").mkdir(parents=True)
    _wrote("sweep", out)
    line = capsys.readouterr().out.splitlines()[1]
    shown = ", ".join(names[:12]) + (", … (13 in all)" if count == 13 else "")
    assert line == f"sweep: each training's checkpoints/ and metrics.csv in its folder under {out}/: {shown}"
