"""An interrupted quickstart resumes into the same decisions, in the same run folder.

The shipped ``configs/quickstart.yaml`` through the CLI, cut to seconds (fewer images, a smaller
batch, patience 1, a one-epoch anneal; the trials keep their fixed sites and hold-out), but with its
own data, probe, plateau trigger, stage anneal and trial decision. One fit runs through; a
second one stops at the end of the epoch of its first growth check (``trainer.should_stop``
from a test callback, as Ctrl-C after a checkpoint would leave it) and is resumed from its
``last.ckpt`` with ``growtrain fit … --ckpt_path``. The resumed fit must make the checks the
uninterrupted one made after that point (epochs, actions, sites, every verdict figure), end on
the same weights, and write on into the same ``version_0/``. Without the random state in the
checkpoint (``growtrain.callbacks.RandomStateCheckpoint``) the resumed epochs see other batches
and the later checks differ. About 45 s per schedule on one thread (a loaded 2-core machine).
"""

from __future__ import annotations

import csv
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
import pytest
import torch

from growtrain.cli import GrowtrainCLI

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"

# The growth callback is the last of the quickstart's callbacks: --trainer.callbacks.X sets its X.
SHRINK = [
    "--trainer.max_epochs=14", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
    "--data.train_subset=400", "--data.probe_size=200", "--data.val_size=200", "--data.batch_size=32",
    "--trainer.callbacks.schedule.patience=1", "--trainer.callbacks.schedule.min_rel_delta=0.02",
    "--trainer.callbacks.schedule.anneal_epochs=1",
    "--trainer.callbacks.verbose=false",
]  # fmt: skip

# What a check decided and every figure it decided on (growth_history.json's fields)
DECISION = ("check", "epoch", "step", "action", "site", "sites", "depth", "saturated", "gamma", "threshold", "lower",
            "margin", "reason", "trial", "fork", "verdicts", "site_scores")  # fmt: skip

# The periodic schedule on the same cut-down quickstart: a check every 2 epochs at the constant rate,
# the first-order rule deciding (the stage fork's resume has its own test below), one final anneal
PERIODIC = ["--trainer.callbacks.schedule=growtrain.Periodic", "--trainer.callbacks.schedule.every_n_epochs=2",
            "--trainer.callbacks.schedule.anneal_epochs=1", "--trainer.callbacks.decision=rule",
            "--trainer.callbacks.lr_schedule=continue"]  # fmt: skip


def _args(root: Path, *extra: str) -> list[str]:
    return ["fit", f"--config={CONFIG}", f"--trainer.default_root_dir={root}", *SHRINK, *extra]


def _grower(trainer):
    (grower,) = [cb for cb in trainer.callbacks if type(cb).__name__ == "GrowUntilSaturated"]
    return grower


def _decisions(history: list[dict]) -> list[dict]:
    return [{key: record.get(key) for key in DECISION} for record in history]


class StopAtEpochEnd(L.Callback):
    """Ends the fit at the end of epoch ``epoch``, after that epoch's checks and its last.ckpt."""

    def __init__(self, epoch: int):
        self.epoch = epoch

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == self.epoch:
            trainer.should_stop = True


def _metrics_epochs(path: Path) -> list[int]:
    with open(path, newline="") as file:
        return sorted({int(float(row["epoch"])) for row in csv.DictReader(file) if row.get("epoch")})


@pytest.mark.parametrize("schedule", [[], PERIODIC], ids=["converged", "periodic"])
def test_a_stopped_and_resumed_quickstart_makes_the_uninterrupted_checks(tmp_path, schedule):
    whole = GrowtrainCLI(args=_args(tmp_path / "whole", *schedule))
    expected = _decisions(_grower(whole.trainer).history)
    # right after the first growth (the checkpoint holds the grown network)
    stop = next(r["epoch"] for r in expected if r["action"] == "grow")
    later = [r for r in expected if r["epoch"] > stop]
    # the cut-down fit must still judge something after the resume point, or the comparison is empty
    assert any(r["action"] != "budget" for r in later), expected

    # the same fit, stopped at the end of epoch `stop` (built as the CLI builds it; run=False to add the stop)
    stopped = GrowtrainCLI(args=_args(tmp_path / "resumed", *schedule)[1:], run=False)  # run=False: no subcommand
    stopped.trainer.callbacks.append(StopAtEpochEnd(stop))
    stopped.trainer.fit(stopped.model, datamodule=stopped.datamodule)
    assert stopped.trainer.current_epoch == stop + 1
    run = Path(stopped.trainer.log_dir)
    last = run / "checkpoints" / "last.ckpt"
    assert last.is_file() and run.name == "version_0"

    resumed = GrowtrainCLI(args=_args(tmp_path / "resumed", *schedule, f"--ckpt_path={last}"))
    got = _decisions(_grower(resumed.trainer).history)
    assert [(r["epoch"], r["action"], r["site"]) for r in got] == [(r["epoch"], r["action"], r["site"]) for r in expected]
    assert got == expected  # every figure, bit for bit (one CPU thread)
    assert resumed.trainer.current_epoch == whole.trainer.current_epoch
    for (name, a), (_, b) in zip(whole.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b) if torch.is_tensor(a) else a == b, name

    # one run folder: the resumed fit wrote on into version_0/, metrics.csv holds every epoch once
    assert Path(resumed.trainer.log_dir) == run
    assert sorted(p.name for p in run.parent.iterdir()) == ["version_0"]
    assert _metrics_epochs(run / "metrics.csv") == list(range(whole.trainer.current_epoch))
    whole_run = Path(whole.trainer.log_dir)
    with open(whole_run / "metrics.csv", newline="") as a, open(run / "metrics.csv", newline="") as b:
        assert len(list(csv.DictReader(a))) == len(list(csv.DictReader(b)))  # no row twice, none lost
    assert (run / "growth_history.json").read_text() == (whole_run / "growth_history.json").read_text()


