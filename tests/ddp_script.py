"""A tiny 2-process CPU DDP fit with GrowUntilSaturated (run by tests/test_ddp.py as a subprocess).

Lightning's ``ddp`` launcher re-runs this script for rank 1, so it must be a plain script:

    PYTHONPATH=. python tests/ddp_script.py --out /tmp/ddp_out [--same-buffers] [--no-rewrap]
        [--then-no-rewrap /tmp/ddp_control]

Each rank writes ``rank{r}.json``: its growth history, growth log, param-group names, its own
probe shard (the probe-dataset indices in its loader order), and checksums of its parameters
and buffers right before the first check and at the end. Rank 0 also saves
``pre_check.pt`` (the module's state right before the first check) and every rank
``inserted{r}.pt`` (the block inserted by the first check, right after it), so the test can
redo the first check in a single process and compare.

``--same-buffers`` (the comparison run) broadcasts rank 0's buffers right before the first
check. DDP broadcasts rank 0's BatchNorm buffers at the start of each training forward, but the
last forward then updates each rank's running statistics with its own batch, so without it the
ranks probe with slightly different eval-mode statistics (recorded as ``buffers_before_check``;
SyncBatchNorm, which would keep them equal, needs GPUs).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os

import lightning as L
import torch

from growtrain.callbacks import Budget, BudgetFork, GrowUntilSaturated, StageFork, Trial, editor
from growtrain.data import ImageDataModule
from growtrain.growable import grown_blocks
from growtrain.module import ImageClassifier


def checksum(tensors) -> str:
    digest = hashlib.sha256()
    for name, t in sorted(tensors):
        digest.update(name.encode())
        digest.update(t.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


class Snapshot(L.Callback):
    """Before the grower (hooks run in list order): the state the first check sees."""

    def __init__(self, out: str, same_buffers: bool):
        self.out, self.same_buffers = out, same_buffers
        self.info: dict = {}

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == 1:  # the second check
            self.info["growth_log_check1"] = [dict(r) for r in pl_module.network.growth_log]
            if trainer.global_rank == 0:
                torch.save(pl_module.state_dict(), os.path.join(self.out, "pre_check1.pt"))
        if trainer.current_epoch != 0:
            return
        self.info["buffers_differ_before_check"] = self._buffers_differ(pl_module)
        if self.same_buffers:
            for buffer in pl_module.buffers():
                torch.distributed.broadcast(buffer, 0)
        self.info["params_before_check"] = checksum(pl_module.named_parameters())
        self.info["buffers_before_check"] = checksum(pl_module.named_buffers())
        if trainer.global_rank == 0:
            torch.save(pl_module.state_dict(), os.path.join(self.out, "pre_check.pt"))


    @staticmethod
    def _buffers_differ(pl_module) -> bool:
        flat = torch.cat([b.detach().double().flatten() for b in pl_module.buffers()])
        low, high = flat.clone(), flat.clone()
        torch.distributed.all_reduce(low, op=torch.distributed.ReduceOp.MIN)
        torch.distributed.all_reduce(high, op=torch.distributed.ReduceOp.MAX)
        return bool((low != high).any())


class AfterCheck(L.Callback):
    """After the grower: the block the first check inserted, on this rank, and the checksums
    of the state the first check left (a trial must leave it as it found it)."""

    def __init__(self, out: str, info: dict | None = None):
        self.out, self.info = out, info if info is not None else {}

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == 0:
            self.info["params_after_check"] = checksum(pl_module.named_parameters())
            self.info["buffers_after_check"] = checksum(pl_module.named_buffers())
        blocks = grown_blocks(pl_module.network)
        if trainer.current_epoch == 0 and blocks:
            torch.save(blocks[0].state_dict(), os.path.join(self.out, f"inserted{trainer.global_rank}.pt"))


JUDGED: list[list[float]] = []  # the budget's decisions: the (lower, upper) fractions budget_verdict was given


def fit(out: str, epochs: int, same_buffers: bool, trial_gain: float | None = None, fork: bool = False,
        budget: bool = False) -> None:
    os.makedirs(out, exist_ok=True)
    from growtrain.callbacks import probe_data

    scored: list[int] = []  # the samples each per-sample scoring pass of this rank read (extra passes, forks)
    real_losses = probe_data.per_sample_losses
    probe_data.per_sample_losses = lambda *a, **k: (lambda out: scored.append(out.numel()) or out)(real_losses(*a, **k))
    L.seed_everything(0)
    data = ImageDataModule(dataset="synthetic", image_size=8, synthetic_size=400, synthetic_classes=4,
                           probe_size=91, val_size=10, batch_size=32, augment=False)  # fmt: skip
    module = ImageClassifier(width=4, num_classes=4)
    # cross-fit rule (its A/B split all-reduces mid-pass); 91 probe samples: shards of 46 and 45.
    # the rule decides every check (the first is replayed in one process by the test);
    # trial_gain: the block-only trial decision instead, with that min_gain (5.0: no trial can pay)
    decision = {"decision": "rule"} if trial_gain is None else {"decision": Trial(min_gain=trial_gain, epochs=0.5)}
    if fork:  # the stage fork: each rank's arm steps on its own batches, gradients averaged; every fork "pays"
        decision = {"decision": StageFork(min_gain=0.0), "on_saturated": "continue"}
    grow = GrowUntilSaturated(schedule="periodic", rule="crossfit", max_growths=2, **decision, verbose=False)
    if budget:  # the default schedule: its forks at 30 % and 60 % of the budget, each over 10 % of it
        grow = GrowUntilSaturated(schedule=Budget(checks=2, growth_phase=0.6), decision=BudgetFork(fork=0.1),
                                  verbose=False)  # fmt: skip
    snapshot = Snapshot(out, same_buffers)
    trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=epochs,
                        callbacks=[snapshot, grow, AfterCheck(out, snapshot.info)],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, default_root_dir=out)  # fmt: skip
    trainer.fit(module, data)
    probe_data.per_sample_losses = real_losses

    rank = trainer.global_rank
    shard = grow._probe_loader(trainer)
    result = {
        "rank": rank,
        "world_size": trainer.world_size,
        "history": grow.history,
        "growth_log": module.network.growth_log,
        "param_groups": [g.get("name") for g in trainer.optimizers[0].param_groups],
        "probe_shard": [int(i) for i in shard.sampler],
        "probe_batch_size": shard.batch_size,
        "checksum": checksum(module.named_parameters()),
        "scored_per_pass": scored,
        **snapshot.info,
    }
    if budget:  # the budget's FLOPs as this rank counted them, and the figures each of its decisions judged
        result["budget_run"] = {"total_flops": grow.run.plan.total_flops, "spent": grow.run.spent,
                                "global_step": int(trainer.global_step), "judged": list(JUDGED),
                                "stepping_batches": int(trainer.estimated_stepping_batches),
                                "train_samples": len(data.train_dataloader().dataset)}  # fmt: skip
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--same-buffers", action="store_true", help="rank 0's buffers on every rank before the check")
    parser.add_argument("--no-rewrap", action="store_true", help="break DDP re-wrapping (the test's negative control)")
    parser.add_argument("--then-no-rewrap", metavar="OUT",
                        help="afterwards, in the same processes, the --no-rewrap fit into OUT (saves a launch)")
    parser.add_argument("--then-budget", metavar="OUT", help="afterwards, the budget schedule (every decision grows) into OUT")
    parser.add_argument("--then-fork", metavar="OUT", help="afterwards, decision='stage_fork' (every fork adopted) into OUT")
    parser.add_argument("--then-trial", metavar="OUT", nargs=2,
                        help="afterwards, the trial decision: an impossible min_gain into OUT1, min_gain=0 into OUT2")
    args = parser.parse_args()
    torch.set_num_threads(1)
    real_rewrap = editor.rewrap_ddp  # the function the callback calls, to put back
    if args.no_rewrap:
        editor.rewrap_ddp = lambda trainer: None
    fit(args.out, args.epochs, args.same_buffers)
    if args.then_no_rewrap:
        editor.rewrap_ddp = lambda trainer: None
        fit(args.then_no_rewrap, args.epochs, args.same_buffers)
        editor.rewrap_ddp = real_rewrap
    if args.then_trial:
        fit(args.then_trial[0], 1, False, trial_gain=5.0)
        fit(args.then_trial[1], 2, False, trial_gain=0.0)
    if args.then_fork:
        from dataclasses import replace

        from growtrain.callbacks import fork_check

        real = fork_check.fork_verdict
        fork_check.fork_verdict = lambda test, **k: real(test, **k) if test is None else replace(
            real(test, **k), saturated=False, site=k["site"])  # fmt: skip
        fit(args.then_fork, 4, False, fork=True)
    if args.then_budget:
        from growtrain.callbacks import budget as budget_part

        # every decision adopts its arm; the (lower, upper) it judged is kept: each rank must judge rank 0's
        budget_part.budget_verdict = lambda lower, upper, margin: JUDGED.append([lower, upper]) or (True, False)
        fit(args.then_budget, 50, False, budget=True)


if __name__ == "__main__":
    main()
