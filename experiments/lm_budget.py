"""A byte-level GPT on the Python standard library on a fixed FLOP budget: growth against scratch.

Every arm gets the same training FLOPs B (3 × forward FLOPs × sequences, counted per architecture by
FlopCounterMode, as ComputeMeter does): a deeper network takes fewer optimizer steps. Arms:

  scratch-L        L blocks from the start, warmup + cosine to 10 % over its steps (L = 1 … 8)
  scratch-L-wsd    the same under warmup-stable-decay (the last 20 % decays)
  grow-zero        2 blocks, one more on top at 10/20/30/40 % of the steps → 6 (the paper's zero insertion)
  grow-mask        the same, MSG's mask ramp (ramp over 5 % of the steps)
  grow-copy        the same, G_stack's copy of the block below (not function-preserving)
  grow-late        3 blocks under WSD, once at 60 %: one after each block → 6 (Bu 2025's late growth)
  grow-late-copy   the same, each new block a copy of the one before it (G_stack's duplication)
  grow-*-wsd       an early arm under warmup-stable-decay (its scratch reference: scratch-6-wsd)
  growto-N[-INS][-pPP]  the growth frontier: 2 blocks → N under WSD, one block on top at a time, evenly
                   spaced so the last lands at PP % of the steps (default 40), insertion INS (default copy)
  budget[-x|-steps][-fF][-cC][-pP][-zero|-copyzero|-copyramp]  the budget schedule (GrowUntilSaturated(schedule=Budget())) from 2 blocks on scratch-2's steps: C decisions (4)
                   over the first P % (40), each a fork over F ‰ of the budget (20) judged on its equal-FLOP gain;
                   -x: on the gain carried to the budget's end; -steps: the equal-steps gain less the price of
                   fewer steps on the run's curve (statistic="steps"; -eNN: its curve exponent NN/100); -zero: the zero insertion (default copy); it drives WSD itself
  decide           2 blocks, GrowUntilSaturated (block-only trials every 2 of 250-step epochs) on the
                   step count of scratch-4: where the decision stops at this budget

Each arm resumes from its last epoch checkpoint and writes OUT/row.json: the validation curve
(step, FLOPs, loss on 20 batches each 250-step epoch), the final validation and test loss on the whole
splits, the growth log and the wall time.

    python experiments/lm_budget.py scratch-6 --out runs/lm/scratch-6 [--seed 0] [--budget-tflop 19.2] [--lr 1e-3]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from pathlib import Path

import torch

D_MODEL, N_HEAD, BLOCK, BATCH, LR = 64, 4, 64, 32, 1e-3
EPOCH_STEPS, CURVE_BATCHES = int(os.environ.get("EPOCH_STEPS", "250")), 20
GROW_AT = [0.1, 0.2, 0.3, 0.4]


def arm_spec(arm: str) -> dict:
    """start depth, depth after each growth point, the growth callback's arguments, the schedule."""
    if arm.startswith("scratch-"):
        parts = arm.split("-")
        L = int(parts[1])
        return {"start": L, "at": [], "depths": [L], "schedule": "wsd" if parts[-1] == "wsd" else "cosine"}
    early = {"start": 2, "at": GROW_AT, "depths": [2, 3, 4, 5, 6], "schedule": "cosine", "site": "last",
             "blocks": 1}  # fmt: skip
    base, _, variant = arm.partition("-wsd")  # "-wsd": the same arm under warmup-stable-decay
    wsd = {"schedule": "wsd"} if arm.endswith("-wsd") else {}
    if base == "grow-zero":
        return early | {"insertion": "zero"} | wsd
    if base == "grow-mask":
        return early | {"insertion": "mask_ramp"} | wsd
    if base == "grow-copy":
        return early | {"insertion": "copy"} | wsd
    if base in ("grow-late", "grow-late-copy"):
        return {"start": 3, "at": [0.6], "depths": [3, 6], "schedule": "wsd", "site": "interleave", "blocks": 3,
                "insertion": "copy" if base.endswith("copy") else "zero"}  # fmt: skip
    if base.startswith("growto-"):  # growth frontier: 2 blocks → N, one block at a time, evenly over a phase
        # growto-N[-INSERTION][-pPP]: the last block lands at PP % of the steps (default 40 %); under WSD
        parts = base.split("-")
        n, phase, insertion = int(parts[1]), 0.4, "copy"
        for part in parts[2:]:
            if part.startswith("p") and part[1:].isdigit():
                phase = int(part[1:]) / 100
            else:
                insertion = part
        if n <= 2:
            raise SystemExit(f"arm: growto-N needs N > 2 (the start depth), got {arm!r}")
        at = [round(phase * i / (n - 2), 6) for i in range(1, n - 1)]
        return {"start": 2, "at": at, "depths": list(range(2, n + 1)), "schedule": "wsd", "site": "last",
                "blocks": 1, "insertion": insertion}  # fmt: skip
    if base.startswith("budget"):  # the budget schedule: budget[-x|-steps][-fFORK‰][-cCHECKS][-pPHASE%][-zero] from 2 blocks
        opts = {"checks": 4, "fork": 0.02, "growth_phase": 0.4, "statistic": "fork", "insertion": "copy"}
        for part in base.split("-")[1:]:
            if part == "x":
                opts["statistic"] = "carried"
            elif part == "steps":
                opts["statistic"] = "steps"
            elif part[0] == "e" and part[1:].isdigit():  # the steps statistic's curve exponent, in hundredths
                opts["exponent"] = int(part[1:]) / 100
            elif part == "zero":
                opts["insertion"] = "zero"
            elif part == "copyzero":  # the copy with its terminal map at zero (function-preserving)
                opts["insertion"] = "copy_zero"
            elif part == "copyramp":  # the copy behind a mask ramped 0 → 1 over the fork's first quarter
                opts["insertion"] = "copy_ramp"
            elif part[0] == "f":
                opts["fork"] = int(part[1:]) / 1000
            elif part[0] == "c":
                opts["checks"] = int(part[1:])
            elif part[0] == "p":
                opts["growth_phase"] = int(part[1:]) / 100
            else:
                raise SystemExit(f"arm: unknown budget option {part!r} in {arm!r}")
        return {"start": 2, "at": [], "depths": [2], "schedule": "budget", "budget": opts}
    if arm == "decide":
        return {"start": 2, "at": [], "depths": [4], "schedule": "cosine", "decide": True}
    raise SystemExit(f"arm: unknown {arm!r}")


