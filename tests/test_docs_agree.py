"""README.md and docs/ agree with the configs and the code on the numbers that drift:
the quickstart's splits, epochs and measured times, ImageDataModule's default splits, the growth
callback's defaults, the rule ``measure`` uses, and the list of subcommands. Each expected phrase
is built from its source (the YAML config, a signature, docs/results.md's measurement), so a
change on one side fails here until the other side follows."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from growtrain import GrowUntilSaturated, Trial
from growtrain.data import ImageDataModule
from growtrain.decision import DEFAULT_MIN_GAIN, DEFAULT_RULE
from growtrain.experiments.measure import run_measure
from growtrain.trainer import EXPERIMENTS

ROOT = Path(__file__).resolve().parents[1]


def text(name: str) -> str:
    """A document with its whitespace collapsed, so line breaks do not matter."""
    return " ".join((ROOT / name).read_text().split())


def embedded_train_size() -> int:
    with np.load(ROOT / "growtrain" / "data" / "fashion_mnist_mini.npz") as data:
        return int(data["y_train"].shape[0])


QUICKSTART = yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())


def quickstart_numbers() -> dict:
    data = QUICKSTART["data"]["init_args"]
    grow = next(c["init_args"] for c in QUICKSTART["trainer"]["callbacks"] if c["class_path"].endswith("GrowUntilSaturated"))
    return {"train": embedded_train_size() - data["probe_size"] - data["val_size"], "probe": data["probe_size"],
            "val": data["val_size"], "subset": data["train_subset"], "epochs": QUICKSTART["trainer"]["max_epochs"],
            "anneal": grow["schedule"]["init_args"]["anneal_epochs"],
            "min_gain": grow["decision"]["init_args"]["min_gain"]}  # fmt: skip


def test_quickstart_splits_and_epochs_agree_with_its_config():
    q = quickstart_numbers()
    readme = text("README.md")
    assert (f"{q['train']} training images after the split, of which it trains on {q['subset']}, plus {q['probe']} "
            f"probe and {q['val']} validation images") in readme  # fmt: skip
    assert f"({q['train']} train, {q['probe']} probe, {q['val']} val), trains on {q['subset']} of them" in readme
    assert f"a {q['anneal']}-epoch anneal" in readme and f"(cap {q['epochs']} epochs)" in readme
    assert f"`min_gain` {100 * q['min_gain']:g} %" in readme
    results = text("docs/results.md")
    assert (f"({q['train']} train images of which it trains on {q['subset']}, {q['probe']} probe, {q['val']} val; "
            f"`lr_schedule: anneal` with {q['anneal']}-epoch anneals") in results  # fmt: skip

def test_the_python_quickstart_is_the_config():
    """README's Python example is configs/quickstart.yaml, value for value; docs/callback.md links
    to it instead of keeping a second copy."""
    data = QUICKSTART["data"]["init_args"]
    model = QUICKSTART["model"]["init_args"]
    sgd = model["optimizer"]["init_args"]
    grow = next(c["init_args"] for c in QUICKSTART["trainer"]["callbacks"] if c["class_path"].endswith("GrowUntilSaturated"))
    when, what = grow["schedule"], grow["decision"]
    assert (when["class_path"], what["class_path"]) == ("growtrain.Converged", "growtrain.Trial")
    stage, trial = when["init_args"], what["init_args"]
    phrases = [
        f"L.seed_everything({QUICKSTART['seed_everything']})",
        f"ImageDataModule(probe_size={data['probe_size']}, val_size={data['val_size']}, train_subset="
        f"{data['train_subset']}, augment={data['augment']})",
        f"ImageClassifier(in_channels=1, width={model['width']}, optimizer=lambda params: torch.optim.SGD(params, "
        f"lr={sgd['lr']}, momentum={sgd['momentum']}, weight_decay={sgd['weight_decay']:.0e}))".replace("e-0", "e-"),
        f'GrowUntilSaturated(schedule=Converged(monitor="{stage["monitor"]}", patience={stage["patience"]}, '
        f'min_rel_delta={stage["min_rel_delta"]}, anneal_epochs={stage["anneal_epochs"]}), '
        f'lr_schedule="{grow["lr_schedule"]}", max_growths={grow["max_growths"]}, on_saturated="{grow["on_saturated"]}")',
        f"L.Trainer(max_epochs={QUICKSTART['trainer']['max_epochs']}, callbacks=[grow, GammaTracePlot()])",
    ]  # fmt: skip
    assert model["blocks"] == [1, 1, 1] and model["family"] == "basic"  # ImageClassifier's defaults
    assert sgd["lr"] and QUICKSTART["model"]["init_args"]["optimizer"]["class_path"] == "torch.optim.SGD"
    assert set(grow) == {"schedule", "lr_schedule", "rule", "alpha", "max_growths", "on_saturated", "decision"}
    assert set(stage) == {"monitor", "patience", "min_rel_delta", "min_stage_epochs", "anneal_epochs"}
    assert (stage["min_stage_epochs"], grow["rule"], trial, grow["alpha"]) == (2, "crossfit", {"min_gain": 0.01}, 0.05)
    assert GrowUntilSaturated(schedule="converged").decision == Trial(**trial)  # the shipped config states the default
    page = text("README.md").replace("( ", "(")
    for phrase in phrases:
        assert phrase in page, phrase
    assert "](../README.md#python)" in text("docs/callback.md")  # the link that replaces a second copy


def test_no_page_gives_the_quickstart_other_splits():
    """A paragraph that names the quickstart config and a probe size names the config's size."""
    q = quickstart_numbers()
    for name in ("README.md", *(f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md")))):
        blocks = (ROOT / name).read_text().split("\n\n")
        units = [u for b in blocks for u in (b.splitlines() if b.lstrip().startswith("|") else [b])]  # a table row alone
        for paragraph in units:
            if "configs/quickstart.yaml" not in paragraph or "earlier quickstart" in paragraph:
                continue
            flat = " ".join(paragraph.split())
            for found in re.findall(r"\bprobe (\d[\d,]*)\b|(\d[\d,]*) probe\b", flat):
                value = int((found[0] or found[1]).replace(",", ""))
                assert value == q["probe"], f"{name}: {flat[:200]}"


def test_imagedatamodule_default_splits_agree_with_its_signature():
    params = inspect.signature(ImageDataModule).parameters
    probe, val = params["probe_size"].default, params["val_size"].default
    train = embedded_train_size() - probe - val
    assert f"by default {train} train, {probe} probe, {val} val" in text("README.md")
    assert f"fashion-mnist-mini with {train:,} train, {probe:,} probe and {val:,} val images" in text("docs/callback.md")


def test_measured_quickstart_times_agree_with_docs_results():
    """One source for the quickstart's figures: docs/results.md's timing table; the README's
    ranges per thread count and the cost section of docs/callback.md repeat them exactly."""
    results = (ROOT / "docs" / "results.md").read_text()  # its lines: the table's rows
    section = results[results.index("### The quickstart"):results.index("## The test suite")]
    walls: dict[int, list[int]] = {}
    for threads, wall in re.findall(r"^\| [^|]+ \| (\d) \| \*\*(\d+) s\*\* \|", section, flags=re.M):
        walls.setdefault(int(threads), []).append(int(wall))
    assert sorted(walls) == [1, 2] and all(len(v) == 2 for v in walls.values())  # two splits per thread count
    two, one = sorted(walls[2]), sorted(walls[1])
    readme = text("README.md").replace("\n  ", " ")
    assert (f"the quickstart {two[0]}–{two[1]} s with torch's default two threads and {one[0]}–{one[1]} s "
            "with one thread") in readme  # fmt: skip
    probe, fit = re.search(r"(\d+) s of (\d+) s\)", section.replace("\n  ", " ")).groups()
    assert f"{probe} s of {fit} s" in text("docs/callback.md").replace("\n", " ")


def _documented_defaults() -> dict[str, str]:
    """docs/callback.md's Arguments table: argument name → the default as written."""
    rows = {}
    for line in (ROOT / "docs" / "callback.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        names = re.findall(r"`([a-z_]+)`", cells[0])
        defaults = re.findall(r"`([^`]+)`", cells[1])
        if len(defaults) == 1 and len(names) > 1:
            defaults *= len(names)
        if names and len(names) == len(defaults):
            rows.update(zip(names, defaults))
    return rows


def _arguments_rows(page: str) -> list[list[str]]:
    """The rows of the first table under docs/callback.md's "## Arguments" heading, one list of
    cells each (header and rule line skipped)."""
    start = page.index("\n## Arguments\n")
    end = page.find("\n## ", start + 1)
    table: list[str] = []
    for line in page[start:end if end > 0 else None].splitlines():
        if line.startswith("|"):
            table.append(line)
        elif table:
            break
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in table[2:]]


def test_every_option_has_one_row_that_says_why():
    """One row per option of GrowthConfig in docs/callback.md's Arguments table (and no row for
    anything else), saying what it does and why it is kept."""
    from growtrain.callbacks.growth_config import GrowthConfig

    page = (ROOT / "docs" / "callback.md").read_text()
    rows = _arguments_rows(page)
    named = [name for row in rows for name in re.findall(r"`([a-z_]+)`", row[0])]
    options = GrowthConfig.names()
    assert sorted(named) == sorted(options), f"rows without an option or options without a row: {set(named) ^ set(options)}"
    assert len(named) == len(set(named)), "an option has two rows"
    short = [row[0] for row in rows if len(row) != 4 or any(len(cell) < 3 for cell in row)]
    assert not short, f"rows without a default, what it does, or why it is kept: {short}"


def _as_written(value) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


def test_callback_defaults_in_docs_agree_with_the_signature():
    documented = _documented_defaults()
    params = dict(inspect.signature(GrowUntilSaturated).parameters)
    assert set(documented) == set(params), set(documented) ^ set(params)
    for name, param in params.items():
        assert documented[name] == _as_written(param.default), (name, documented[name], param.default)
    readme = text("README.md")
    assert f"`min_gain` (default {100 * DEFAULT_MIN_GAIN:g} %)" in readme
    assert f"`alpha` (default {params['alpha'].default:g})" in readme


def test_every_field_of_the_callbacks_parts_has_a_row_with_its_default():
    """docs/callback.md's tables of the parts (``Converged``, ``Periodic``, ``Trial``, ``StageFork``): one
    row per field, named ``Part.field``, with the field's default as written."""
    from dataclasses import fields

    from growtrain import Converged, Periodic, StageFork, Trial

    rows: dict[str, str] = {}
    for line in (ROOT / "docs" / "callback.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4:
            continue
        names = re.findall(r"`([A-Z][A-Za-z]+\.[a-z_]+)`", cells[0])
        if not names:
            continue
        defaults = re.findall(r"`([^`]+)`", cells[1])
        if len(defaults) == 1 and len(names) > 1:
            defaults *= len(names)
        assert len(names) == len(defaults), line[:120]
        for name, default in zip(names, defaults):
            assert name not in rows, f"{name} has two rows"
            rows[name] = default
    expected = {f"{part.__name__}.{f.name}": _as_written(f.default)
                for part in (Converged, Periodic, Trial, StageFork) for f in fields(part)}  # fmt: skip
    assert rows == expected


def test_measures_documented_rule_is_the_code_default():
    doc = " ".join(run_measure.__doc__.split())
    assert f'``rule=None`` resolves as in ``GrowUntilSaturated``: ``"{DEFAULT_RULE}"``' in doc


def test_readme_lists_every_subcommand():
    commands = re.search(r"### Commands(.*?)\n## ", (ROOT / "README.md").read_text(), re.S).group(1)
    listed = {n for group in re.findall(r"`growtrain ([a-z\\|]+)", commands) for n in group.replace("\\", "").split("|")}
    assert listed == {"fit", "validate", "test", "predict", *EXPERIMENTS}, listed


def test_the_readmes_python_example_runs(tmp_path, monkeypatch):
    """The example itself, cut to one short epoch (its API calls are real: a typo fails here)."""
    code = re.search(r"```python\n(import lightning as L\nimport torch\n.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    short = code.replace("L.Trainer(max_epochs=60,", f"L.Trainer(max_epochs=1, limit_train_batches=2, limit_val_batches=1, "
                         f"enable_progress_bar=False, logger=False, default_root_dir={str(tmp_path)!r},")  # fmt: skip
    assert short != code
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    # one epoch: all of it the reserved final anneal's, and the callback says so
    with pytest.warns(UserWarning, match="max_epochs=1 leaves no epoch to grow in"):
        exec(compile(short, "README.md", "exec"), scope)
    assert scope["trainer"].state.finished and [h["action"] for h in scope["grow"].history] == ["budget"]


def test_the_readmes_python_example_as_a_plain_script_prints_no_upstream_noise(tmp_path):
    """The example run as a plain script (a fresh interpreter, Python's default warning filters, Lightning's
    default logger and checkpointing, no growtrain CLI or trainer): no Lightning "💡 Tip" advert and no LeafSpec
    FutureWarning (growtrain.quiet, installed by importing growtrain's callbacks or module), while growtrain's own
    warning still shows."""
    import os
    import subprocess
    import sys

    code = re.search(r"```python\n(import lightning as L\nimport torch\n.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    short = code.replace("L.Trainer(max_epochs=60,", f"L.Trainer(max_epochs=1, limit_train_batches=2, limit_val_batches=1, "
                         f"enable_progress_bar=False, default_root_dir={str(tmp_path / 'run')!r},")  # fmt: skip
    assert short != code
    (tmp_path / "example.py").write_text(short + '\nprint("finished:", trainer.state.finished)\n')
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "PYTHONDEVMODE")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode == 0 and "finished: True" in out, out[-3000:]
    assert "💡 Tip" not in out and "LeafSpec" not in out and "tensorboardX" not in out, out
    assert "UserWarning: GrowUntilSaturated: max_epochs=1 leaves no epoch to grow in" in out  # growtrain's own: kept
    assert (tmp_path / "run" / "lightning_logs" / "version_0" / "metrics.csv").is_file()  # the default logger ran


def test_the_custom_module_example_is_a_complete_file_that_grows(tmp_path, monkeypatch):
    """docs/callback.md's "Your own LightningModule" example, blocks defined, run as written but
    cut to its first check (epoch 17 at this seed: the monitor plateaus, then the default
    lr_schedule anneals the stage for anneal_epochs=10): a typo, a missing name or a block the
    callback refuses fails here, and the check must grow the trunk by one block."""
    page = (ROOT / "docs" / "callback.md").read_text()
    section = page[page.index("## Your own LightningModule"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "class Block(nn.Module)" in code and "return x + self.fc2(" in code  # the block carries its skip
    # a plain module: no growtrain base class, a plain optimizer over all its parameters
    assert "GrowableModuleMixin" not in code and "class MyModule(L.LightningModule)" in code
    assert "AdamW(self.parameters()" in code
    short = code.replace("L.Trainer(max_epochs=40, callbacks=[grow])",
                         "L.Trainer(max_epochs=18, callbacks=[grow], logger=False, enable_progress_bar=False, "
                         f"enable_model_summary=False, enable_checkpointing=False, default_root_dir={str(tmp_path)!r})")  # fmt: skip
    assert short != code
    monkeypatch.chdir(tmp_path)
    scope: dict = {"__name__": "callback_md_example"}
    exec(compile(short, "docs/callback.md", "exec"), scope)
    assert [h["action"] for h in scope["grow"].history] == ["grow"]
    assert scope["trainer"].lightning_module.trunk.depth() == 2


def test_the_certificate_example_runs_as_written():
    """README's "The certificate, without Lightning" as written: the embedded data, an untrained
    network, one probe pass, and the scored block inserted when the report says grow."""
    page = (ROOT / "README.md").read_text()
    section = page[page.index("## The certificate, without Lightning"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope: dict = {"print": lambda *args: None}
    exec(compile(code, "README.md", "exec"), scope)
    report, net = scope["report"], scope["net"]
    assert report.gamma > 0 and (report.saturated or report.record(report.best_site) is not None)
    assert net.depth() == 3 + (not report.saturated)  # ResNet-8's three blocks, plus the scored one if it said grow


def _python_snippets() -> list[tuple[str, str]]:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [(f"{p.relative_to(ROOT)}#{i}", code) for p in docs
            for i, code in enumerate(re.findall(r"```python\n(.*?)```", p.read_text(), re.S))]  # fmt: skip


@pytest.mark.parametrize("name, code", _python_snippets(), ids=[n for n, _ in _python_snippets()])
def test_every_python_snippet_compiles_and_its_growtrain_imports_resolve(name, code):
    """The snippets no test can run here (FSDP2 on a GPU node, a downloaded Hugging Face model)
    are still real code: they compile, and every name they import from growtrain exists."""
    import importlib

    compile(code, name, "exec")
    for module, names in re.findall(r"^from (growtrain[\w.]*) import ([\w, ]+)$", code, re.M):
        imported = importlib.import_module(module)
        missing = [n.strip() for n in names.split(",") if not hasattr(imported, n.strip())]
        assert not missing, (name, module, missing)


def test_the_defaults_full_data_table_is_its_raw_rows():
    """One source for the default's full-data rows: docs/results.md's table lists exactly the rows
    in docs/results/default_full/ (NAME.json, written by experiments/default_rows.py), each with
    that row's depth and test loss, and the README's count of them is the number of files."""
    import json

    raw = {p.stem: json.loads(p.read_text()) for p in (ROOT / "docs" / "results" / "default_full").glob("*.json")}
    results = (ROOT / "docs" / "results.md").read_text()
    start = results.index("### The default as it ships, on the full data")
    section = results[start:results.index("\n### ", start + 1)]
    table = {line.split("|")[1].strip(): line for line in section.splitlines() if re.match(r"^\| [a-z0-9]+ \| ", line) and not line.startswith("| row |")}
    assert set(table) == set(raw) and len(raw) >= 10
    for name, row in raw.items():
        assert f"| {row['blocks']} | {row['test_loss']:.4f} |" in table[name], name
    depths = sorted({row["blocks"] for row in raw.values()})
    if depths == [3]:  # the README's results table's claim, while it is true
        assert f"stops at 3 blocks in all {len(raw)} full-data rows" in text("README.md")
        # the handed-over test loss beside it: the mean of the seed rows s0-s2, recomputed from the raw rows
        mean = sum(raw[f"s{seed}"]["test_loss"] for seed in range(3)) / 3
        assert f"handed-over test loss {mean:.4f}" in text("README.md")


def test_the_insertion_table_is_its_raw_rows():
    """docs/results.md's table of the budget decision's insertions is what experiments/lm_insertion_results.py
    prints from the committed rows (one source for those figures)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("lm_insertion_results", ROOT / "experiments" / "lm_insertion_results.py")
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)
    found = study.rows()
    assert {r["insertion"] for r in found} == {"copy", "copy_zero", "copy_ramp"}
    assert study.table(found) in (ROOT / "docs" / "results.md").read_text()