# decision="stage_fork": the arm opened at a check trains on every batch until the next; the fit is cut in the middle
FORK = ["--trainer.callbacks.schedule=growtrain.Periodic", "--trainer.callbacks.schedule.every_n_epochs=2",
        "--trainer.callbacks.schedule.anneal_epochs=1", "--trainer.callbacks.decision=stage_fork",
        "--trainer.callbacks.lr_schedule=continue"]  # fmt: skip


def test_a_fit_cut_while_a_fork_is_open_resumes_into_the_same_fork_and_decisions(tmp_path):
    """The arm (its weights, its optimizer state, its scoring sums so far) travels in last.ckpt: cut
    one epoch into a fork's two-epoch horizon, the resumed fit judges the same fork with the same
    figures and makes every later check the uninterrupted fit made."""
    whole = GrowtrainCLI(args=_args(tmp_path / "whole", *FORK))
    expected = _decisions(_grower(whole.trainer).history)
    assert expected[0]["action"] == "fork" and any((r.get("fork") or {}).get("gain_frac") is not None
                                                   for r in expected[1:]), expected  # fmt: skip
    stop = expected[0]["epoch"] + 1  # half-way through the first fork
    stopped = GrowtrainCLI(args=_args(tmp_path / "resumed", *FORK)[1:], run=False)
    stopped.trainer.callbacks.append(StopAtEpochEnd(stop))
    stopped.trainer.fit(stopped.model, datamodule=stopped.datamodule)
    last = Path(stopped.trainer.log_dir) / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=False)["callbacks"]  # the fork's arm is in there (checked below by its effect)
    resumed = GrowtrainCLI(args=_args(tmp_path / "resumed", *FORK, f"--ckpt_path={last}"))
    assert _decisions(_grower(resumed.trainer).history) == expected
    for (name, a), (_, b) in zip(whole.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b) if torch.is_tensor(a) else a == b, name


def test_a_fit_cut_while_a_forks_copies_cool_resumes_into_the_same_decisions(tmp_path):
    """The cooled copies (weights, optimizer state, the rates they anneal from, the steps done)
    travel in last.ckpt too: with a check every 40 optimizer steps, the last 5 of a fork's horizon
    cool, and the fit is cut at the epoch end that falls among them."""
    fork = [*FORK[:1], "--trainer.callbacks.schedule.min_steps_between_checks=40", *FORK[2:]]
    whole = GrowtrainCLI(args=_args(tmp_path / "whole", *fork))
    expected = _decisions(_grower(whole.trainer).history)
    per_epoch = whole.trainer.num_training_batches
    judged = next(r for r in expected if (r.get("fork") or {}).get("gain_frac") is not None)
    assert judged["fork"]["cooled"] and judged["fork"]["cool_steps"] == 5
    begin = judged["fork"]["opened"]["step"] + 40 - 5  # the cooled copies were made after this step
    cuts = [e for e in range(whole.trainer.current_epoch) if begin < (e + 1) * per_epoch < begin + 5]
    assert cuts, (begin, per_epoch)  # an epoch end inside the cool-down
    stopped = GrowtrainCLI(args=_args(tmp_path / "resumed", *fork)[1:], run=False)
    # the quickstart's last.ckpt follows its best_train (Lightning saves `last` only when a top-k
    # checkpoint was saved): a checkpoint of every epoch end, to cut exactly there
    every = ModelCheckpoint(dirpath=tmp_path / "cut", filename="cut", monitor=None, save_top_k=1)
    stopped.trainer.callbacks[:0] = [StopAtEpochEnd(cuts[0])]
    stopped.trainer.callbacks.append(every)
    stopped.trainer.fit(stopped.model, datamodule=stopped.datamodule)
    last = tmp_path / "cut" / "cut.ckpt"
    state = torch.load(last, weights_only=False)
    assert state["global_step"] == (cuts[0] + 1) * per_epoch
    saved = next(v for k, v in state["callbacks"].items() if k.startswith("GrowUntilSaturated"))["fork"]
    assert 0 < saved["cool_steps"] < 5 and len(saved["cool"]) == 2  # cut mid-cool
    resumed = GrowtrainCLI(args=_args(tmp_path / "resumed", *fork, f"--ckpt_path={last}"))
    assert _decisions(_grower(resumed.trainer).history) == expected
    for (name, a), (_, b) in zip(whole.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b) if torch.is_tensor(a) else a == b, name
