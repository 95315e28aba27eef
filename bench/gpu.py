"""GPU check: growth on CUDA, probe cost, retained memory, Lightning throughput.

    python bench/gpu.py                          # on a CUDA machine, < 5 minutes; writes bench/gpu.json
    python bench/gpu.py --device cpu --quick     # tiny smoke run (CI runs it on CPU)

What it checks (one JSON, keys in brackets):

[fit]        a quickstart-like fit (``ImageClassifier`` + ``ImageDataModule`` + ``GrowUntilSaturated``,
             ``Trainer(accelerator="gpu")``) in precision 32-true and bf16-mixed. Growth is forced
             (``rule="paper", t=1e-9``: every check grows, ``max_growths=2``) so that the check tests
             that probe, growth and optimizer reconfiguration run on the device, not the decision's
             power; and ``decision="stage_fork"`` (the paired fork's arm, cooled copies and forked
             generators on the device; growth not forced). Then the checkpoint is reloaded and its
             outputs compared with the live model's.
[probe]      probe time and peak memory as ratios to one train-mode forward+backward over the same
             samples in the same batches (cuda events / perf_counter, ``max_memory_allocated`` above
             the memory held before; median of 3 interleaved repeats), per rule: preact and basic
             ``cifar_resnet`` width 64, blocks (4,4,4) (13 sites), 1,024 32x32 images; a decoder of
             GPT-2-small dimensions (12 layers, d_model 768, 12 heads, context 1024, vocab 50257,
             64 sequences) under bf16 autocast. Target: <= 1.5x time and memory for the
             decision path (``projected=False``); ``projected=True`` is reported for reference.
[precision]  Γ̂ per site and per-sample probe losses under bf16 and fp16 autocast against fp32 on
             one trained network: the relative differences, and whether the best site is the same.
[retained]   memory held after N repeated ``measure_saturation`` calls on one network
             (``memory_allocated`` before/after, CUDA) and probe activations still alive
             (weak references, any device). Target: 0.
[amp]        the block trial in 32-true, 16-mixed (its loss scaled) and bf16-mixed, and per-sample
             losses with ignored targets (-100) against one call per sequence.
[bad_input]  probe batches on the host for a network on the device are moved (same report as
             batches on the device); a network split across two devices is refused by name.
[cli]        ``growtrain fit --config configs/quickstart.yaml`` and ``configs/gpt.yaml`` with
             ``--trainer.accelerator=gpu`` in 32-true and bf16-mixed, shortened (not with --quick).
[throughput] step time of a Lightning fit vs a plain PyTorch loop, quickstart network (ResNet-8
             width 16, batch 128, the same batches already on the device, SGD), median of 3
             interleaved repeats; and host synchronisations per Lightning step
             (``torch.cuda.set_sync_debug_mode``, CUDA only). Target: >= 0.85x on a GPU.

Sizes shrink with ``--quick``; a section over the time budget is skipped and says so.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
import weakref
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402
from lightning.pytorch.utilities.warnings import PossibleUserWarning  # noqa: E402

from growtrain import GrowUntilSaturated, ImageClassifier, StageFork, Trial, measure_saturation  # noqa: E402
from growtrain.data import ImageDataModule  # noqa: E402
from growtrain.lm import token_cross_entropy  # noqa: E402
from growtrain.models import cifar_resnet  # noqa: E402
from growtrain.models.gpt import GPT, GPTConfig  # noqa: E402
from growtrain.optim import param_groups  # noqa: E402
from growtrain.decision import RULES  # noqa: E402


# -- timing and memory on either device ----------------------------------------------------------
class Clock:
    """Elapsed seconds of a region: CUDA events on a GPU, perf_counter on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.end.record()
            torch.cuda.synchronize()
            self.seconds = self.start.elapsed_time(self.end) / 1000
        else:
            self.seconds = time.perf_counter() - self.t0


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measured(fn, device: torch.device) -> tuple[float, int | None]:
    """``(seconds, peak bytes above what was allocated before)``; memory is CUDA only."""
    gc.collect()
    if device.type == "cuda":
        sync(device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    with Clock(device) as clock:
        fn()
    peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else None
    return clock.seconds, peak


# -- (a) fit in two precisions, checkpoint reload ----------------------------------------------------
class WhereAtEnd(L.Callback):
    """Devices of all parameters and dtypes of the grown blocks' parameters when training ends
    (Lightning moves the module back to the CPU afterwards)."""

    def on_train_end(self, trainer, pl_module):
        from growtrain import grown_blocks

        self.devices = sorted({str(p.device) for p in pl_module.parameters()})
        self.grown_dtypes = sorted({str(p.dtype) for b in grown_blocks(pl_module.network) for p in b.parameters()})


def fit_check(args, device, precision: str, root: Path, decision: str = "rule") -> dict:
    L.seed_everything(0, verbose=False)
    size, width = (8, 4) if args.quick else (32, 16)
    dm = ImageDataModule(dataset="synthetic", image_size=size, synthetic_size=200 if args.quick else 6000,
                         synthetic_classes=10, probe_size=32 if args.quick else 500, val_size=32 if args.quick else 500,
                         batch_size=32 if args.quick else 128)  # fmt: skip
    module = ImageClassifier(width=width, num_classes=10)
    # schedule="periodic": a check at the end of every epoch (no plateau wait).
    # decision="rule" with t≈0: this checks the growth mechanics on the device, so every check grows
    options = dict(rule="paper", t=1e-9, decision="rule", max_growths=2, schedule="periodic", verbose=False)
    if decision != "rule":
        # the paired fork's path on the device: the arm, its cooled copies, the forked generators
        # (CUDA's too) and the shared head's gradients. Growth is not forced: min_gain=0 grows when
        # the cooled arm scores lower at all, and the row reports what it decided.
        options.update(decision={"trial": Trial, "stage_fork": StageFork}[decision](min_gain=0.0))
    grow = GrowUntilSaturated(**options)
    where = WhereAtEnd()
    trainer = L.Trainer(accelerator=args.accelerator, devices=1, precision=precision, max_epochs=3,
                        callbacks=[grow, where], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=root,
                        limit_train_batches=2 if args.quick else 1.0, limit_val_batches=2)  # fmt: skip
    start = time.perf_counter()
    trainer.fit(module, dm)
    seconds = time.perf_counter() - start
    path = root / f"fit-{decision}-{precision}.ckpt"
    trainer.save_checkpoint(path)
    reloaded = ImageClassifier.load_from_checkpoint(path, map_location=device)
    x = next(iter(dm.val_dataloader()))[0].to(device)
    module.to(device).eval()
    reloaded.eval()
    cudnn = torch.backends.cudnn.deterministic
    torch.backends.cudnn.deterministic = True  # the same kernels for both forwards
    try:
        with torch.no_grad():
            a, b = module(x), reloaded(x)
    finally:
        torch.backends.cudnn.deterministic = cudnn
    diff = float((a - b).abs().max())
    return {
        "precision": precision,
        "decision": decision,
        "actions": [entry.get("action") for entry in grow.history],
        "grew": len(module.network.growth_log),
        "depth": module.network.depth(),
        "checks": grow.checks,
        "reloaded_depth": reloaded.network.depth(),
        "reload_max_abs_diff": diff,
        "reload_identical": diff == 0.0 and reloaded.network.depth() == module.network.depth(),
        # Where the (grown) network lived at the end of the fit, before Lightning's teardown.
        "param_devices": where.devices,
        "grown_block_dtypes": where.grown_dtypes,
        "fit_seconds": round(seconds, 2),
        "probe_seconds": round(grow.probe_seconds, 3),
    }


# -- (b) probe cost vs a training step ---------------------------------------------------------------
def train_pass(net, batches, loss_fn, autocast_dtype, device):
    net.train()
    for x, y in batches:
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            loss = loss_fn(net(x), y)
        loss.backward()
    net.zero_grad(set_to_none=True)


def probe_ratios(name, net, batches, loss_fn, device, args, autocast_dtype=None) -> list[dict]:
    variants = [(rule, False) for rule in RULES] + [("paper", True)]
    rows = []
    bn_state = copy.deepcopy(net.state_dict())  # the training passes move BN running statistics
    train = {"time": [], "mem": []}
    probe = {v: {"time": [], "mem": [], "error": None} for v in variants}
    for repeat in range(0 if args.quick else -1, args.repeats):  # -1: an untimed warm-up (CUDA, cuDNN)
        seconds, peak = measured(lambda: train_pass(net, batches, loss_fn, autocast_dtype, device), device)
        net.load_state_dict(bn_state)
        if repeat >= 0:
            train["time"].append(seconds)
            train["mem"].append(peak)
        for rule, projected in variants:
            if probe[(rule, projected)]["error"]:
                continue
            try:
                seconds, peak = measured(
                    lambda: measure_saturation(net, batches, loss_fn, rule=rule, projected=projected,
                                               autocast_dtype=autocast_dtype), device)  # fmt: skip
            except Exception as error:  # report it, keep measuring the others
                probe[(rule, projected)]["error"] = f"{type(error).__name__}: {error}"[:300]
                continue
            if repeat >= 0:
                probe[(rule, projected)]["time"].append(seconds)
                probe[(rule, projected)]["mem"].append(peak)
    t_train = statistics.median(train["time"])
    m_train = statistics.median(train["mem"]) if train["mem"][0] is not None else None
    for (rule, projected), p in probe.items():
        row = {"network": name, "rule": rule, "projected": projected, "sites": len(net.sites()),
               "samples": sum(len(y) for _, y in batches), "train_seconds": round(t_train, 4),
               "train_peak_bytes": m_train, "error": p["error"]}  # fmt: skip
        if p["time"]:
            t = statistics.median(p["time"])
            row.update(probe_seconds=round(t, 4), time_ratio=round(t / t_train, 2))
            if m_train:
                m = statistics.median(p["mem"])
                row.update(probe_peak_bytes=m, memory_ratio=round(m / m_train, 2))
        rows.append(row)
    return rows


def image_batches(n, batch, size, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, size, size, generator=gen)
    y = torch.randint(0, 10, (n,), generator=gen)
    return [(x[i : i + batch].to(device), y[i : i + batch].to(device)) for i in range(0, n, batch)]


def probe_section(args, device) -> tuple[list[dict], list[str]]:
    notes, rows = [], []
    width, blocks, n, size = (4, (1, 1, 1), 32, 8) if args.quick else (64, (4, 4, 4), 1024, 32)
    for family in ("preact", "basic"):
        torch.manual_seed(0)
        net = cifar_resnet(blocks, width=width, family=family).to(device)
        rows += probe_ratios(f"{family} w{width} {blocks}", net, image_batches(n, args.probe_batch, size, device),
                             F.cross_entropy, device, args)  # fmt: skip
        del net
    if args.quick:
        cfg, seqs, batch = GPTConfig(n_layer=1, d_model=16, n_head=2, block_size=8, vocab_size=32), 8, 4
    else:
        cfg, seqs, batch = GPTConfig(n_layer=12, d_model=768, n_head=12, block_size=1024, vocab_size=50257), 64, 8
    if time.perf_counter() - args.start > args.budget * 0.6:
        notes.append("decoder probe skipped: over 60% of the time budget already spent")
        return rows, notes
    torch.manual_seed(0)
    net = GPT(cfg).to(device)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (seqs, cfg.block_size + 1), generator=gen)
    batches = [(tokens[i : i + batch, :-1].to(device), tokens[i : i + batch, 1:].to(device))
               for i in range(0, seqs, batch)]  # fmt: skip
    dtype = torch.bfloat16 if device.type == "cuda" or not args.quick else None
    rows += probe_ratios(f"gpt L{cfg.n_layer} d{cfg.d_model} T{cfg.block_size}", net, batches, token_cross_entropy,
                         device, args, autocast_dtype=dtype)  # fmt: skip
    return rows, notes


