"""The folded calibration vs a separate calibration pass: do the cross-fit bounds (and so the
decision's power) change?

    OMP_NUM_THREADS=1 python bench/fold_power.py            # 40 probe draws, about a minute

Both protocols calibrate the ghosts' BatchNorm statistics on half A only. ``separate`` is the
check before the cost work: a forward pass over A (``calibrate_candidates``), then the scoring pass
in eval mode. ``folded`` is the check now: on A the ghosts' features use batch statistics,
accumulated as they go; B is scored with A's statistics. The probe is cut into batches of 64,
so A (128 samples) is two batches and the protocols differ on A. The network is a
``cifar_resnet`` fitted for a few steps to a random teacher, so some sites carry signal;
each draw is a fresh probe sample from the same distribution.
"""

from __future__ import annotations

import copy
import statistics
import sys
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from growtrain.ghosts import calibrate_candidates  # noqa: E402
from growtrain.models import cifar_resnet  # noqa: E402
from growtrain.saturation import candidate_blocks, measure_saturation  # noqa: E402


def main(draws: int = 40, n: int = 256, batch: int = 64) -> None:
    torch.manual_seed(0)
    teacher = cifar_resnet(blocks=(1, 1, 1), width=8).eval()
    net = cifar_resnet(blocks=(2, 2, 2), width=8)

    def sample(m, gen):
        x = torch.randn(m, 3, 32, 32, generator=gen)
        with torch.no_grad():
            y = teacher(x).argmax(1)
        return x, y

    gen = torch.Generator().manual_seed(1)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    net.train()
    for _ in range(30):  # a little training: the network is neither random nor fitted
        x, y = sample(64, gen)
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
    net.eval()
    diffs, sds, grow = [], [], {"separate": 0, "folded": 0, "both": 0}
    for d in range(draws):
        x, y = sample(n, torch.Generator().manual_seed(100 + d))
        batches = [(x[i : i + batch], y[i : i + batch]) for i in range(0, n, batch)]
        cands = candidate_blocks(net, seed=d)
        old = copy.deepcopy(cands)
        calibrate_candidates(net, old, batches[: (n // 2) // batch])  # A = the first n/2 samples
        sep = measure_saturation(net, batches, F.cross_entropy, rule="crossfit", candidates=old, calibrate=False,
                                 projected=False)  # fmt: skip
        fold = measure_saturation(net, batches, F.cross_entropy, rule="crossfit", candidates=cands, calibrate=True,
                                  projected=False)  # fmt: skip
        for a, b in zip(sep.sites, fold.sites):
            diffs.append(b.lower - a.lower)
            sds.append(abs(a.lower))
        grow["separate"] += not sep.saturated
        grow["folded"] += not fold.saturated
        grow["both"] += (not sep.saturated) and (not fold.saturated)
    print(f"{draws} probe draws, {len(diffs) // draws} sites, n={n} in batches of {batch}")
    print(f"lower bound, folded − separate: mean {statistics.mean(diffs):+.3g}, sd {statistics.stdev(diffs):.3g}; "
          f"mean |lower| {statistics.mean(sds):.3g}")
    print(f"checks that grow: separate {grow['separate']}/{draws}, folded {grow['folded']}/{draws}, both {grow['both']}")


if __name__ == "__main__":
    main()
