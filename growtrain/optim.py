"""Deterministic, named parameter groups and the schedules growtrain's configs use.

Why groups by position matter: Lightning restores optimizer state by param-group *position*
(``zip`` over groups) when a run resumes. A grown network must therefore produce the same
layout every time it is rebuilt: base groups first (parameters outside any grown block), then
one set of groups per growth event ``k`` in growth order (``growth{k}``,
``growth{k}/no_decay``). Grown blocks are told apart **by identity** (``grown_blocks``), never
by value: a fresh block's terminal map is all zeros, so ``torch.equal`` would confuse it with
every other fresh block.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Union

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from growtrain.growable import find_growable, grown_blocks

__all__ = [
    "NO_DECAY_RULES",
    "gpt_no_decay",
    "param_groups",
    "groups_for_new_parameters",
    "WarmupCosine",
    "warmup_cosine_factor",
    "WarmupStableDecay",
    "wsd_factor",
    "paper_sgd",
]

NoDecay = Union[str, Callable[[str, nn.Parameter], bool], None]


def gpt_no_decay(name: str, param: nn.Parameter) -> bool:
    """GPT-2/nanoGPT rule: biases, normalisation gains and embeddings take no weight decay.

    In practice: every parameter with fewer than 2 dimensions (biases, BatchNorm/LayerNorm
    weights) and every embedding table (a name part ``wte``, ``wpe`` or containing ``emb``).
    """
    parts = name.lower().split(".")
    return param.ndim < 2 or any(part in ("wte", "wpe") or "emb" in part for part in parts)


# "none": the paper's SGD recipe decays every parameter.
NO_DECAY_RULES: dict[str, Callable[[str, nn.Parameter], bool] | None] = {"none": None, "gpt": gpt_no_decay}


def _rule(no_decay: NoDecay) -> Callable[[str, nn.Parameter], bool] | None:
    if no_decay is None or callable(no_decay):
        return no_decay
    if isinstance(no_decay, str) and no_decay in NO_DECAY_RULES:
        return NO_DECAY_RULES[no_decay]
    raise ValueError(
        f"no_decay: expected one of {sorted(NO_DECAY_RULES)} or a callable (name, param) -> bool, "
        f"got {no_decay!r}. Use 'none' to decay everything (the paper's SGD recipe)."
    )


def _split(name: str, named: list[tuple[str, nn.Parameter]], rule, weight_decay: float | None) -> list[dict]:
    """One group (``name``) or two (``name`` and ``name/no_decay``); empty groups are dropped.

    Dropping empty groups keeps the layout a function of the architecture alone, so it is the
    same at every rebuild.
    """
    decay = [p for n, p in named if rule is None or not rule(n, p)]
    keep = [p for n, p in named if rule is not None and rule(n, p)]
    groups = []
    if decay:
        groups.append({"name": name, "params": decay})
        if weight_decay is not None:
            groups[-1]["weight_decay"] = float(weight_decay)
    if keep:
        groups.append({"name": f"{name}/no_decay", "params": keep, "weight_decay": 0.0})
    return groups


def param_groups(
    network: nn.Module,
    *,
    weight_decay: float | None = None,
    no_decay: NoDecay = None,
) -> list[dict]:
    """Named parameter groups: ``base`` (+ ``base/no_decay``), then ``growth{k}`` per insertion.

    Args:
        network: the model; grown blocks are found with ``grown_blocks(network)``, in growth
            order (``k`` is the index in ``network.growth_log``, starting at 0).
        weight_decay: set on every decaying group; ``None`` leaves the optimizer's default.
        no_decay: which parameters take no weight decay: ``None``/``"none"`` (every parameter
            decays, the paper's SGD recipe), ``"gpt"`` (biases, norms, embeddings), or a
            callable ``(qualified_name, param) -> bool``.

    Returns:
        ``torch.optim`` param-group dicts with a ``name`` key, frozen parameters left out.
    """
    rule = _rule(no_decay)
    blocks = grown_blocks(network)
    owner: dict[int, int] = {}  # id(param) -> growth index; identity, never value
    for k, block in enumerate(blocks):
        for p in block.parameters():
            owner.setdefault(id(p), k)
    base: list[tuple[str, nn.Parameter]] = []
    grown: list[list[tuple[str, nn.Parameter]]] = [[] for _ in blocks]
    for name, p in network.named_parameters():  # deduplicates shared parameters
        if not p.requires_grad:
            continue
        k = owner.get(id(p))
        (base if k is None else grown[k]).append((name, p))
    groups = _split("base", base, rule, weight_decay)
    for k, named in enumerate(grown):
        groups += _split(f"growth{k}", named, rule, weight_decay)
    return groups


def groups_for_new_parameters(module_or_network: nn.Module, block: nn.Module, k: int | None = None) -> list[dict]:
    """The groups that ``param_groups`` gives a just-inserted ``block`` (``growth{k}``, ...).

    Args:
        module_or_network: the LightningModule or the network. A module may carry
            ``param_group_options`` (a dict of ``param_groups`` keyword arguments, e.g.
            ``ImageClassifier``'s ``no_decay``); those overrides are applied here too, so the
            new groups match what ``configure_optimizers`` builds on resume.
        block: the inserted block (already in the network).
        k: its growth index; by default its position in ``grown_blocks`` (found by identity).

    Only the rule's overrides are set (``name``, and ``weight_decay`` where the rule decides
    it); ``growtrain.reconfigure`` fills the rest from the running base group before
    ``add_param_group``, so the new parameters follow the schedule with zero optimizer state.
    """
    options = dict(getattr(module_or_network, "param_group_options", None) or {})
    network = find_growable(module_or_network) or module_or_network
    if k is None:
        matches = [i for i, b in enumerate(grown_blocks(network)) if b is block]
        if not matches:
            raise ValueError(
                "block: not found among grown_blocks(network) (compared by identity); insert it with "
                "network.grow(site, block) first, or pass its growth index k explicitly."
            )
        k = matches[0]
    # The rule sees the same qualified names as in param_groups(network).
    prefix = next((f"{n}." for n, m in network.named_modules() if m is block and n), "")
    named = [(prefix + n, p) for n, p in block.named_parameters() if p.requires_grad]
    return _split(f"growth{k}", named, _rule(options.get("no_decay")), options.get("weight_decay"))


def warmup_cosine_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.1) -> float:
    """LR multiplier: linear warmup to 1, then half-cosine down to ``min_lr_ratio``, then flat.

    ``step`` counts scheduler steps already taken (0 at the first optimizer step):
    ``(step + 1) / warmup_steps`` while ``step < warmup_steps`` (so the first step does not
    waste a batch at lr 0); afterwards ``r + (1 - r)·½(1 + cos(π·p))`` with
    ``p = (step - warmup_steps) / (total_steps - warmup_steps)`` clipped to ``[0, 1]``.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class WarmupCosine(LambdaLR):
    """Cosine decay with linear warmup (the paper's GPT recipe: 1% warmup, min lr = 0.1 × peak).

    A ``LambdaLR`` so growth can extend it per group (``lr_lambdas``, ``base_lrs``). Step it
    per optimizer step (``scheduler_interval: step``). In YAML::

        lr_scheduler:
          class_path: growtrain.optim.WarmupCosine
          init_args: {warmup_steps: 100, total_steps: 10000, min_lr_ratio: 0.1}
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_steps: int,
        total_steps: int,
        min_lr_ratio: float = 0.1,
        last_epoch: int = -1,
    ):
        if int(warmup_steps) < 0 or int(total_steps) < 1 or int(warmup_steps) > int(total_steps):
            raise ValueError(
                f"warmup_steps/total_steps: expected 0 <= warmup_steps <= total_steps and total_steps >= 1 "
                f"(optimizer steps), got warmup_steps={warmup_steps}, total_steps={total_steps}"
            )
        if not 0.0 <= float(min_lr_ratio) <= 1.0:
            raise ValueError(f"min_lr_ratio: expected a fraction of the peak lr in [0, 1], got {min_lr_ratio}")
        self.warmup_steps = int(warmup_steps)
        self.total_steps = int(total_steps)
        self.min_lr_ratio = float(min_lr_ratio)
        # A partial (not a lambda): LambdaLR.state_dict can then save it as plain data.
        factor = functools.partial(
            warmup_cosine_factor,
            warmup_steps=self.warmup_steps,
            total_steps=self.total_steps,
            min_lr_ratio=self.min_lr_ratio,
        )
        super().__init__(optimizer, factor, last_epoch)


def wsd_factor(step: int, warmup_steps: int, total_steps: int, decay_steps: int, min_lr_ratio: float = 0.1) -> float:
    """LR multiplier of warmup-stable-decay: linear warmup to 1, flat, then a linear decay to
    ``min_lr_ratio`` over the last ``decay_steps`` of ``total_steps``, then flat."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    start = total_steps - decay_steps
    if step < start:
        return 1.0
    progress = min(1.0, (step - start) / max(1, decay_steps))
    return 1.0 - (1.0 - min_lr_ratio) * progress


class WarmupStableDecay(LambdaLR):
    """Warmup-stable-decay (WSD): the schedule under which a late growth (Bu 2025) lands in the flat
    part and the final architecture gets the whole decay. Step it per optimizer step."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, decay_steps: int,
                 min_lr_ratio: float = 0.1, last_epoch: int = -1):  # fmt: skip
        w, t, d = int(warmup_steps), int(total_steps), int(decay_steps)
        if w < 0 or t < 1 or d < 0 or w + d > t:
            raise ValueError(
                f"warmup_steps/decay_steps/total_steps: expected 0 <= warmup_steps, 0 <= decay_steps and "
                f"warmup_steps + decay_steps <= total_steps (optimizer steps), got {w}, {d}, {t}"
            )
        if not 0.0 <= float(min_lr_ratio) <= 1.0:
            raise ValueError(f"min_lr_ratio: expected a fraction of the peak lr in [0, 1], got {min_lr_ratio}")
        self.warmup_steps, self.total_steps, self.decay_steps = w, t, d
        self.min_lr_ratio = float(min_lr_ratio)
        factor = functools.partial(wsd_factor, warmup_steps=w, total_steps=t, decay_steps=d,
                                   min_lr_ratio=self.min_lr_ratio)  # fmt: skip
        super().__init__(optimizer, factor, last_epoch)


def paper_sgd(params) -> torch.optim.SGD:
    """The paper's optimizer (Table 5): SGD, lr 0.1, momentum 0.9, weight decay 5e-4."""
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=5e-4)