# -- (b2) the checks' numbers in mixed precision against fp32 -----------------------------------------
def precision_section(args, device) -> dict:
    """Γ̂ per site, the site ranking and the per-sample probe losses (what the fork and the trial
    compare) under bf16 and fp16 autocast, against fp32 on the same network and probe. A trained
    network is what checks see: a few SGD steps first, so the gradients are not an init's."""
    width, blocks, n, size = (4, (1, 1, 1), 64, 8) if args.quick else (32, (2, 2, 2), 2048, 32)
    torch.manual_seed(0)
    net = cifar_resnet(blocks, width=width, family="preact").to(device)
    batches = image_batches(n, args.probe_batch, size, device)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    net.train()
    for _ in range(3):
        for x, y in batches:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(net(x), y).backward()
            opt.step()
    net.eval()

    def numbers(dtype):
        report = measure_saturation(net, batches, F.cross_entropy, rule="paper", projected=False, autocast_dtype=dtype)
        with torch.no_grad(), torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            losses = torch.cat([F.cross_entropy(net(x), y, reduction="none").float() for x, y in batches])
        return {s: report.record(s).grad_norm for s in net.sites()}, losses

    gamma32, loss32 = numbers(None)
    out = {"network": f"preact w{width} {blocks}", "samples": n, "sites": len(gamma32)}
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    for name, dtype in dtypes.items():
        try:
            gamma, loss = numbers(dtype)
        except Exception as error:  # fp16 autocast is not on every CPU build: report it
            out[name] = {"error": f"{type(error).__name__}: {error}"[:300]}
            continue
        rel = max(abs(gamma[s] - gamma32[s]) / max(abs(gamma32[s]), 1e-12) for s in gamma32)
        out[name] = {
            "gamma_max_rel_diff": round(rel, 4),
            "best_site_same": max(gamma, key=gamma.get) == max(gamma32, key=gamma32.get),
            "loss_mean_rel_diff": round(float((loss.mean() - loss32.mean()).abs() / loss32.mean()), 5),
            "loss_per_sample_max_abs_diff": round(float((loss - loss32).abs().max()), 4),
        }
    return out


