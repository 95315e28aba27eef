"""Scratch given a growth run's compute: the ground truth of the periodic protocol's study.

For each growth row of a periodic run (the ``runs.jsonl`` of ``growtrain stopping``, e.g. of
experiments/fork_full.sh), two scratch arms are trained with the product's own code path
(``growtrain stopping`` with ``max_growths=0`` under the periodic schedule: the constant rate, then
the same final anneal of ``anneal_epochs``, reserved inside ``max_epochs``):

* the architecture growth found (its stage sizes), and
* the sweep's best depth d* (``--dstar``, stage sizes as the sweep assigns them),

each given ``max_epochs = round(F / F_epoch)`` where ``F`` is the growth run's training FLOPs
plus its checks (one forward and backward pass over the probe per check, at the depth of that
check) and ``F_epoch`` the arm's training FLOPs per epoch (3 × forward FLOPs × training images).

    python experiments/periodic_matched.py runs/periodic_full/split0 --seeds 0 1 2 --dstar 3 2 2 \\
        --data.init_args.dataset=fashion-mnist --data.init_args.root=/usr/share/datasets/fashion-mnist

Rows go to ``<folder>/matched/<arm>_<blocks>_seed<S>/runs.jsonl`` (the earliest seed-0 and
seed-1 rows: ``<arm>_<blocks>/``) (resumable: a finished row is skipped, a cut
training resumes from its last epoch checkpoint); ``<folder>/matched/plan.jsonl`` records each
arm's budget and epochs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from growtrain.callbacks.compute import forward_flops  # noqa: E402
from growtrain.module import ImageClassifier  # noqa: E402


def stage_sizes(row: dict, start=(1, 1, 1)) -> list[int]:
    """The grown network's blocks per stage: the start plus one per growth at a site of that stage."""
    sizes = list(start)
    for h in row["history"]:
        if h["action"] == "grow" and h.get("site"):
            # a stage fork grows one block at each site its fork names ("layer1.0, layer2.1, layer3.1")
            fork_site = (h.get("verdicts", {}).get("fork") or {}).get("site")
            for site in (fork_site or h["site"]).split(", "):
                sizes[int(site.split(".")[0].removeprefix("layer")) - 1] += 1
    return sizes


def per_sample_flops(blocks, shape=(1, 1, 28, 28), width=8) -> int:
    model = ImageClassifier(arch="cifar_resnet", blocks=list(blocks), width=width, family="basic", in_channels=1,
                            num_classes=10)  # fmt: skip
    return forward_flops(model, torch.zeros(shape))


def growth_flops(row: dict, probe_size: int, start=(1, 1, 1)) -> float:
    """Training FLOPs plus the checks: 3 × forward × probe size per check at that check's depth."""
    sizes, checks = list(start), 0.0
    for h in row["history"]:
        if h["action"] != "budget" or h.get("gamma") is not None:  # a budget check without a probe costs nothing
            checks += 3.0 * per_sample_flops(sizes) * probe_size
        if h["action"] == "grow" and h.get("site"):
            sizes[int(h["site"].split(".")[0].removeprefix("layer")) - 1] += 1
    return float(row["flops"]) + checks


def train_scratch(out: Path, name: str, *, seed: int, epochs: int, sizes: list[int], config: str,
                  overrides: list[str]) -> None:  # fmt: skip
    """One scratch arm: ``growtrain stopping`` with ``max_growths=0`` under the config's schedule (the
    constant rate, then its final anneal) for ``epochs`` epochs, into ``out/name`` (resumable)."""
    cb = "--trainer.callbacks.init_args"
    cmd = ["growtrain", "stopping", "--config", config, "--skip_scratch=true", f"--seeds=[{seed}]",
           f"--output_dir={out / name}", f"--trainer.default_root_dir={out / name}",
           f"--trainer.max_epochs={epochs}", f"--model.init_args.blocks=[{','.join(map(str, sizes))}]",
           f"{cb}.max_growths=0", f"{cb}.schedule.every_n_epochs=1000", f"{cb}.schedule.min_steps_between_checks=null",
           *overrides]  # fmt: skip
    print(" ".join(cmd), flush=True)
    with open(out / f"{name}.log", "a") as log:
        subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="a periodic growth run's output folder (with runs.jsonl)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--dstar", type=int, nargs=3, default=[3, 2, 2], help="d*'s stage sizes (full data: 7 blocks)")
    parser.add_argument("--train-images", type=int, default=57000, help="training images per epoch")
    parser.add_argument("--probe-size", type=int, default=2000)
    parser.add_argument("--arms", nargs="+", default=["found", "dstar"])
    parser.add_argument("--config", default="configs/fmnist/periodic.yaml")
    args, overrides = parser.parse_known_args()  # anything else: growtrain overrides (--data.init_args...)
    folder = Path(args.folder)
    rows = {json.loads(line)["seed"]: json.loads(line) for line in open(folder / "runs.jsonl")}
    out = folder / "matched"
    out.mkdir(exist_ok=True)
    for seed in args.seeds:
        row = rows[seed]
        budget = growth_flops(row, args.probe_size)
        for arm in args.arms:
            sizes = stage_sizes(row) if arm == "found" else list(args.dstar)
            per_epoch = 3.0 * per_sample_flops(sizes) * args.train_images
            epochs = max(6, round(budget / per_epoch))
            # one folder per arm and seed: two seeds' d* arms differ in max_epochs (their own budgets),
            # and a stopping folder holds one configuration
            name = f"{arm}_{'-'.join(map(str, sizes))}_seed{seed}"
            plan = {"seed": seed, "arm": arm, "blocks": sizes, "folder": name, "budget_flops": budget,
                    "growth_train_flops": row["flops"], "epoch_flops": per_epoch, "max_epochs": epochs,
                    "growth_blocks": row["blocks"], "growth_test_loss": row["test_loss"]}  # fmt: skip
            with open(out / "plan.jsonl", "a") as f:
                f.write(json.dumps(plan) + "\n")
            train_scratch(out, name, seed=seed, epochs=epochs, sizes=sizes, config=args.config, overrides=overrides)


if __name__ == "__main__":
    main()
