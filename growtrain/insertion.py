"""How an inserted block starts: the paper's zero terminal map, an MSG mask ramp, a G_stack copy,
or a copy behind a mask ramp.

Every insertion goes in as a zero-output block first (``network.grow`` refuses anything else, and
the growth paths check the output did not change). What happens next is the insertion's kind:

* ``"zero"`` (the paper): nothing; the block starts at ``V = 0``.
* ``"mask_ramp"`` (MSG, arXiv 2305.02869): the terminal map is drawn as a fresh layer's
  (``draw_terminal``: nonzero on every family), and the block's residual update is multiplied by a
  mask ``m`` ramped linearly from 0 to 1 over ``ramp_steps`` optimizer steps:
  ``out = x + m·(block(x) − x)``. At ``m = 0`` the network is unchanged; once ``m = 1`` the mask
  is removed and the block trains like a fresh one (no zero terminal map to grow out of).
* ``"copy"`` (G_stack, arXiv 2405.15319): the block takes the weights of its neighbour below
  (above at the first position). The network's output changes at insertion.
* ``"copy_zero"``: the copy's weights with the terminal map zeroed again: the function unchanged,
  the block's features the neighbour's.
* ``"copy_ramp"``: the copy's weights behind the mask ramp: unchanged at ``m = 0``, then the
  neighbour's copy mixed in over ``ramp_steps``.

Whether an insertion left the output unchanged is measured where it happens (every growth record
says so), never assumed from the kind. Which kinds a schedule takes: the converged and periodic
checks insert zero blocks only (they score blocks against the unchanged function); a budget's
fork starts its arm's blocks as ``copy_zero`` (the default), ``copy`` or ``zero``; a plan takes
every kind.

The mask is state of the network: a 0-d buffer ``growtrain_mask`` on the block (in the network's
dtype, on its device) that a forward hook reads, so a checkpoint written mid-ramp holds it and
loads as the network that was trained. The hook is not state: ``load_masks`` (called by
``GrowableMixin`` while it loads a state dict, after any growth replay) puts buffer and hook on
every block whose mask the state dict holds. At ``m = 1`` both are removed, so a block's keys are
its own again (a Hugging Face layer's ``save_pretrained`` writes no extra key after its ramp).

Pure functions on modules; no Lightning.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from growtrain.growable import terminal_parameters
from growtrain.masks import MASK_KEY, attach_mask, detach_mask, load_masks, mask_value, set_mask

__all__ = ["COPIED", "INSERTIONS", "MASK_KEY", "RAMPED", "Insertion", "MaskRamp", "attach_mask", "check_insertion",
           "copy_neighbour", "detach_mask", "draw_terminal", "load_masks", "mask_value", "neighbour_block",
           "set_mask", "start_block"]  # fmt: skip

Insertion = Literal["zero", "copy_zero", "mask_ramp", "copy", "copy_ramp"]
INSERTIONS: tuple[str, ...] = ("zero", "copy_zero", "mask_ramp", "copy", "copy_ramp")
# the kinds that copy the neighbour's weights (a stage's first added block has none to copy: it stays zero)
COPIED: tuple[str, ...] = ("copy", "copy_zero", "copy_ramp")
RAMPED: tuple[str, ...] = ("mask_ramp", "copy_ramp")  # the kinds behind a mask
_FALLBACK_STD = 0.02  # GPT-2's init std, for a terminal tensor whose neighbours are all still zero


def check_insertion(kind: Any, name: str = "insertion") -> str:
    if kind not in INSERTIONS:
        raise ValueError(f"{name}: expected one of {INSERTIONS}, got {kind!r}. 'zero' is the paper's function-"
                         "preserving insertion; 'copy_zero' (the neighbour's weights, the terminal map at zero: function-preserving), "
                         "'mask_ramp' (MSG), 'copy' (G_stack) and 'copy_ramp' (a copy behind "
                         "MSG's mask) are the alternatives.")  # fmt: skip
    return kind


def _same_tensors(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = _own_state(a), _own_state(b)
    return set(sa) == set(sb) and all(getattr(sa[k], "shape", None) == getattr(sb[k], "shape", None) for k in sa)


def _own_state(block: nn.Module) -> dict[str, Any]:
    # the block's tensors without a mask: a neighbour mid-ramp is still a block of the same kind
    return {k: v for k, v in block.state_dict(keep_vars=True).items() if k != MASK_KEY}


def neighbour_block(network: nn.Module, block: nn.Module) -> nn.Module | None:
    """The block's nearest stage neighbour with its tensors (names and shapes) that was there before
    it: below first, else above. A stage's shape-changing first block (a ResNet's stride-2
    transition) is never one. Blocks inserted in the same growth are skipped only if they are
    zero; ``None`` when there is none.
    """
    for stage_name in network.growable_stages:
        stage = network.stage(stage_name)
        index = next((i for i, m in enumerate(stage) if m is block), None)
        if index is None:
            continue
        order = list(range(index - 1, -1, -1)) + list(range(index + 1, len(stage)))
        for j in order:
            if _same_tensors(stage[j], block) and any(bool(torch.any(p.detach() != 0)) for p in _terminal(network, stage[j])):
                return stage[j]
        return None
    raise ValueError("block: it is not in any growable stage of the network; insert it with network.grow first")


def _terminal(network: nn.Module, block: nn.Module) -> list[nn.Parameter]:
    of = getattr(network, "terminal_parameters_of", None)  # a Hugging Face decoder names them per layer
    return list(of(block)) if of is not None else terminal_parameters(block)


@torch.no_grad()
def copy_neighbour(network: nn.Module, block: nn.Module) -> nn.Module:
    """G_stack's insertion: ``block`` takes every tensor of its neighbour (``neighbour_block``).

    Parameters keep their identity (values are copied in place), so the optimizer's references hold.
    A neighbour's own mask (mid-ramp) is not copied: the new block's mask is its insertion's.
    """
    source = neighbour_block(network, block)
    if source is None:
        raise ValueError("insertion='copy': the new block has no trained neighbour with its tensors in its stage to "
                         "copy (a stage's shape-changing first block is not one)")  # fmt: skip
    theirs = _own_state(source)
    for key, tensor in _own_state(block).items():
        tensor.copy_(theirs[key].detach())
    return source


_NORMS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)


def _kinds(block: nn.Module, params: list[nn.Parameter]) -> list[str]:
    """Each terminal tensor as a fresh layer initialises it: ``"bias"`` (zero), ``"scale"`` (a
    normalisation layer's weight: one) or ``"weight"`` (a random draw)."""
    names = {id(p): n for n, p in block.named_parameters()}
    out = []
    for p in params:
        name = names.get(id(p), "")
        owner_path, _, leaf = name.rpartition(".")
        owner = block.get_submodule(owner_path) if name else None
        if leaf == "bias":
            out.append("bias")
        elif isinstance(owner, _NORMS) or type(owner).__name__.endswith("Norm"):
            out.append("scale")
        else:
            out.append("weight")
    return out


@torch.no_grad()
def draw_terminal(network: nn.Module, block: nn.Module, generator: torch.Generator | None = None) -> None:
    """MSG's fresh block: the terminal map as a fresh layer's, never zero. Each terminal weight is
    drawn from N(0, s²), s the standard deviation of the neighbour's matching tensor (0.02 when no
    neighbour has trained one); a normalisation layer's weight (a ResNet BasicBlock's ``bn2.weight``,
    its whole terminal scale) is one, as ``reset_parameters`` sets it; biases stay zero."""
    source = neighbour_block(network, block)
    mine = _terminal(network, block)
    ref = _terminal(network, source) if source is not None else [None] * len(mine)
    for p, q, kind in zip(mine, ref, _kinds(block, mine)):
        if kind == "bias":
            continue  # zero, as in a fresh layer
        if kind == "scale":
            p.fill_(1.0)
            continue
        s = float(q.detach().float().std()) if q is not None and q.numel() > 1 else _FALLBACK_STD
        draw = torch.randn(p.shape, generator=generator, dtype=torch.float32)  # on the CPU: the same on any device
        p.copy_((draw * (s if s > 0 else _FALLBACK_STD)).to(device=p.device, dtype=p.dtype))


class MaskRamp:
    """MSG's output masks: ``out = x + m·(block(x) − x)`` with ``m`` ramped 0 → 1 over ``steps``.

    ``add(block, start)`` masks a block from optimizer step ``start`` (or adopts the mask a loaded
    checkpoint put on it); ``set_step(step)`` moves every mask to that step (call it before each
    training batch) and removes a mask at ``m = 1``.
    """

    def __init__(self, steps: int):
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"ramp_steps: expected an integer ≥ 1 (optimizer steps from 0 to 1), got {steps!r}")
        self.steps = steps
        self._masks: dict[int, tuple[nn.Module, int]] = {}  # id(block) → (block, start)

    def value(self, start: int, step: int) -> float:
        return min(1.0, max(0.0, (step - start) / self.steps))

    def add(self, block: nn.Module, start: int, step: int | None = None) -> None:
        self._masks[id(block)] = (block, int(start))
        attach_mask(block, self.value(int(start), int(start) if step is None else step))
        if mask_value(block) is None:  # already at 1: nothing left to ramp
            del self._masks[id(block)]

    def set_step(self, step: int) -> None:
        for key, (block, start) in list(self._masks.items()):
            set_mask(block, self.value(start, step))
            if mask_value(block) is None:
                del self._masks[key]

    def mask(self, block: nn.Module) -> float | None:
        """The block's current mask, ``None`` when this ramp holds none for it."""
        return mask_value(block) if id(block) in self._masks else None

    def clear(self) -> None:
        """Forget every block without touching its mask (a resumed fit adopts them again)."""
        self._masks.clear()

    def __len__(self) -> int:
        return len(self._masks)


@torch.no_grad()
def start_block(network: nn.Module, block: nn.Module, kind: str, generator: torch.Generator | None = None) -> bool:
    """Start a freshly inserted zero-output ``block`` as ``kind`` says (the one place every growth
    path does it): ``"zero"`` leaves it; ``"copy"``/``"copy_ramp"`` copy the neighbour's tensors;
    ``"copy_zero"`` copies them and zeroes the terminal map again (the copy's features, the
    function unchanged); ``"mask_ramp"`` draws a fresh terminal map. A ramped kind's mask is the
    caller's (``MaskRamp``). Returns ``False`` when a copied kind had no neighbour to copy (the
    block stays at zero)."""
    if kind in COPIED:
        if neighbour_block(network, block) is None:
            return False
        copy_neighbour(network, block)
        if kind == "copy_zero":
            for p in _terminal(network, block):
                p.zero_()
    elif kind == "mask_ramp":
        draw_terminal(network, block, generator)
    return True