# -- (c) retained memory after repeated checks --------------------------------------------------------
def retained_section(args, device) -> dict:
    width, blocks, n, size, calls = (4, (1, 1, 1), 32, 8, 2) if args.quick else (64, (4, 4, 4), 1024, 32, 8)
    torch.manual_seed(0)
    net = cifar_resnet(blocks, width=width, family="preact").to(device)
    batches = image_batches(n, args.probe_batch, size, device)
    refs: list[weakref.ref] = []

    def record(module, inputs, output):
        if not module.training and torch.is_grad_enabled():  # probe passes only
            refs.append(weakref.ref(output))

    handles = [b.register_forward_hook(record) for s in net.growable_stages for b in net.stage(s)]
    out = {}
    try:
        for rule in ("paper", "crossfit"):
            measure_saturation(net, batches, F.cross_entropy, rule=rule)  # warm-up (cuDNN, allocator)
            gc.collect()
            sync(device)
            before = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
            refs.clear()
            for _ in range(calls):
                measure_saturation(net, batches, F.cross_entropy, rule=rule)
            gc.collect()
            sync(device)
            after = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
            out[rule] = {
                "calls": calls,
                "bytes_before": before,
                "bytes_after": after,
                "retained_bytes_per_call": None if before is None else (after - before) / calls,
                "recorded_activations": len(refs),
                "leaked_tensors": sum(r() is not None for r in refs),
            }
    finally:
        for h in handles:
            h.remove()
    return out


