"""Tiny builders and *independent* oracles for the growth / certificate tests.

Everything here recomputes the certificate's quantities the slow, obvious way: really insert
the scored block into a copy of the network (``grow``), then use plain autograd one sample at
a time, or explicit Jacobians (``torch.func.jacrev``) of the inserted block. None of it calls
``growtrain.saturation`` or ``growtrain.probe_math``.

Sizes are kept tiny (width 2, 8×8 images, ≤ 40 samples, float64) because the test machine
has two shared CPU cores.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from growtrain import GrowableStack
from growtrain.families.base import DenseFeatures
from growtrain.growable import GrowableMixin, terminal_parameters
from growtrain.models import cifar_resnet

KINDS = ("preact", "basic", "generic", "dense")
VECTOR_KINDS = ("generic", "dense")  # (n, 4) inputs, 4 classes


# -- a user-defined residual block for the generic path --------------------------------------
class MLPBlock(nn.Module):
    """``x + fc2(relu(bn(fc1(x))))``; terminal map ``fc2`` (weight and bias)."""

    def __init__(self, dim: int = 4, hidden: int = 3):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.bn = nn.BatchNorm1d(hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.bn(self.fc1(x))))


MLP_TERMINAL = ("fc2.weight", "fc2.bias")


def mlp_stack(n_blocks: int = 2, dim: int = 4, hidden: int = 3) -> GrowableStack:
    return GrowableStack([MLPBlock(dim, hidden) for _ in range(n_blocks)], lambda: MLPBlock(dim, hidden), MLP_TERMINAL)


# -- a user-defined block with a fast DenseFeatures form (weight and bias) ---------------------
class DenseBlock(MLPBlock):
    """``MLPBlock`` that tells the probe its features: ``V = fc2`` on ``relu(bn(fc1 z))``, bias
    as a column of ones, and no ``split_terminal`` (the default split is used)."""

    def zero_init_last(self):
        nn.init.zeros_(self.fc2.weight)
        nn.init.zeros_(self.fc2.bias)

    def terminal_parameters(self):
        return [self.fc2.weight, self.fc2.bias]

    def probe_features(self, z):
        return DenseFeatures(torch.relu(self.bn(self.fc1(z))), bias=True)


class DenseNet(GrowableMixin, nn.Module):
    """A user's own growable network (not GrowableStack): one stage of ``DenseBlock`` s."""

    growable_stages = ("blocks",)

    def __init__(self, n_blocks: int = 2, dim: int = 4, hidden: int = 3):
        super().__init__()
        self.dim, self.hidden = dim, hidden
        self.blocks = nn.ModuleList([DenseBlock(dim, hidden) for _ in range(n_blocks)])
        self._init_growth()

    def make_block(self, stage):
        block = DenseBlock(self.dim, self.hidden)
        block.zero_init_last()
        return block

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


# -- builders ----------------------------------------------------------------------------------
def make_net(
    kind: str,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    blocks=(1, 2, 1),
    width: int = 2,
    added: int = 0,
    nontrivial_bn: bool = True,
) -> nn.Module:
    """A tiny growable network in eval mode with non-trivial BatchNorm running statistics."""
    torch.manual_seed(seed)
    if kind == "generic":
        net = mlp_stack()
    elif kind == "dense":
        net = DenseNet()
    else:
        net = cifar_resnet(blocks, width=width, family=kind, in_channels=1, num_classes=3, added=added)
    net = net.to(dtype)
    if nontrivial_bn:
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for m in net.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    m.weight.copy_(0.5 + torch.rand(m.weight.shape, generator=gen, dtype=dtype))
                    m.bias.copy_(0.2 * torch.randn(m.bias.shape, generator=gen, dtype=dtype))
            net.train()
            for _ in range(3):  # running stats away from (0, 1)
                net(1.5 * random_inputs(kind, 16, gen, dtype) + 0.3)
    net.eval()
    return net


def random_inputs(kind: str, n: int, gen: torch.Generator, dtype=torch.float64) -> torch.Tensor:
    if kind in VECTOR_KINDS:
        return torch.randn(n, 4, generator=gen, dtype=dtype)
    return torch.randn(n, 1, 8, 8, generator=gen, dtype=dtype)


def num_classes(kind: str) -> int:
    return 4 if kind in VECTOR_KINDS else 3


def probe_batches(kind: str, n: int = 20, batch: int = 8, seed: int = 123, dtype=torch.float64):
    """A list of ``(x, y)`` batches; the last batch is smaller when ``batch`` ∤ ``n``."""
    gen = torch.Generator().manual_seed(seed)
    x = random_inputs(kind, n, gen, dtype)
    y = torch.randint(0, num_classes(kind), (n,), generator=gen)
    return [(x[i : i + batch], y[i : i + batch]) for i in range(0, n, batch)]


def cat_batches(batches):
    return torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])


loss_fn = F.cross_entropy


# -- real insertion ----------------------------------------------------------------------------
def insert_copy(net: nn.Module, site, block: nn.Module):
    """A deep copy of ``net`` with a deep copy of ``block`` really inserted at ``site``."""
    net2 = copy.deepcopy(net)
    inserted = net2.grow(site, block=copy.deepcopy(block))
    net2.eval()
    return net2, inserted


