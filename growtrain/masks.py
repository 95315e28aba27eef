"""The output mask of a block being ramped in (MSG): a 0-d buffer in the block, read by a forward hook.

``out = x + m·(block(x) − x)``: at ``m = 0`` the block is hidden (the network's function is
unchanged), at ``m = 1`` it is the plain block (the mask is removed). The buffer travels in the
state dict as a tensor, so a checkpoint written mid-ramp loads as the network that was trained.
A leaf module (torch only): growable networks load masks, insertions put them on.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

__all__ = ["MASK_KEY", "attach_mask", "detach_mask", "load_masks", "mask_value", "set_mask"]

MASK_KEY = "growtrain_mask"  # the buffer's name inside a masked block (its state-dict key's last part)


def _hidden_in(args: tuple, kwargs: dict) -> torch.Tensor:
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return kwargs["hidden_states"]
    raise TypeError("insertion: a masked block's input is not a tensor (first argument or hidden_states)")


def _masked(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    # A module-level function reading the module it is called on (not a closure): a deepcopy or a
    # pickle of the block carries a hook that reads the copy's own buffer.
    m = module._buffers[MASK_KEY]
    x = _hidden_in(args, kwargs)
    if isinstance(output, torch.Tensor):
        return x + m * (output - x)
    first = output[0]
    return (x + m * (first - x),) + tuple(output[1:])


def _hook_ids(block: nn.Module) -> list[int]:
    return [k for k, h in block._forward_hooks.items() if h is _masked]


def mask_value(block: nn.Module) -> float | None:
    """The block's current mask, ``None`` when it has none (never masked, or ramped to 1)."""
    m = block._buffers.get(MASK_KEY)
    return None if m is None else float(m)


def attach_mask(block: nn.Module, m: float | None = None) -> None:
    """Put a mask on ``block`` (a buffer in its state dict and the hook that applies it) and move it
    to ``m``; without ``m`` a new mask starts at 0 (the block hidden) and an existing one keeps its
    value. The buffer takes the block's device and floating dtype."""
    if MASK_KEY not in block._buffers:
        ref = next((t for t in block.parameters() if t.is_floating_point()), None)
        kw = {"device": ref.device, "dtype": ref.dtype} if ref is not None else {}
        block.register_buffer(MASK_KEY, torch.zeros((), **kw))
    if not _hook_ids(block):
        block.register_forward_hook(_masked, with_kwargs=True, prepend=True)
    if m is not None:
        set_mask(block, m)


def set_mask(block: nn.Module, m: float) -> None:
    """Move the block's mask to ``m``; at ``m ≥ 1`` remove it (the plain block: no hook, no key)."""
    if m >= 1.0:
        detach_mask(block)
        return
    with torch.no_grad():
        block._buffers[MASK_KEY].fill_(float(m))


def detach_mask(block: nn.Module) -> None:
    """Remove the block's mask (buffer and hook); nothing when it has none."""
    block._buffers.pop(MASK_KEY, None)
    for key in _hook_ids(block):  # the hook dicts RemovableHandle.remove() clears
        block._forward_hooks.pop(key, None)
        block._forward_hooks_with_kwargs.pop(key, None)
        block._forward_hooks_always_called.pop(key, None)


def load_masks(network: nn.Module, state_dict: Mapping[str, Any], prefix: str = "") -> None:
    """Make the network's masks those of ``state_dict`` (the network's at ``prefix``) before its
    tensors load: a block whose mask the state dict holds gets one (its value loads next, with the
    block's tensors); a block with a mask the state dict lacks (saved at ``m = 1``) loses it."""
    for name, module in network.named_modules():
        key = f"{prefix}{name}.{MASK_KEY}" if name else f"{prefix}{MASK_KEY}"
        if key in state_dict:
            attach_mask(module)
        elif MASK_KEY in module._buffers:
            detach_mask(module)