# -- bad input: batches elsewhere are moved, a split network is refused ----------------------------
def amp_section(args, device, root: Path) -> dict:
    """The block trial under each mixed precision on the device (16-mixed: the trial's loss scaled
    by its own GradScaler, as the run's is), and per-sample losses with ignored targets (-100)
    against one call per sequence (vmap's loss rule is bypassed for them: on a GPU it would assert)."""
    from growtrain.batches import sample_loss_terms

    out = {}
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 16, 50, generator=g).to(device)
    tokens = torch.randint(0, 50, (4, 16), generator=g).to(device)
    tokens[0, 10:] = -100
    terms = sample_loss_terms(logits, tokens, token_cross_entropy)
    by_hand = torch.stack([F.cross_entropy(logits[i][tokens[i] >= 0], tokens[i][tokens[i] >= 0]) for i in range(4)])
    out["ignored_targets_max_abs_diff"] = float((terms.to(by_hand.device) - by_hand.double()).abs().max())
    for precision in ("32-true", "16-mixed", "bf16-mixed"):
        L.seed_everything(0)
        size = 8 if args.quick else 32
        dm = ImageDataModule(dataset="synthetic", image_size=size, synthetic_size=400 if args.quick else 4000,
                             synthetic_classes=10, probe_size=64 if args.quick else 1000, val_size=32,
                             batch_size=32 if args.quick else 128)  # fmt: skip
        grow = GrowUntilSaturated(schedule="periodic", decision="trial", max_growths=1, verbose=False)
        trainer = L.Trainer(accelerator=args.accelerator, devices=1, precision=precision, max_epochs=2,
                            callbacks=[grow], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, default_root_dir=root, limit_val_batches=0)  # fmt: skip
        try:
            trainer.fit(ImageClassifier(width=4 if args.quick else 16, num_classes=10), dm)
        except Exception as error:  # report it, go on with the next precision
            out[precision] = {"error": f"{type(error).__name__}: {error}"[:300]}
            continue
        trials = [t for h in grow.history for t in (h.get("trial") or {}).get("trials", [])]
        out[precision] = {"actions": [h["action"] for h in grow.history],
                          "diverged": sum(bool(t.get("diverged")) for t in trials), "trials": len(trials),
                          "gains_pct": [round(100 * t["gain_frac"], 3) for t in trials if "gain_frac" in t]}  # fmt: skip
    return out