def step_flops(depth: int) -> float:
    """Training FLOPs of one optimizer step at this depth (3 × forward of one sequence × batch)."""
    from growtrain.callbacks.compute import forward_flops
    from growtrain.models.gpt import GPT, GPTConfig

    net = GPT(GPTConfig(n_layer=depth, d_model=D_MODEL, n_head=N_HEAD, block_size=BLOCK))
    return 3.0 * BATCH * forward_flops(net, torch.zeros(1, BLOCK, dtype=torch.long))


def steps_for(spec: dict, budget: float) -> int:
    """Optimizer steps S with Σ (fraction of S at each depth) × step FLOPs = budget."""
    edges = [0.0, *spec["at"], 1.0]
    per_step = sum((b - a) * step_flops(d) for a, b, d in zip(edges, edges[1:], spec["depths"]))
    return int(budget / per_step)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("arm")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-tflop", type=float, default=19.2)
    ap.add_argument("--lr", type=float, default=LR, help=f"peak learning rate (default {LR})")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("THREADS", "1")))
    import lightning as L
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    from growtrain import Budget, BudgetFork, GrowUntilSaturated, Periodic, Plan
    from growtrain.callbacks import ComputeMeter
    from growtrain.data.text import TextDataModule
    from growtrain.lm import LanguageModel
    from growtrain.optim import WarmupCosine, WarmupStableDecay

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spec = arm_spec(args.arm)
    budget = args.budget_tflop * 1e12
    steps = steps_for(spec, budget)
    warmup = max(1, steps // 100)
    sched = None if spec["schedule"] == "budget" else (functools.partial(WarmupCosine, warmup_steps=warmup, total_steps=steps, min_lr_ratio=0.1)
             if spec["schedule"] == "cosine" else
             functools.partial(WarmupStableDecay, warmup_steps=warmup, total_steps=steps,
                               decay_steps=steps // 5, min_lr_ratio=0.1))  # fmt: skip
    L.seed_everything(args.seed, workers=True)
    model = LanguageModel(n_layer=spec["start"], d_model=D_MODEL, n_head=N_HEAD, block_size=BLOCK, vocab_size=256,
                          optimizer=functools.partial(torch.optim.AdamW, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1),
                          lr_scheduler=sched, scheduler_interval="step")  # fmt: skip
    dm = TextDataModule(tokenizer="byte", block_size=BLOCK, batch_size=BATCH, max_chars=None, probe_fraction=0.01,
                        val_fraction=0.01, test_fraction=0.01, eval_batch_size=64, seed=args.seed)  # fmt: skip

    class Curve(Callback):
        """(step, FLOPs, validation loss) at each validation: the loss-against-compute figure."""

        def __init__(self, meter):
            self.meter, self.rows = meter, []

        def on_validation_end(self, trainer, pl_module):
            if trainer.sanity_checking or "val_loss" not in trainer.callback_metrics:
                return
            self.rows.append({"step": trainer.global_step, "flops": self.meter.flops,
                              "val_loss": float(trainer.callback_metrics["val_loss"])})  # fmt: skip

        def state_dict(self):
            return {"rows": self.rows}

        def load_state_dict(self, state):
            self.rows = list(state["rows"])

    meter = ComputeMeter()
    curve = Curve(meter)
    callbacks = [meter, curve, ModelCheckpoint(dirpath=out / "ckpt", save_last=True)]
    if spec.get("at"):
        grow = GrowUntilSaturated(schedule=Plan(at=spec["at"], blocks=spec["blocks"], site=spec["site"],
                                                ramp_steps=max(1, steps // 20)), insertion=spec["insertion"], seed=args.seed)
        callbacks.append(grow)
    elif spec.get("budget"):
        import dataclasses

        import growtrain.budget

        opts = dict(spec["budget"])
        if "exponent" in opts:  # a stability row: the price's exponent halved or doubled
            growtrain.budget.COST_EXPONENT = opts.pop("exponent")
        part = lambda cls: {f.name: opts.pop(f.name) for f in dataclasses.fields(cls) if f.name in opts}  # noqa: E731
        grow = GrowUntilSaturated(schedule=Budget(**part(Budget)), decision=BudgetFork(**part(BudgetFork)),
                                  seed=args.seed, **opts)  # fmt: skip
        callbacks.append(grow)
    elif spec.get("decide"):
        grow = GrowUntilSaturated(schedule=Periodic(every_n_epochs=2), decision="trial",
                                  on_saturated="continue", seed=args.seed, verbose=False)  # fmt: skip
        callbacks.append(grow)
    else:
        grow = None
    trainer = L.Trainer(max_steps=steps, max_epochs=-1, limit_train_batches=EPOCH_STEPS, limit_val_batches=CURVE_BATCHES,
                        callbacks=callbacks, accelerator="cpu", devices=1, gradient_clip_val=1.0, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        deterministic=False)  # fmt: skip
    last = out / "ckpt" / "last.ckpt"
    t0 = time.perf_counter()
    trainer.fit(model, dm, ckpt_path=str(last) if last.exists() else None)
    wall = time.perf_counter() - t0
    final = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False)
    val = final.validate(model, dm, verbose=False)[0]["val_loss"]
    test = final.test(model, dm, verbose=False)[0]["test_loss"]
    row = {"arm": args.arm, "seed": args.seed, "lr": args.lr, "budget_flops": budget, "steps": steps, "spec": spec,
           "depth": model.network.depth(), "flops": meter.flops, "curve": curve.rows, "val_loss": val,
           "test_loss": test, "wall_s_this_process": wall, "threads": torch.get_num_threads(),
           "budget": ({"spent": grow.run.spent, "decision_flops": grow.run.decision_flops,
                       "plan": grow.run.plan.as_dict(), "finished": grow.finished,
                       "seconds": {"decisions": grow.check_seconds, "fit": grow.fit_seconds}} if spec.get("budget") else None),
           "growth": grow.history if grow is not None else None,
           "check_seconds": getattr(grow, "check_seconds", None), "fit_seconds": getattr(grow, "fit_seconds", None)}  # fmt: skip
    (out / "row.json").write_text(json.dumps(row, indent=1, default=str))
    print(json.dumps({k: row[k] for k in ("arm", "seed", "steps", "depth", "flops", "val_loss", "test_loss")}))


if __name__ == "__main__":
    main()
