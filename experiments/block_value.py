"""What one more block is worth to a converged network, per seed: the Table 1 rows built on the
full Fashion-MNIST sweep (``growtrain stopping --table=1..4 --table_controls=true``) as ground
truth for the growth decision (docs/decision.md).

    python experiments/block_value.py runs/stopping_full > docs/results/table1_full/block_value.md

Per row N and seed, on the official 10k test set, per-sample and paired (the same images):

* base − growth: the converged ``N−1`` network against itself + one block, retrained;
* base − control: against itself retrained under the same rule with no block;
* the block's own value = control − growth, with its standard error over the 10k images;
* beside it, what the block-only trial (the default decision, docs/decision.md's study: Adam,
  half an epoch, the same stage) predicted on the same base network, for the seeds the study
  ran on (seed 0: rows.jsonl; seed 1: rows_seed1.jsonl).

Only inference (three networks × 10k images per row and seed).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F


def rows_of(path: Path) -> dict:
    rows = {}
    for line in open(path):
        if line.strip():
            r = json.loads(line)
            rows[r["key"]] = r
    return rows


def test_losses(ckpt: str, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    from growtrain.module import ImageClassifier

    module = ImageClassifier.load_from_checkpoint(ckpt, map_location="cpu", weights_only=False)
    module.eval()
    out = []
    with torch.no_grad():
        for i in range(0, len(images), 1000):
            out.append(F.cross_entropy(module(images[i : i + 1000]), labels[i : i + 1000], reduction="none"))
    return torch.cat(out).double()


def test_split(root: str):
    from growtrain.data import ImageDataModule

    dm = ImageDataModule(dataset="fashion-mnist", root=root, batch_size=1000, probe_size=2000, val_size=1000, seed=0,
                         augment=False)  # fmt: skip
    dm.prepare_data()
    dm.setup("test")
    xs, ys = [], []
    for x, y in dm.test_dataloader():
        xs.append(dm.on_after_batch_transfer((x, y), 0)[0])
        ys.append(y)
    return torch.cat(xs), torch.cat(ys)


def trial_prediction(studies: list[Path], seed: int, blocks: int, stage: str) -> float | None:
    """The study's block-only test gain (% of the loss, mean over trial seeds) at ``stage`` of
    sweep seed ``seed``'s network with ``blocks`` blocks (the study names its checkpoints
    ``seed{S}_blocks{B}.ckpt``)."""
    rows = [r for study in studies if study.is_file() for r in map(json.loads, open(study))]
    gains = [r["test"]["gain_pct"] for r in rows if r.get("kind") == "block" and r.get("opt") == "adam"
             and r["ckpt"].startswith(f"seed{seed}_") and r["blocks"] == blocks
             and r["site"].startswith(stage + ".")]  # fmt: skip
    return sum(gains) / len(gains) if gains else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the stopping experiment's output_dir (runs.jsonl, checkpoints)")
    parser.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    parser.add_argument("--study", type=Path, nargs="+", help="the decision study's rows (bench/trial_study.py)",
                        default=[Path("docs/results/trial_study/rows.jsonl"), Path("docs/results/trial_study/rows_seed1.jsonl")])
    args = parser.parse_args()
    rows = rows_of(args.out / "runs.jsonl")
    images, labels = test_split(args.data)
    print("| row (site) | seed | base test loss | gain of growth: base − growth | gain of retraining alone: base − "
          "control | the block's own: control − growth (± se, z) | block-only trial's gain, same network and stage |")
    print("|---|---|---|---|---|---|---|")
    for n in range(1, 5):
        for seed in range(3):
            growth = rows.get(f"table/growth/added={n}/seed={seed}")
            control = rows.get(f"table/control/added={n - 1}/seed={seed}")
            base = rows.get(f"table/eval/added={n - 1}/seed={seed}")
            if growth is None or base is None:
                continue
            lb = test_losses(base["checkpoint"], images, labels)
            lg = test_losses(growth["checkpoint"], images, labels)
            ref = lb.mean()
            cells = [f"ResNet-8 + {n} ({growth['insertion']['site']})", str(seed), f"{ref:.4f}",
                     f"{100 * (lb - lg).mean() / ref:+.2f} %"]  # fmt: skip
            if control is not None:
                lc = test_losses(control["checkpoint"], images, labels)
                d = lc - lg
                se = d.std() / math.sqrt(len(d))
                cells += [f"{100 * (lb - lc).mean() / ref:+.2f} %",
                          f"{100 * d.mean() / ref:+.2f} % ± {100 * se / ref:.2f} % (z = {d.mean() / se:+.1f})"]  # fmt: skip
            else:
                cells += ["—", "—"]
            stage = growth["insertion"]["site"].rsplit(".", 1)[0]
            pred = trial_prediction(args.study, seed, base["blocks"], stage)
            cells.append("—" if pred is None else f"{pred:+.2f} % ({stage})")
            print("| " + " | ".join(cells) + " |")
    print("\nPercentages are of the base network's test loss; se over the 10,000 test images (paired).")


if __name__ == "__main__":
    main()