def bad_input_section(args, device) -> dict:
    torch.manual_seed(0)
    net = cifar_resnet((1, 1, 1), width=4, family="preact").to(device)
    host = image_batches(32, 16, 8, torch.device("cpu"))
    on_device = [(x.to(device), y.to(device)) for x, y in host]
    a = measure_saturation(net, host, F.cross_entropy, rule="paper")
    b = measure_saturation(net, on_device, F.cross_entropy, rule="paper")
    other = "cpu" if device.type == "cuda" else "meta"
    net.layer3.to(other)
    try:
        measure_saturation(net, on_device, F.cross_entropy)
        split_error = None
    except ValueError as error:
        split_error = str(error)
    return {
        # (a tolerance: GPU reductions need not be bitwise reproducible between calls)
        "host_batches_moved": a.n == b.n and abs(a.gamma - b.gamma) <= 1e-5 * max(abs(b.gamma), 1e-12),
        "split_network_error": split_error,
        "split_error_names_both": split_error is not None and str(device) in split_error and other in split_error,
    }


# -- (d) Lightning vs a plain loop -----------------------------------------------------------------
class DeviceBatches:
    """The same pre-made batches (already on the device) for both arms, re-iterable."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)

    def __len__(self):
        return len(self.batches)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=5e-4)


class StepTimer(L.Callback):
    """Time from the start of batch ``warmup`` to the end of the last batch; then count host
    synchronisations on ``extra`` more steps (CUDA's sync debug mode; each one warns)."""

    def __init__(self, warmup: int, timed: int, extra: int, device: torch.device):
        self.warmup, self.timed, self.extra, self.device = warmup, timed, extra, device
        self.t0 = self.seconds = None
        self.sync_warnings = None
        self._catcher = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.warmup:
            sync(self.device)
            self.t0 = time.perf_counter()
        if batch_idx == self.warmup + self.timed and self.device.type == "cuda":
            self._catcher = warnings.catch_warnings(record=True)
            self._caught = self._catcher.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == self.warmup + self.timed - 1:
            sync(self.device)
            self.seconds = time.perf_counter() - self.t0
        if batch_idx == self.warmup + self.timed + self.extra - 1:
            self._stop()

    def on_train_end(self, trainer, pl_module):
        self._stop()

    def _stop(self):
        if self._catcher is not None:
            torch.cuda.set_sync_debug_mode("default")
            self._catcher.__exit__(None, None, None)
            self._catcher = None
            self.sync_warnings = [str(w.message).splitlines()[0][:160] for w in self._caught]


def plain_steps(net, batches, warmup, device) -> float:
    net.train()
    optimizer = sgd(param_groups(net))
    for i, (x, y) in enumerate(batches):
        if i == warmup:
            sync(device)
            t0 = time.perf_counter()
        loss = F.cross_entropy(net(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    sync(device)
    return time.perf_counter() - t0


def throughput_section(args, device, root: Path) -> dict:
    warmup, timed, extra = (1, 3, 1) if args.quick else (20, 100, 10)
    size, width, batch = (8, 4, 32) if args.quick else (32, 16, 128)
    torch.manual_seed(0)
    net0 = cifar_resnet((1, 1, 1), width=width, family="basic").to(device)
    all_batches = image_batches((warmup + timed + extra) * batch, batch, size, device)
    light, plain, syncs = [], [], None
    for _ in range(args.repeats):
        timer = StepTimer(warmup, timed, extra, device)
        trainer = L.Trainer(accelerator=args.accelerator, devices=1, max_epochs=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[timer], default_root_dir=root, num_sanity_val_steps=0)  # fmt: skip
        with warnings.catch_warnings():  # training steps only: no validation here, on purpose
            warnings.filterwarnings("ignore", message="You defined a `validation_step` but have no `val_dataloader`",
                                    category=PossibleUserWarning)  # fmt: skip
            trainer.fit(ImageClassifier(copy.deepcopy(net0), num_classes=10, optimizer=sgd),
                        train_dataloaders=DeviceBatches(all_batches))  # fmt: skip
        light.append(timer.seconds / timed)
        if timer.sync_warnings is not None:
            syncs = timer.sync_warnings
        plain.append(plain_steps(copy.deepcopy(net0), all_batches[: warmup + timed], warmup, device) / timed)
    result = {
        "network": f"cifar_resnet (1,1,1) basic w{width}, batch {batch}, {size}x{size}",
        "lightning_step_ms": round(1000 * statistics.median(light), 3),
        "plain_step_ms": round(1000 * statistics.median(plain), 3),
        "throughput_ratio": round(statistics.median(p / q for p, q in zip(plain, light)), 3),
        "lightning_all_ms": [round(1000 * s, 3) for s in light],
        "plain_all_ms": [round(1000 * s, 3) for s in plain],
    }
    if syncs is not None:
        result["host_syncs_per_step"] = len(syncs) / extra
        result["host_sync_examples"] = sorted(set(syncs))[:5]
    return result


# -- (e) the CLI configs on the device -----------------------------------------------------------------
CLI_RUNS = {
    "quickstart": ("configs/quickstart.yaml", ["--trainer.max_epochs=4"]),
    "gpt": ("configs/gpt.yaml", ["--trainer.max_epochs=2", "--trainer.limit_train_batches=20"]),
}


def cli_section(args, device, root: Path) -> dict:
    """``growtrain fit --config ... --trainer.accelerator=<device>`` in 32-true and bf16-mixed,
    shortened; each in a fresh process, so a section over the budget stops early."""
    repo = Path(__file__).resolve().parents[1]
    out = {}
    for name, (config, extra) in CLI_RUNS.items():
        for precision in ("32-true", "bf16-mixed"):
            left = args.budget - (time.perf_counter() - args.start)
            key = f"{name} {precision}"
            if left < 20:
                out[key] = {"skipped": "over the time budget"}
                continue
            command = [sys.executable, "-m", "growtrain.cli", "fit", "--config", str(repo / config),
                       f"--trainer.accelerator={args.accelerator}", f"--trainer.precision={precision}",
                       f"--trainer.default_root_dir={root / 'cli' / name / precision}", *extra]  # fmt: skip
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(command, cwd=repo, capture_output=True, text=True, timeout=left)
                out[key] = {"returncode": proc.returncode, "seconds": round(time.perf_counter() - t0, 1)}
                if proc.returncode != 0:
                    out[key]["stderr_tail"] = proc.stderr[-1500:]
            except subprocess.TimeoutExpired:
                out[key] = {"returncode": None, "timeout_s": round(left, 1)}
    return out


# -- main -------------------------------------------------------------------------------------------
def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a CPU smoke test)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "gpu.json")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--probe-batch", type=int, default=None, help="probe/training batch (default 256; quick 16)")
    parser.add_argument("--budget", type=float, default=280.0, help="seconds; later sections are skipped past it")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on a CPU (the smoke test)")
    parser.add_argument("--only", nargs="*", default=None,
                        help="sections to run (default: all; with --quick all but cli, which runs full configs)")
    args = parser.parse_args(argv)
    args.start = time.perf_counter()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible; use --device cpu --quick for the smoke test")
    args.accelerator = "gpu" if device.type == "cuda" else "cpu"
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    args.probe_batch = args.probe_batch or (16 if args.quick else 256)
    if args.quick:
        args.repeats = min(args.repeats, 1)
    if args.only is None:
        args.only = ["fit", "probe", "precision", "retained", "bad_input", "amp", "throughput"] + ([] if args.quick else ["cli"])
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*isinstance.*LeafSpec.*")

    result: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "quick": args.quick,
        "torch": torch.__version__,
        "lightning": L.__version__,
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "notes": [],
    }
    # Objects alive now (modules, imports) are never garbage: keep them out of the collections
    # the measurements run, which would otherwise take seconds each after importing Lightning.
    gc.freeze()
    try:
        _run_sections(args, device, result)
    finally:
        gc.unfreeze()
    result["total_seconds"] = round(time.perf_counter() - args.start, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    summary(result)
    print(f"wrote {args.out}")
    return result


def _run_sections(args, device, result: dict) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        sections = [
            ("fit", lambda: {f"{d}:{p}" if d != "rule" else p: fit_check(args, device, p, root, d)
                             for d in ("rule", "stage_fork") for p in ("32-true", "bf16-mixed")}),
            ("probe", lambda: probe_section(args, device)),
            ("precision", lambda: precision_section(args, device)),
            ("retained", lambda: retained_section(args, device)),
            ("bad_input", lambda: bad_input_section(args, device)),
            ("amp", lambda: amp_section(args, device, root)),
            ("throughput", lambda: throughput_section(args, device, root)),
            ("cli", lambda: cli_section(args, device, root)),
        ]
        for name, run in sections:
            if name not in args.only:
                continue
            if time.perf_counter() - args.start > args.budget:
                result["notes"].append(f"{name}: skipped, over the {args.budget:.0f} s budget")
                continue
            t0 = time.perf_counter()
            value = run()
            if name == "probe":
                value, notes = value
                result["notes"] += notes
            result[name] = value
            result[f"{name}_seconds"] = round(time.perf_counter() - t0, 1)


def summary(result: dict) -> None:
    print(f"device {result['device']}, torch {result['torch']}, lightning {result['lightning']}, "
          f"{result['total_seconds']} s{' (quick)' if result['quick'] else ''}")  # fmt: skip
    for precision, run in result.get("fit", {}).items():
        print(f"  fit {precision:21s}: grew {run['grew']} in {run['checks']} checks {run['actions']}, reload identical "
              f"{run['reload_identical']} (max |diff| {run['reload_max_abs_diff']:.3g}), "
              f"{run['fit_seconds']} s")  # fmt: skip
    for row in result.get("probe", []):
        if row.get("error"):
            print(f"  probe {row['network']:28s} {row['rule']:9s} projected={row['projected']!s:5s}: {row['error']}")
            continue
        mem = f", memory {row['memory_ratio']}x" if "memory_ratio" in row else ""
        print(f"  probe {row['network']:28s} {row['rule']:9s} projected={row['projected']!s:5s}: "
              f"time {row['time_ratio']}x{mem} a train fwd+bwd")  # fmt: skip
    prec = result.get("precision", {})
    for name in ("bf16", "fp16"):
        if name in prec:
            print(f"  precision {name}: {prec[name]}")
    for rule, r in result.get("retained", {}).items():
        per_call = r["retained_bytes_per_call"]
        mem = "" if per_call is None else f", {per_call / 2**20:.2f} MiB retained per call"
        print(f"  retained {rule:9s}: {r['leaked_tensors']} of {r['recorded_activations']} probe activations alive "
              f"after {r['calls']} calls{mem}")  # fmt: skip
    if "amp" in result:
        print(f"  amp: {result['amp']}")
    if "bad_input" in result:
        bad = result["bad_input"]
        print(f"  bad input: host batches moved {bad['host_batches_moved']}, split network refused naming both "
              f"devices {bad['split_error_names_both']}")  # fmt: skip
    if "throughput" in result:
        t = result["throughput"]
        syncs = f", {t['host_syncs_per_step']} host syncs per step" if "host_syncs_per_step" in t else ""
        print(f"  throughput: Lightning {t['lightning_step_ms']} ms/step, plain {t['plain_step_ms']} ms/step, "
              f"ratio {t['throughput_ratio']} (target >= 0.85 on a GPU){syncs}")  # fmt: skip
    for key, run in result.get("cli", {}).items():
        print(f"  growtrain fit {key:22s}: {run}" if "stderr_tail" not in run else
              f"  growtrain fit {key:22s}: FAILED (rc {run['returncode']}), stderr tail in the JSON")  # fmt: skip
    for note in result["notes"]:
        print(f"  note: {note}")


if __name__ == "__main__":
    main()
