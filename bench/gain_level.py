"""Level and power of the realized-gain certificate on real per-sample loss differences.

    PYTHONPATH=. python bench/gain_level.py pairs      # ~1 min: a real fit → tests/data/gain_pairs.pt
    PYTHONPATH=. python bench/gain_level.py simulate --reps 4000 --md docs/results/gain_level.md

``pairs`` trains the quickstart's ResNet-8 on the embedded Fashion-MNIST subset (5000 train, 2000
probe) with ``GrowUntilSaturated(schedule="periodic")`` (the stage fork) and keeps the two per-sample
probe-loss vectors of every fork verdict (``b``: the run, ``a``: the arm with the blocks): the
product's own losses, and the same bootstrap-t (``gain_test``) that the fork and the block-only trial
decide by. (The stored tests/data/gain_pairs.pt came from the stage-gain decision, removed since:
the same kind of paired probe losses, a stage apart.)

``simulate`` builds nulls from them. With ``d_i = b_i − a_i`` (the real differences) and
``g = min_gain``, a null at the boundary (``E[d] = g·E[b]`` exactly) is
``a⁰_i = b_i − (c_i + g·b̄)`` with ``c = ±(d − d̄)``, the sign chosen so that the null's
differences are *left*-skewed (the long tail on the losing side: the case that fools a normal
lower bound) or *right*-skewed. The real pair used is the fit's most skewed verdict. Each repetition draws ``n`` of the 2000
pairs with replacement and asks the product's ``gain_test`` (bootstrap-t) and its broken
variant (``method="normal"``, the plain CLT bound) whether the growth paid. A rate is a false
"paid" rate; its sd is ``sqrt(α(1−α)/reps)``. Power: the same with a true gain of 3 % of the
loss (``+0.03·b̄ − g·b̄`` added back).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

PAIRS = Path(__file__).resolve().parents[1] / "tests" / "data" / "gain_pairs.pt"


def make_pairs(out: Path = PAIRS, seed: int = 0) -> list[dict]:
    """Every fork verdict of a real fit: its two per-sample probe-loss vectors (float32)."""
    import lightning
    from growtrain.callbacks import GrowUntilSaturated, Periodic, StageFork
    from growtrain.data import ImageDataModule
    from growtrain.module import ImageClassifier

    captured: list[dict] = []

    import growtrain.callbacks.fork_check as fork_check

    real_test = fork_check.fork_test

    def capture(control, arm, **kwargs):  # what the stage fork judges: the two sides' losses, paired by sample
        captured.append({"before": control.float().clone(), "after": arm.float().clone()})
        return real_test(control, arm, **kwargs)

    fork_check.fork_test = capture
    lightning.seed_everything(seed, verbose=False)
    dm = ImageDataModule(dataset="fashion-mnist-mini", batch_size=128, probe_size=2000, val_size=1000, seed=0)
    model = ImageClassifier(arch="cifar_resnet", blocks=(1, 1, 1), width=8, family="basic", in_channels=1)
    # min_gain=0: growth goes on while the arm's loss is lower at all, so the fit yields several verdicts
    grow = GrowUntilSaturated(schedule=Periodic(every_n_epochs=2, anneal_epochs=3), decision=StageFork(min_gain=0.0),
                              max_growths=4, on_saturated="anneal", verbose=False)  # fmt: skip
    trainer = lightning.Trainer(max_epochs=60, accelerator="cpu", devices=1, callbacks=[grow], logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, num_sanity_val_steps=0,
                                enable_model_summary=False)  # fmt: skip
    trainer.fit(model, datamodule=dm)
    if not captured:
        raise RuntimeError("the fit reached no fork verdict; nothing captured")
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"pairs": captured, "command": "PYTHONPATH=. python bench/gain_level.py pairs"}, out)
    return captured


def load_pairs(path: Path = PAIRS) -> list[dict]:
    return torch.load(path, weights_only=True)["pairs"]


def most_skewed(pairs: list[dict]) -> dict:
    """The verdict whose differences are the most skewed: the hardest null for a normal bound."""
    return max(pairs, key=lambda p: abs(skewness(p["before"] - p["after"])))


def skewness(x: torch.Tensor) -> float:
    x = x.double()
    c = x - x.mean()
    return float((c**3).mean() / (c**2).mean() ** 1.5)


def null_population(before, after, *, skew: str, min_gain: float, gain: float = None):
    """``(b, a)`` pairs whose population has ``E[b − a] = gain·E[b]`` exactly (default: the
    boundary ``gain = min_gain``), with the real differences' shape oriented so that their
    skewness is negative (``skew='left'``: the long tail on the losing side, the case that
    fools a normal lower bound) or positive (``'right'``)."""
    b = before.double()
    d = b - after.double()
    c = d - d.mean()
    if skew not in ("left", "right"):
        raise ValueError(f"skew: expected 'left' or 'right'; got {skew!r}")
    if (skewness(c) < 0) != (skew == "left"):
        c = -c
    target = (min_gain if gain is None else gain) * b.mean()
    return b, b - (c + target)


def rates(before, after, *, n: int, reps: int, min_gain: float = 0.01, alpha: float = 0.05, gain: float = None,
          skew: str = "left", seed: int = 0) -> dict:  # fmt: skip
    """Rates of "paid" for the product (bootstrap-t) and the broken variant (normal), both via gain_test."""
    from growtrain.gain import gain_test

    b, a = null_population(before, after, skew=skew, min_gain=min_gain, gain=gain)
    g = torch.Generator().manual_seed(seed)
    paid = {"bootstrap_t": 0, "normal": 0}
    for r in range(reps):
        idx = torch.randint(b.numel(), (n,), generator=g)
        for method in paid:
            paid[method] += gain_test(b[idx], a[idx], min_gain=min_gain, level=alpha, method=method, seed=r)["paid"]
    return {m: k / reps for m, k in paid.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["pairs", "simulate"])
    p.add_argument("--reps", type=int, default=2000)
    p.add_argument("--ns", type=int, nargs="+", default=[500, 2000])
    p.add_argument("--md", type=Path, default=None)
    args = p.parse_args(argv)
    if args.what == "pairs":
        for c in make_pairs():
            d = c["before"].double() - c["after"].double()
            print(f"epoch {c['epoch']}: n={d.numel()} mean gain {float(d.mean()):.4g} sd {float(d.std()):.4g} "
                  f"skew {skewness(d):.2f}")
        return 0
    pair = most_skewed(load_pairs())
    before, after = pair["before"], pair["after"]
    d = before.double() - after.double()
    sd = math.sqrt(0.05 * 0.95 / args.reps)
    lines = [f"Real differences (the verdict at epoch {pair['epoch']}): n = {d.numel()}, mean {float(d.mean()):.4g}, "
             f"sd {float(d.std()):.4g}, skewness ±{abs(skewness(d)):.2f}. α = 0.05, min_gain = 0.01, "
             f"{args.reps} repetitions per cell (sd of a rate at 0.05: {sd:.4f}; α + 3 sd = {0.05 + 3 * sd:.4f}).", "",
             "| null | n | bootstrap-t (product) | normal (broken variant) |", "|---|---|---|---|"]  # fmt: skip
    for skew in ("left", "right"):
        for n in args.ns:
            r = rates(before, after, n=n, reps=args.reps, skew=skew)
            lines.append(f"| {skew}-skewed, false 'paid' | {n} | {r['bootstrap_t']:.4f} | {r['normal']:.4f} |")
            print(lines[-1], flush=True)
    for skew in ("left", "right"):
        r = rates(before, after, n=2000, reps=max(200, args.reps // 4), skew=skew, gain=0.03)
        lines.append(f"| {skew}-skewed, true gain 3 % (power) | 2000 | {r['bootstrap_t']:.4f} | {r['normal']:.4f} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.md:
        args.md.parent.mkdir(parents=True, exist_ok=True)
        args.md.write_text(f"<!-- PYTHONPATH=. python bench/gain_level.py simulate --reps {args.reps} --md {args.md} -->\n"
                           + text)  # fmt: skip
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
