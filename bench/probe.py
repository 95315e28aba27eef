"""Cost of the joint probe pass relative to one plain training forward+backward.

    python bench/probe.py                      # cifar_resnet (4,4,4) w=16, 13 sites, n=256
    python bench/probe.py --family basic --n 256 --repeats 5
    python bench/probe.py --ops check_crossfit check_gain check_gain_ddp --repeats 7   # min_gain's cost
    python bench/probe.py --ops check_gain check_gain_projected --repeats 5              # the callback's check
    python bench/probe.py --family gpt --ops check_gain check_gain_projected --repeats 5  # a GPT decoder

Each figure is the median over ``--repeats`` interleaved runs in this one process (ratios, not
absolute times, are what transfer between machines), in wall time and in this process's CPU
time (the steadier one on a shared machine). Peak memory is the rise of the process's peak
resident set (``VmHWM``, reset through ``/proc/self/clear_refs`` before each operation) over
its resident set just before the operation (Linux only).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import subprocess
import sys
import time

import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))

from growtrain.lm import token_cross_entropy  # noqa: E402
from growtrain.models import cifar_resnet, gpt  # noqa: E402
from growtrain.saturation import candidate_blocks, measure_saturation  # noqa: E402
from growtrain.callbacks.probe_data import ProbeView, per_sample_losses  # noqa: E402


def build(args):
    torch.manual_seed(0)
    if args.family == "gpt":
        # a GPT-2-style decoder; a sample is one sequence of --context tokens
        net = gpt(n_layer=args.layers, d_model=args.d_model, n_head=args.d_model // 64, block_size=args.context,
                  vocab_size=args.vocab)  # fmt: skip
        tokens = torch.randint(0, args.vocab, (args.n, args.context + 1))
        x, y = tokens[:, :-1], tokens[:, 1:]
    else:
        net = cifar_resnet(blocks=tuple(args.blocks), width=args.width, family=args.family)
        x = torch.randn(args.n, 3, 32, 32)
        y = torch.randint(0, 10, (args.n,))
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch)
    return net, x, y, loader


def loss_of(args):
    return token_cross_entropy if args.family == "gpt" else F.cross_entropy


def op_train(net, x, y, loader, args):
    net.train()
    for xb, yb in loader:
        net.zero_grad(set_to_none=True)
        loss_of(args)(net(xb), yb).backward()


def op_probe(projected, calibrate, rule="paper", **kw):
    def run(net, x, y, loader, args):
        measure_saturation(net, loader, loss_of(args), projected=projected, calibrate=calibrate, rule=rule, **kw)

    return run


def op_check_gain(net, x, y, loader, args):
    """The default check on one process: the cross-fit pass, keeping each sample's loss (min_gain)."""
    measure_saturation(net, loader, loss_of(args), projected=False, calibrate=True, rule="crossfit",
                       sample_losses=[])  # fmt: skip


def op_check_gain_projected(net, x, y, loader, args):
    """The default check with ``projected=True`` (V_S's Gram matrices in the same pass)."""
    measure_saturation(net, loader, loss_of(args), projected=True, calibrate=True, rule="crossfit",
                       sample_losses=[])  # fmt: skip


def op_check_gain_ddp(net, x, y, loader, args):
    """Under DDP: the cross-fit pass on the rank's shard plus one forward over the whole probe."""
    measure_saturation(net, loader, loss_of(args), projected=False, calibrate=True, rule="crossfit")
    per_sample_losses(ProbeView(net, net), loader, loss_of(args), torch.device("cpu"))


def op_naive(net, x, y, loader, args):
    """One forward+backward per site with that site's block really inserted (ĝ only)."""
    blocks = candidate_blocks(net)
    for site in net.sites():
        grown = copy.deepcopy(net).eval()
        block = grown.grow(site, block=copy.deepcopy(blocks[site.name]))
        params = block.terminal_parameters()
        for xb, yb in loader:
            torch.autograd.grad(loss_of(args)(grown(xb), yb), params)


