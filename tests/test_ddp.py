"""GrowUntilSaturated under strategy="ddp": 2 CPU processes (gloo), launched as subprocesses.

Lightning's ``ddp`` launcher re-runs ``sys.argv`` for the other rank, so the fit lives in
``tests/ddp_script.py``. One launch runs two fits in the same two processes:

* the comparison run (``--same-buffers``: rank 0's BatchNorm statistics on both ranks before
  the first check, see the script): both ranks record identical checks; the first check is
  redone in this single process on rank 0's pre-check weights, with the probe batches the two
  ranks saw (each rank's half A first, then each rank's half B, which is how the cross-fit
  split and the BatchNorm calibration pool the ranks), and the probe sums (‖ĝ_l‖, σ̂²_l,
  lower bounds, n), the decision and the inserted block's weights must agree to float
  tolerance; parameters are identical across ranks after training on;
* the negative control (``--no-rewrap``): without rebuilding the DDP wrapper after a growth the
  new block's gradients are never all-reduced, and the ranks' parameters drift apart.

The subprocesses get a clean environment: no inherited MASTER_PORT, RANK, LOCAL_RANK, SLURM_*,
TORCHELASTIC_* etc. (Lightning would otherwise join a cluster the test runner happens to sit in).
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, Subset

from growtrain.data import ImageDataModule
from growtrain.module import ImageClassifier
from growtrain.saturation import measure_saturation

ROOT = Path(__file__).resolve().parents[1]
_CLUSTER_NAMES = {"MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "RANK", "WORLD_SIZE", "GROUP_RANK",
                  "LOCAL_WORLD_SIZE", "GLOBAL_RANK"}  # fmt: skip
_CLUSTER_PREFIXES = ("SLURM_", "TORCHELASTIC_", "PL_", "OMPI_", "PMI_", "LSB_", "JSM_")


def clean_env(env: dict, port: int) -> dict:
    """``env`` without any distributed-launch variable, with our own rendezvous port."""
    out = {k: v for k, v in env.items() if k not in _CLUSTER_NAMES and not k.startswith(_CLUSTER_PREFIXES)}
    out["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    out["MASTER_ADDR"], out["MASTER_PORT"] = "127.0.0.1", str(port)
    return out


def test_clean_env_drops_inherited_cluster_variables():
    env = {"PATH": "/bin", "MASTER_PORT": "1", "LOCAL_RANK": "1", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "3",
           "TORCHELASTIC_RUN_ID": "x", "PL_GLOBAL_SEED": "7", "RANK": "1", "WORLD_SIZE": "4"}  # fmt: skip
    out = clean_env(env, 4242)
    assert out["PATH"] == "/bin" and out["MASTER_PORT"] == "4242" and out["MASTER_ADDR"] == "127.0.0.1"
    assert not {k for k in out if k.startswith(("SLURM_", "TORCHELASTIC_", "PL_"))}
    assert not {"LOCAL_RANK", "RANK", "WORLD_SIZE"} & out.keys()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(out: Path, *extra: str) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "ddp_script.py"), "--out", str(out), *extra],
        cwd=ROOT, env=clean_env(dict(os.environ), _free_port()), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip


def _results(proc: subprocess.Popen, out: Path) -> list[dict]:
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, log[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp")
    proc = _launch(root / "sync", "--same-buffers", "--then-no-rewrap", str(root / "no_rewrap"),
                   "--then-trial", str(root / "trial_fail"), str(root / "trial_grow"), "--then-fork", str(root / "fork"),
                   "--then-budget", str(root / "budget"))
    read = lambda name: [json.loads((root / name / f"rank{r}.json").read_text()) for r in (0, 1)]  # noqa: E731
    return {"sync": (_results(proc, root / "sync"), root / "sync"), "no_rewrap": (read("no_rewrap"), root / "no_rewrap"),
            "trial_fail": (read("trial_fail"), None), "trial_grow": (read("trial_grow"), None),
            "fork": (read("fork"), root / "fork"), "budget": (read("budget"), root / "budget")}  # fmt: skip


def test_the_fork_trains_one_arm_on_every_rank_and_adopts_it_alike(ddp_runs):
    """decision='stage_fork' under DDP: each rank's arm steps on its own batches with its gradients
    averaged, so the ranks judge one arm (one verdict, rank 0's figures) and, adopting it, hold
    identical parameters; forks keep opening after each adoption until max_growths."""
    (r0, r1), _ = ddp_runs["fork"]
    actions = [h["action"] for h in r0["history"]]
    assert actions[:3] == ["fork", "grow", "grow"] and actions == [h["action"] for h in r1["history"]]
    assert [h.get("fork") for h in r0["history"]] == [h.get("fork") for h in r1["history"]]
    assert r0["growth_log"] == r1["growth_log"] and len(r0["growth_log"]) == 6  # a block per stage, twice
    assert r0["checksum"] == r1["checksum"]
    # the fork's two sides were scored shard by shard (46 / 45 samples a rank), then gathered
    assert r0["scored_per_pass"] and set(r0["scored_per_pass"]) == {46} and set(r1["scored_per_pass"]) == {45}


def test_the_budget_default_takes_the_same_decisions_on_every_rank(ddp_runs):
    """The default schedule under DDP: each rank's arm steps on its own batches (every micro-batch,
    gradients averaged), rank 0's figures decide, every rank adopts the same arm and reports the same
    Γ̂_n (the probe pass all-reduces its sums): the ranks end with identical parameters."""
    (r0, r1), _ = ddp_runs["budget"]
    assert [h["action"] for h in r0["history"]] == ["grow", "grow"] == [h["action"] for h in r1["history"]]
    assert [h["budget"] for h in r0["history"]] == [h["budget"] for h in r1["history"]]
    assert [h["gamma"] for h in r0["history"]] == [h["gamma"] for h in r1["history"]]
    assert all(h["budget"]["function_preserving"] for h in r0["history"])  # copy_ramp: the arm started as the run
    assert r0["growth_log"] == r1["growth_log"] and len(r0["growth_log"]) == 6  # a block per stage, twice
    assert r0["checksum"] == r1["checksum"]


def test_the_budget_counts_every_ranks_samples_and_every_rank_judges_rank_0s_figures(ddp_runs):
    """The budget under DDP is the fit's optimizer steps of a batch on each of the 2 ranks (a step's FLOPs
    counted by FlopCounterMode on a freshly built network), spent to its end before max_epochs ends the fit
    (every rank's samples are charged); each rank's "steps" price is fitted on its own batches' curve, so
    every decision judges rank 0's figures: the same (lower, upper) on both ranks."""
    from torch.utils.flop_counter import FlopCounterMode

    (r0, r1), _ = ddp_runs["budget"]
    net = ImageClassifier(width=4, num_classes=4).network.eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        net(torch.zeros(1, 3, 8, 8))
    per_step = 3.0 * counter.get_total_flops() * 32 * 2  # a rank's batch of 32, on 2 ranks
    for r in (r0, r1):
        run = r["budget_run"]
        assert run["total_flops"] == pytest.approx(run["stepping_batches"] * per_step)
        assert run["spent"] >= run["total_flops"] * (1 - 1e-9) and run["global_step"] < run["stepping_batches"]
    assert len(r0["budget_run"]["judged"]) == 2 and r0["budget_run"]["judged"] == r1["budget_run"]["judged"]
    # the first decision opens once both ranks' batches (a rank's share of the epoch in batches of 32, the training
    # loader dropping its last, smaller one) reach 30 % of the budget (Budget(checks=2, growth_phase=0.6))
    run = r0["budget_run"]
    sizes = [32] * (math.ceil(run["train_samples"] / 2) // 32)
    assert len(sizes) * 50 == run["stepping_batches"]  # 50 epochs
    spent, step = 0.0, 0
    while spent < 0.3 * run["total_flops"] * (1 - 1e-9):
        spent += 3.0 * counter.get_total_flops() * sizes[step % len(sizes)] * 2
        step += 1
    assert r0["history"][0]["budget"]["opened_step"] in (step, step + 1)  # the point itself rounded either way


def test_a_failed_trial_leaves_every_rank_bit_for_bit_as_it_was(ddp_runs):
    """decision='trial' under DDP: no trial can pay (min_gain 500 %); each rank's parameters and
    buffers after the check are what they were before it, and both ranks saw one verdict."""
    (r0, r1), _ = ddp_runs["trial_fail"]
    for r in (r0, r1):
        assert r["history"][0]["action"] == "saturated" and r["growth_log"] == []
        assert r["params_after_check"] == r["params_before_check"]
        # a check probes one network, rank 0's: it gives every rank rank 0's BatchNorm statistics
        assert r["buffers_after_check"] == r0["buffers_before_check"]
    assert r0["history"][0]["trial"] == r1["history"][0]["trial"] and r0["checksum"] == r1["checksum"]


def test_a_paying_trial_grows_the_same_block_on_every_rank(ddp_runs):
    (r0, r1), _ = ddp_runs["trial_grow"]
    assert r0["history"][0]["action"] == "grow" and r0["growth_log"] == r1["growth_log"] != []
    assert r0["history"][0]["trial"] == r1["history"][0]["trial"]
    assert r0["checksum"] == r1["checksum"]  # trained on after the growth: still in sync


def _data() -> ImageDataModule:  # the script's datamodule
    return ImageDataModule(dataset="synthetic", image_size=8, synthetic_size=400, synthetic_classes=4,
                           probe_size=91, val_size=10, batch_size=32, augment=False)  # fmt: skip


def test_ranks_record_identical_checks_and_stay_in_sync(ddp_runs):
    (r0, r1), _ = ddp_runs["sync"]
    assert r0["world_size"] == r1["world_size"] == 2 and (r0["rank"], r1["rank"]) == (0, 1)
    # identical events, figures included; only the insertion check is local (each rank verifies the
    # output on its own first probe batch, so its tolerance scales with that batch)
    local = ("max_abs_change", "tolerance")
    strip = lambda hs: [{k: v for k, v in h.items() if k not in local} for h in hs]  # noqa: E731
    assert strip(r0["history"]) == strip(r1["history"])
    assert r0["buffers_before_check"] == r1["buffers_before_check"]  # one network (--same-buffers)
    assert r0["params_before_check"] == r1["params_before_check"]
    # the probe: 91 samples in disjoint shards of 46 and 45 that cover it, all-reduced back to n = 91
    assert (len(r0["probe_shard"]), len(r1["probe_shard"])) == (46, 45)
    assert sorted(r0["probe_shard"] + r1["probe_shard"]) == list(range(91))
    first = r0["history"][0]
    assert first["n"] == 91
    if first["action"] == "grow":
        kept = sum(h["action"] == "grow" for h in r0["history"])
        assert r0["growth_log"] == r1["growth_log"] and len(r0["growth_log"]) == kept
        assert r0["param_groups"] == r1["param_groups"] == ["base"] + [f"growth{k}" for k in range(len(r0["growth_log"]))]
        assert first["max_abs_change"] == 0.0 and r1["history"][0]["max_abs_change"] == 0.0  # fp32, bit-exact
    assert r0["checksum"] == r1["checksum"]  # identical parameters after training on


def test_first_check_equals_a_single_process_check_on_the_same_batches(ddp_runs):
    (r0, r1), out = ddp_runs["sync"]
    first = r0["history"][0]
    module = ImageClassifier(width=4, in_channels=3, num_classes=4)
    module.load_state_dict(torch.load(out / "pre_check.pt", weights_only=True))
    module.eval()
    probe = _data().probe_dataloader()
    shards = [r0["probe_shard"], r1["probe_shard"]]
    halves = [math.ceil(len(s) / 2) for s in shards]  # each rank's half A: the first ⌈n_r/2⌉ of its shard
    assert halves[0] < r0["probe_batch_size"] and halves[1] < r1["probe_batch_size"]  # A sits in one batch

    def batch(indices):
        return next(iter(DataLoader(Subset(probe.dataset, indices), batch_size=len(indices),
                                    collate_fn=probe.collate_fn)))  # fmt: skip

    # rank 0's A, rank 1's A, rank 0's B, rank 1's B: A = the first 46 = ⌈91/2⌉ samples as on the
    # ranks, and the two A batches calibrate the candidates' BatchNorms as the ranks' did
    batches = [batch(s[:h]) for s, h in zip(shards, halves)] + [batch(s[h:]) for s, h in zip(shards, halves)]
    report = measure_saturation(module.network, batches, F.cross_entropy, rule="crossfit", alpha=0.05, seed=0,
                                projected=False, calibrate=True, variance=True)  # fmt: skip
    assert report.n == first["n"] == 91
    assert report.extra["n_a"] == 46 and report.extra["n_b"] == 45
    scores = {s["site"]: s for s in first["site_scores"]}
    assert [r.name for r in report.sites] == list(scores)
    for record in report.sites:  # probe sums, all-reduced over ranks vs one process
        theirs = scores[record.name]
        assert record.grad_norm == pytest.approx(theirs["grad_norm"], rel=1e-5, abs=1e-9), record.name
        # every check forms σ̂² (the paper's t): all-reduced over ranks vs one process
        assert record.variance == pytest.approx(theirs["variance"], rel=1e-5, abs=1e-9), record.name
        assert record.lower == pytest.approx(theirs["lower"], rel=1e-4, abs=1e-6), record.name
    assert report.gamma == pytest.approx(first["gamma"], rel=1e-5)
    # the decision
    assert (first["action"] == "grow") == (not report.saturated)
    assert first["site"] == report.best_site
    if report.saturated:
        return
    # the inserted block: the same candidate, with the same (rank-pooled) calibrated statistics
    mine = report.record(report.best_site).block.state_dict()
    for rank in (0, 1):
        inserted = torch.load(out / f"inserted{rank}.pt", weights_only=True)
        assert inserted.keys() == mine.keys()
        for key in mine:
            if key.endswith("num_batches_tracked"):  # calibration batches counted per rank, not pooled
                continue
            torch.testing.assert_close(inserted[key], mine[key], rtol=1e-5, atol=1e-6, msg=key)


def test_negative_control_without_rewrap_the_ranks_drift_apart(ddp_runs):
    """The same run with the DDP wrapper left as it was before the growth: the new block's
    parameters are outside DDP's reducer, each rank updates them with its own gradients."""
    (s0, _), _ = ddp_runs["sync"]
    (r0, r1), _ = ddp_runs["no_rewrap"]
    assert r0["history"][0]["action"] == s0["history"][0]["action"]  # the same first decision
    if r0["history"][0]["action"] != "grow":
        pytest.skip("the first check did not grow, so there is no new block to drift")  # pragma: no cover
    assert r0["params_before_check"] == r1["params_before_check"]  # in sync up to the growth
    assert r0["checksum"] != r1["checksum"]  # ... and apart after training on