class _Capture:
    """Forward hook on a block: keeps its input and output of the last call."""

    def __init__(self, block: nn.Module):
        self.z = self.out = None
        self.handle = block.register_forward_hook(self)

    def __call__(self, module, args, output):
        self.z, self.out = args[0], output

    def remove(self):
        self.handle.remove()


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


@dataclass
class SiteOracle:
    """Independently computed quantities of one site (real insertion, plain autograd)."""

    grad: list  # ĝ: grad of the mean probe loss w.r.t. the inserted block's terminal params
    xi: torch.Tensor  # (n, p) per-sample gradients, one sample at a time
    q: torch.Tensor  # (n, out) q_i = grad of sample i's loss alone at the block's output
    batch_q_norms: list  # ‖∇_H L_b‖ per batch (Eq. 2)
    z: torch.Tensor  # (n, ...) the inserted block's inputs
    net: nn.Module  # the copy with the block inserted
    block: nn.Module  # the inserted block

    @property
    def grad_norm(self) -> float:
        return float(flat(self.grad).norm())

    @property
    def variance(self) -> float:
        n = self.xi.shape[0]
        return float(((self.xi - self.xi.mean(0)) ** 2).sum() / (n - 1))

    @property
    def ag(self) -> float:
        return float(self.q.pow(2).sum(1).mean().sqrt())

    @property
    def ag_batch(self) -> float:
        return float(torch.stack(self.batch_q_norms).mean())


def site_oracle(net: nn.Module, site, block: nn.Module, batches, loss=loss_fn) -> SiteOracle:
    net2, inserted = insert_copy(net, site, block)
    params = terminal_parameters(inserted)
    cap = _Capture(inserted)
    try:
        x, y = cat_batches(batches)
        n = x.shape[0]
        # ĝ: gradient of the mean loss over the whole probe sample (batches weighted by size).
        total = sum(loss(net2(bx), by) * (bx.shape[0] / n) for bx, by in batches)
        grad = list(torch.autograd.grad(total, params))
        # Eq. 2: whole-tensor norm of the batch-loss gradient at the block's output.
        batch_norms = []
        for bx, by in batches:
            lb = loss(net2(bx), by)
            (g_out,) = torch.autograd.grad(lb, cap.out)
            batch_norms.append(g_out.norm())
        # Per sample: that sample's loss alone.
        xis, qs, zs = [], [], []
        for i in range(n):
            li = loss(net2(x[i : i + 1]), y[i : i + 1])
            g = torch.autograd.grad(li, params + [cap.out])
            xis.append(flat(g[:-1]))
            qs.append(g[-1].reshape(-1))
            zs.append(cap.z.detach())
    finally:
        cap.remove()
    return SiteOracle(grad, torch.stack(xis), torch.stack(qs), batch_norms, torch.cat(zs), net2, inserted)


def block_jacobians(block: nn.Module, z: torch.Tensor) -> torch.Tensor:
    """``(n, out, p)``: per-sample Jacobians of ``block``'s output w.r.t. its terminal params."""
    from torch.func import functional_call, jacrev

    block.eval()
    names = {id(p): name for name, p in block.named_parameters()}
    terminal = terminal_parameters(block)
    t_names = [names[id(p)] for p in terminal]
    values = tuple(p.detach() for p in terminal)
    out = []
    for i in range(z.shape[0]):
        zi = z[i : i + 1]

        def f(*vals):
            return functional_call(block, dict(zip(t_names, vals)), (zi,)).reshape(-1)

        jac = jacrev(f, argnums=tuple(range(len(values))))(*values)
        out.append(torch.cat([j.reshape(j.shape[0], -1) for j in jac], dim=1))
    return torch.stack(out).detach()


def brute_projected(grad: torch.Tensor, jac: torch.Tensor) -> float:
    """``V_S = sqrt(ĝᵀ pinv(Ĝ) ĝ)`` with ``Ĝ = (1/n) Σ J_iᵀ J_i`` (torch.linalg.pinv)."""
    gram = torch.einsum("nop,noq->pq", jac, jac) / jac.shape[0]
    value = grad @ torch.linalg.pinv(gram, hermitian=True) @ grad
    return float(value.clamp_min(0).sqrt())


# -- state snapshots ---------------------------------------------------------------------------
def module_tree(net: nn.Module):
    """Identity-level picture of a network: (name, type, id) of every module and parameter."""
    mods = [(name, type(m).__name__, id(m)) for name, m in net.named_modules()]
    params = [(name, id(p)) for name, p in net.named_parameters()]
    return mods, params


def bn_snapshot(net: nn.Module) -> dict:
    """Running statistics of every BatchNorm, keyed by the module's identity."""
    return {
        id(m): (m.running_mean.clone(), m.running_var.clone(), m.num_batches_tracked.clone())
        for m in net.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
    }


def same_bn(before: dict, after: dict) -> bool:
    for key, (mean, var, count) in before.items():
        m2, v2, c2 = after[key]
        if not (torch.equal(mean, m2) and torch.equal(var, v2) and torch.equal(count, c2)):
            return False
    return True