OPS = {
    "train_step": op_train,
    "probe_decision": op_probe(projected=False, calibrate=False),
    "probe_decision_calibrated": op_probe(projected=False, calibrate=True),
    "probe_projected": op_probe(projected=True, calibrate=False),
    # the callback's check: cross-fit, and the default (cross-fit + min_gain's per-sample losses)
    "check_crossfit": op_probe(projected=False, calibrate=True, rule="crossfit"),
    "check_gain": op_check_gain,  # the default (cross-fit + min_gain's losses from the same pass)
    "check_gain_projected": op_check_gain_projected,  # ... with projected=True
    # the cross-fit check with σ̂² (variance=True): every per-sample gradient formed, as before the cost work
    "check_crossfit_variance": op_probe(projected=False, calibrate=True, rule="crossfit", variance=True),
    "check_gain_ddp": op_check_gain_ddp,  # ... under DDP: + one forward pass over the whole probe
    "naive_per_site": op_naive,
}


def _status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_memory(name, args):
    """KiB by which operation ``name`` raises the peak resident set of a fresh process."""
    cmd = [sys.executable, __file__, "--memory-of", name, "--blocks", *map(str, args.blocks), "--width",
           str(args.width), "--family", args.family, "--n", str(args.n), "--batch", str(args.batch),
           "--layers", str(args.layers), "--d-model", str(args.d_model), "--context", str(args.context),
           "--vocab", str(args.vocab)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return int(out.strip().splitlines()[-1])


def memory_child(args):
    state = build(args)
    base = _status_kib("VmHWM")
    OPS[args.memory_of](*state, args)
    print(_status_kib("VmHWM") - base)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, nargs=3, default=[4, 4, 4])
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--family", default="preact", choices=["preact", "basic", "gpt"])
    p.add_argument("--n", type=int, default=None, help="probe samples (default 256 images, 32 sequences)")
    p.add_argument("--batch", type=int, default=None, help="default 128 images, 16 sequences")
    p.add_argument("--layers", type=int, default=4, help="gpt: decoder layers (sites = layers + 1)")
    p.add_argument("--d-model", type=int, default=256, help="gpt: model width (heads of 64)")
    p.add_argument("--context", type=int, default=128, help="gpt: tokens per sequence")
    p.add_argument("--vocab", type=int, default=2048, help="gpt: vocabulary size")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--skip-naive", action="store_true")
    p.add_argument("--ops", nargs="+", default=None, choices=list(OPS), help="only these (train_step is always run)")
    p.add_argument("--memory-of", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    gpt_family = args.family == "gpt"
    args.n = args.n if args.n is not None else (32 if gpt_family else 256)
    args.batch = args.batch if args.batch is not None else (16 if gpt_family else 128)
    if args.memory_of:
        return memory_child(args)

    state = build(args)
    sites = len(state[0].sites())
    model = (f"gpt {args.layers} layers d_model={args.d_model} context={args.context} vocab={args.vocab}" if gpt_family
             else f"cifar_resnet{tuple(args.blocks)} w={args.width} {args.family}")  # fmt: skip
    print(f"{model}: {sites} sites, n={args.n}, batch {args.batch}, torch threads {torch.get_num_threads()}, "
          f"median of {args.repeats}")
    ops = [k for k in OPS if not (args.skip_naive and k == "naive_per_site")]
    if args.ops:
        ops = ["train_step"] + [k for k in ops if k in args.ops and k != "train_step"]
    # Interleave the repeats (A B C A B C ...) so that load from other processes hits every
    # operation alike: the ratios, not the absolute times, are the result.
    # Wall time and this process's CPU time: on a machine shared with other jobs the wall clock
    # mostly measures them, while CPU seconds (one thread) measure the work itself.
    times = {name: [] for name in ops}
    cpu = {name: [] for name in ops}
    for name in ops:
        OPS[name](*state, args)  # warm-up
    for _ in range(args.repeats):
        for name in ops:
            t0, c0 = time.perf_counter(), time.process_time()
            OPS[name](*state, args)
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    mems = {name: peak_memory(name, args) for name in ops}
    base_t, base_c, base_m = statistics.median(times["train_step"]), statistics.median(cpu["train_step"]), max(mems["train_step"], 1)
    print("| operation | median wall s | × train fwd+bwd (wall) | median CPU s | × train fwd+bwd (CPU) | peak MiB | × train peak |")
    print("|---|---|---|---|---|---|---|")
    for n in ops:
        t, c = statistics.median(times[n]), statistics.median(cpu[n])
        print(f"| {n} | {t:.3f} | {t / base_t:.2f} | {c:.3f} | {c / base_c:.2f} | {mems[n] / 1024:.0f} | {mems[n] / base_m:.2f} |")


if __name__ == "__main__":
    main()
