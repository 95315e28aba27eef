"""How an inserted block starts: the paper's zero terminal map, an MSG mask ramp, or a G_stack copy.

Every insertion goes in as a zero-output block first (``network.grow`` refuses anything else, and
the growth paths check the output did not change). What happens next is the insertion's kind:

* ``"zero"`` (the paper): nothing; the block starts at ``V = 0``, function-preserving.
* ``"mask_ramp"`` (MSG, arXiv 2305.02869): the terminal map gets a random draw, and the block's
  residual update is multiplied by a mask ``m`` ramped linearly from 0 to 1 over ``ramp_steps``
  optimizer steps: ``out = x + m·(block(x) − x)``. At ``m = 0`` the network is unchanged, so the
  insertion is function-preserving; once ``m = 1`` the mask is removed and the block trains like a
  fresh one (no zero terminal map to grow out of).
* ``"copy"`` (G_stack, arXiv 2405.15319): the block takes the weights of its neighbour below
  (above at the first position). NOT function-preserving: the network's output changes at insertion.
  ``GrowUntilSaturated`` never inserts anything but a zero block (its checks, trials and forks score
  blocks against the unchanged function; a fit with both callbacks is refused at setup);
  ``GrowOnSchedule``, which certifies nothing, takes it and logs the output's change.

Pure functions on modules; no Lightning. The mask lives in a forward hook and a plain dict (not in
the block's state dict), so a grown checkpoint's keys are the same for every kind; the ramp's
position is the growth callback's state.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from growtrain.growable import terminal_parameters

__all__ = ["INSERTIONS", "Insertion", "MaskRamp", "check_insertion", "copy_neighbour", "draw_terminal",
           "function_preserving", "neighbour_block"]  # fmt: skip

Insertion = Literal["zero", "mask_ramp", "copy"]
INSERTIONS: tuple[str, ...] = ("zero", "mask_ramp", "copy")
_PRESERVING = {"zero": True, "mask_ramp": True, "copy": False}
_FALLBACK_STD = 0.02  # GPT-2's init std, for a terminal tensor whose neighbours are all still zero


def check_insertion(kind: Any, name: str = "insertion") -> str:
    if kind not in INSERTIONS:
        raise ValueError(f"{name}: expected one of {INSERTIONS}, got {kind!r}. 'zero' is the paper's function-"
                         "preserving insertion; 'mask_ramp' (MSG) and 'copy' (G_stack) are the alternatives.")  # fmt: skip
    return kind


def function_preserving(kind: str) -> bool:
    """Whether the network's output is unchanged right after an insertion of this kind."""
    return _PRESERVING[check_insertion(kind)]


def _same_tensors(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return set(sa) == set(sb) and all(getattr(sa[k], "shape", None) == getattr(sb[k], "shape", None) for k in sa)


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
    """
    source = neighbour_block(network, block)
    if source is None:
        raise ValueError("insertion='copy': the new block has no trained neighbour with its tensors in its stage to "
                         "copy (a stage's shape-changing first block is not one)")  # fmt: skip
    mine = dict(block.state_dict(keep_vars=True))
    theirs = source.state_dict(keep_vars=True)
    for key, tensor in mine.items():
        tensor.copy_(theirs[key].detach())
    return source


@torch.no_grad()
def draw_terminal(network: nn.Module, block: nn.Module, generator: torch.Generator | None = None) -> None:
    """MSG's fresh block: each terminal weight drawn from N(0, s²), s the standard deviation of the
    neighbour's matching tensor (0.02 when no neighbour has trained one); biases stay zero."""
    source = neighbour_block(network, block)
    ref = _terminal(network, source) if source is not None else [None] * len(_terminal(network, block))
    for p, q in zip(_terminal(network, block), ref):
        if p.dim() < 2:
            continue  # a bias: zero, as in a fresh layer
        s = float(q.detach().float().std()) if q is not None and q.numel() > 1 else _FALLBACK_STD
        draw = torch.randn(p.shape, generator=generator, dtype=torch.float32)  # on the CPU: the same on any device
        p.copy_((draw * (s if s > 0 else _FALLBACK_STD)).to(p.dtype))


def _hidden_in(args: tuple, kwargs: dict) -> torch.Tensor:
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return kwargs["hidden_states"]
    raise TypeError("insertion='mask_ramp': the block's input is not a tensor (first argument or hidden_states)")


class MaskRamp:
    """MSG's output masks: ``out = x + m·(block(x) − x)`` with ``m`` ramped 0 → 1 over ``steps``.

    ``add(block, start)`` masks a block from optimizer step ``start``; ``set_step(step)`` moves every
    mask to that step (call it before each training batch) and removes a mask at ``m = 1``.
    """

    def __init__(self, steps: int):
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"ramp_steps: expected an integer ≥ 1 (optimizer steps from 0 to 1), got {steps!r}")
        self.steps = steps
        self._masks: dict[int, dict] = {}  # id(block) → {"block", "start", "m", "handle"}

    def value(self, start: int, step: int) -> float:
        return min(1.0, max(0.0, (step - start) / self.steps))

    def add(self, block: nn.Module, start: int, step: int | None = None) -> None:
        entry = {"block": block, "start": int(start), "m": 0.0, "handle": None}

        def hook(module, args, kwargs, output):
            m = entry["m"]
            x = _hidden_in(args, kwargs)
            if isinstance(output, torch.Tensor):
                return x + m * (output - x)
            first = output[0]
            return (x + m * (first - x),) + tuple(output[1:])

        entry["handle"] = block.register_forward_hook(hook, with_kwargs=True, prepend=True)
        self._masks[id(block)] = entry
        self.set_step(start if step is None else step)

    def set_step(self, step: int) -> None:
        for key in list(self._masks):
            entry = self._masks[key]
            entry["m"] = self.value(entry["start"], step)
            if entry["m"] >= 1.0:
                entry["handle"].remove()  # the plain block from here on: no hook, no cost
                del self._masks[key]

    def mask(self, block: nn.Module) -> float | None:
        """The block's current mask, ``None`` when it has none (never masked, or ramped to 1)."""
        entry = self._masks.get(id(block))
        return None if entry is None else entry["m"]

    def clear(self) -> None:
        for entry in self._masks.values():
            entry["handle"].remove()
        self._masks.clear()

    def __len__(self) -> int:
        return len(self._masks)
