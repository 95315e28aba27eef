"""The gain bound's level and power on real, skewed per-sample losses (bench/gain_level.py's
pairs), through the product's own gain_test: the statistical half of tests/test_gain.py, in its
own file so the two halves run on different workers."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from growtrain.gain import gain_test

PAIRS = Path(__file__).resolve().parent / "data" / "gain_pairs.pt"  # bench/gain_level.py pairs


def _bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_gain_level", PAIRS.parents[2] / "bench" / "gain_level.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _real_pairs():
    bench = _bench()
    pair = bench.most_skewed(bench.load_pairs(PAIRS))
    return pair["before"], pair["after"]


def test_the_real_differences_are_skewed():
    """The null below is only as hard as its data: the fixture's differences are skewed."""
    before, after = _real_pairs()
    skew = _bench().skewness(before - after)
    assert before.numel() == 2000 and abs(skew) > SKEW_AT_LEAST


REPS = 1000
SKEW_AT_LEAST = 5.0  # the fixture's most skewed verdict: 6.5 (docs/decision.md)


def test_under_the_right_skewed_real_null_the_level_holds_at_n_500():
    """Right-skewed null at the boundary E[b − a] = min_gain·E[b], from a real fit's most skewed
    gain verdict (bench/gain_level.py): the product says "paid" at most α + 3 sd of the time."""
    before, after = _real_pairs()
    limit = 0.05 + 3 * math.sqrt(0.05 * 0.95 / REPS)
    r = _bench().rates(before, after, n=500, reps=REPS, skew="right", seed=11)
    assert r["bootstrap_t"] <= limit, r


def test_under_the_left_skewed_real_null_the_normal_bound_fails_and_the_bootstrap_t_corrects_most_of_it():
    """Left-skewed null (the long tail on the losing side), n = 2000, both methods through the
    product's own gain_test on the same draws: the plain normal bound (the broken variant)
    says "paid" more than α + 3 sd of the time; the bootstrap-t bound is never above it on a
    draw, and its excess over α is at most 2/3 of the normal bound's. This is NOT the full
    target: at skewness 6.5 the bootstrap-t rate itself sits at the edge of α + 3 sd (0.0655
    with 2000 repetitions, docs/decision.md), reported there as a miss."""
    bench = _bench()
    before, after = _real_pairs()
    b, a = bench.null_population(before, after, skew="left", min_gain=0.01)
    limit = 0.05 + 3 * math.sqrt(0.05 * 0.95 / REPS)
    g = torch.Generator().manual_seed(11)
    paid = {"bootstrap_t": [], "normal": []}
    for r in range(REPS):
        idx = torch.randint(b.numel(), (2000,), generator=g)
        for method in paid:
            paid[method].append(gain_test(b[idx], a[idx], min_gain=0.01, level=0.05, method=method, seed=r)["paid"])
    boot, normal = (sum(paid[m]) / REPS for m in ("bootstrap_t", "normal"))
    assert normal > limit, (boot, normal)
    assert not any(x and not y for x, y in zip(paid["bootstrap_t"], paid["normal"]))  # left skew: always below
    assert boot - 0.05 <= (2 / 3) * (normal - 0.05), (boot, normal)


def test_the_bootstrap_t_keeps_the_normal_bounds_power():
    """A true gain of 3 % of the loss at n = 2000 on the real differences: the bootstrap-t finds
    it about as often as the normal bound (within 2 sd of a rate). The absolute power is low —
    the real per-sample differences have sd 0.37 nats (docs/decision.md: the ≥ 95 % target is
    missed for that reason, whatever the bound)."""
    before, after = _real_pairs()
    reps = 200
    r = _bench().rates(before, after, n=2000, reps=reps, skew="right", gain=0.03, seed=5)
    assert r["bootstrap_t"] >= r["normal"] - 2 * math.sqrt(0.25 / reps), r
    assert r["bootstrap_t"] > 0.05  # it does detect the gain more often than a null
