"""Growable networks: candidate sites, function-preserving insertion, growth records.

A growable network keeps its residual stages as plain ``nn.ModuleList`` attributes. A *site*
is a position inside a stage where a block of the same input/output shape fits; ``layer2.1``
means "before block 1 of stage ``layer2``" and ``layer2.<len>`` the end of that stage. Sites
are listed in a stable order (stage order, then position) fixed before any gradient is seen.

Inserted blocks are *zero-output*: ``block(z) == z`` because their terminal map ``V``
(``block.terminal_parameters()``) is zero. ``grow`` checks that before it changes anything;
``insertion_tolerance`` is how far the output may move after an insertion (the network editor's
function-preservation check).

This module imports no Lightning.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import torch
from torch import nn
from torch.nn import functional as F

from growtrain.masks import load_masks

__all__ = [
    "Site",
    "GrowableMixin",
    "replay_growth",
    "grown_blocks",
    "find_growable",
    "terminal_parameters",
    "GrowableNetwork",
    "GrowableBlock",
    "FastProbeBlock",
    "check_growable",
    "check_growable_block",
    "resolve_network",
    "probe_loss_for",
]


@dataclass(frozen=True)
class Site:
    """A candidate insertion position: before block ``index`` of ``stage`` (``index == len`` is the end)."""

    stage: str
    index: int

    @property
    def name(self) -> str:
        return f"{self.stage}.{self.index}"

    def __str__(self) -> str:  # pragma: no cover - cosmetic
        return self.name


# -- the growth contract ---------------------------------------------------------------------
@runtime_checkable
class GrowableBlock(Protocol):
    """A block that can be inserted function-preservingly: its terminal map ``V`` can be zeroed.

    ``terminal_parameters()``: the parameters forming ``V`` (the probe's active coordinates),
    in a fixed order. ``zero_init_last()``: set ``V`` to zero, so ``block(z) == z``.
    """

    def terminal_parameters(self) -> list[nn.Parameter]: ...

    def zero_init_last(self) -> None: ...


@runtime_checkable
class FastProbeBlock(GrowableBlock, Protocol):
    """A block with the probe's closed form (optional; without it the probe uses autograd).

    ``probe_features(z)``: the features ``φ(z)`` that ``V`` multiplies (``DenseFeatures`` or
    ``ChannelAffineFeatures``). Optionally also ``split_terminal(matrix)``: a ``V``-shaped
    matrix split into the tensors of ``terminal_parameters()``, in that order (without it, the
    default split: weight columns, then a bias column when there is one).
    """

    def probe_features(self, z: torch.Tensor) -> Any: ...


@runtime_checkable
class GrowableNetwork(Protocol):
    """What growth needs from a network (``GrowableMixin`` implements all of it).

    ``growth_log``: plain-data record of every insertion, in order (checkpoints replay it).
    ``sites()``: candidate insertion sites in a stable order; ``site(s)``: a Site from a Site or
    its name; ``stage(name)``: the ``nn.ModuleList`` of a stage; ``depth()``: number of blocks.
    ``new_block(site, seed)``: a zero-output candidate on the neighbours' device and dtype;
    ``neighbour_tensor(site)``: the parameter it takes them from. ``grow(site, block)``: insert;
    ``undo_growth(blocks, log_len)``: take insertions back out.
    """

    growth_log: list[dict]

    def sites(self) -> list[Site]: ...

    def site(self, site: Site | str) -> Site: ...

    def stage(self, name: str) -> nn.ModuleList: ...

    def depth(self) -> int: ...

    def neighbour_tensor(self, site: Site) -> torch.Tensor: ...

    def new_block(self, site: Site | str, seed: int | None = None) -> nn.Module: ...

    def grow(self, site: Site | str, block: nn.Module | None = None) -> nn.Module: ...

    def undo_growth(self, blocks: Sequence[nn.Module], log_len: int) -> None: ...


_NETWORK_METHODS = ("sites", "site", "stage", "depth", "neighbour_tensor", "new_block", "grow", "undo_growth")


def check_growable(network: Any, name: str = "network") -> None:
    """Raise unless ``network`` has the whole :class:`GrowableNetwork` contract and a site.

    ``TypeError`` lists every missing member (``name`` is the argument the caller was given);
    ``ValueError`` when the network has no candidate site, so nothing could ever be grown.
    """
    missing = [m for m in _NETWORK_METHODS if not callable(getattr(network, m, None))]
    if not isinstance(getattr(network, "growth_log", None), list):
        missing.append("growth_log (a list)")
    if missing:
        raise TypeError(
            f"{name}: {type(network).__name__} is not a growable network: it lacks {', '.join(missing)}. "
            "Fix: build it with growtrain.models, wrap your residual blocks in growtrain.GrowableStack, or "
            "subclass growtrain.growable.GrowableMixin (it provides all of these)."
        )
    if not network.sites():
        raise ValueError(
            f"{name}: {type(network).__name__} has no candidate sites, so nothing can be grown. Fix: give each "
            "stage room for a same-shape block (see the model's first_site())."
        )


def check_growable_block(block: Any, name: str = "block") -> None:
    """Raise ``TypeError`` unless ``block`` (a block or its class) has the :class:`GrowableBlock`
    methods, and ``probe_features`` whenever it has ``split_terminal`` (which only the fast
    form of :class:`FastProbeBlock` uses: alone it would be silently ignored)."""
    missing = [m for m in ("terminal_parameters", "zero_init_last") if not callable(getattr(block, m, None))]
    if callable(getattr(block, "split_terminal", None)) and not callable(getattr(block, "probe_features", None)):
        missing.append("probe_features (it has split_terminal, which is used only with probe_features)")
    if missing:
        what = block.__name__ if isinstance(block, type) else type(block).__name__
        raise TypeError(
            f"{name}: {what} lacks {', '.join(missing)}. A growable block needs terminal_parameters() and "
            "zero_init_last(); the probe's optional fast form is probe_features() (and optionally "
            "split_terminal()); see growtrain.growable.GrowableBlock and FastProbeBlock."
        )


def terminal_parameters(block: nn.Module) -> list[nn.Parameter]:
    """The active coordinates ``V`` of a zero-output block, in the block's declared order."""
    if not hasattr(block, "terminal_parameters"):
        raise TypeError(
            f"block of type {type(block).__name__} has no terminal_parameters(); a growable block "
            "must say which parameters form its zero-initialised terminal map V "
            "(use growtrain.families.generic.ResidualAdapter to wrap your own block)."
        )
    return list(block.terminal_parameters())


class GrowableMixin:
    """Sites, insertion and growth records for a network whose stages are ``nn.ModuleList`` s.

    A subclass defines:
      * ``growable_stages``: tuple of attribute names of its residual ``nn.ModuleList`` stages;
      * ``first_site(stage) -> int``: the first admissible position (1 when block 0 of the
        stage changes the shape, e.g. a stride-2 transition; 0 otherwise);
      * ``make_block(stage) -> nn.Module``: a fresh zero-output block for that stage, built
        on the CPU in float32 with the global RNG (``grow`` moves it to the neighbours'
        device and dtype).
    and calls ``self._init_growth()`` in ``__init__``.
    """

    growable_stages: tuple[str, ...] = ()

    # -- state ---------------------------------------------------------------------------
    def _init_growth(self) -> None:
        # Plain-data record of every insertion, in order: what a checkpoint needs to rebuild
        # the architecture before load_state_dict (see replay_growth).
        self.growth_log: list[dict] = []
        # The inserted modules themselves, by identity (not registered twice as submodules).
        object.__setattr__(self, "_grown_blocks", [])

    # -- the growth record travels in the state dict --------------------------------------
    # nn.Module loads a module's own state (this override) before it recurses into its children,
    # so a freshly built (ungrown) network handed a grown one's state dict inserts the recorded
    # blocks here, and load_state_dict then fills them: torch.load + load_state_dict,
    # load_from_checkpoint and a resumed fit rebuild the grown network with no module mixin.
    def get_extra_state(self) -> torch.Tensor | str:
        # One JSON record, not a nested dict: a distributed checkpoint (FSDP2) flattens nested
        # containers into keys of their own, which an ungrown network's state dict would lack.
        text = json.dumps({"growth": [dict(r) for r in self.growth_log]})
        if _sharded(self):
            # torch.distributed.checkpoint loads a tensor in place, into one of the length this network's
            # record has now: an ungrown network could not read a grown one's longer record at all, and the
            # load below could not say why. A string it loads whole, at any length.
            return text
        # Its UTF-8 bytes as a uint8 tensor: a state dict of tensors only, which safetensors (and so
        # Hugging Face) and every tensor-only tool require. On the CPU whatever the network's device:
        # it is data read on the host (a meta-device network would hold no bytes), not a network tensor.
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)

    def set_extra_state(self, state: Any) -> None:
        _growth_records(state)  # validated; the blocks were inserted in _load_from_state_dict

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):  # fmt: skip
        state = state_dict.get(prefix + "_extra_state")
        if state is not None:
            records = _growth_records(state)
            # Only when the weights name blocks this network lacks: a network built at the grown
            # architecture (a scratch arm, a copy that grew the same blocks) loads them as it is.
            if len(records) > len(self.growth_log):
                have = {prefix + k for k in self.state_dict()}  # names only: the tensors are not copied
                if not {k for k in state_dict if k.startswith(prefix)} <= have:
                    replay_growth(self, records)
                elif _sharded(self):  # a distributed load filled only the keys this ungrown model has
                    raise RuntimeError(
                        f"state_dict: it records {len(records)} growth(s) but this FSDP2-sharded network has "
                        f"{len(self.growth_log)}, and a distributed checkpoint loads only the keys the model has: "
                        "the weights would sit at the wrong depth. Fix: load it with GrowUntilSaturated in the "
                        "trainer's callbacks (it grows the model to the checkpoint's depth before the shards load), "
                        "or grow the network with growtrain.replay_growth before sharding it."
                    )

        load_masks(self, state_dict, prefix)  # a block saved mid-ramp gets its mask before its tensors load
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)  # fmt: skip
        if state is None and prefix + "_extra_state" in missing_keys:
            # no record: the weights of a network never grown, or of one outside growtrain; nothing to replay
            missing_keys.remove(prefix + "_extra_state")

    def first_site(self, stage: str) -> int:
        return 0

    def make_block(self, stage: str) -> nn.Module:  # pragma: no cover - abstract
        raise NotImplementedError

    def stage(self, name: str) -> nn.ModuleList:
        return getattr(self, name)

    # -- sites ---------------------------------------------------------------------------
    def sites(self) -> list[Site]:
        """All candidate sites, stage by stage, in order of depth."""
        out = []
        for stage in self.growable_stages:
            for index in range(self.first_site(stage), len(self.stage(stage)) + 1):
                out.append(Site(stage, index))
        return out

    def site(self, site: Site | str) -> Site:
        """Resolve a site or its name; a clear error (listing valid names) otherwise."""
        valid = self.sites()
        if isinstance(site, Site):
            if site in valid:
                return site
            given = site.name
        elif isinstance(site, str):
            for s in valid:
                if s.name == site:
                    return s
            given = site
        else:
            raise TypeError(f"site: expected a growtrain Site or its name (str), got {type(site).__name__}")
        names = ", ".join(s.name for s in valid)
        raise ValueError(
            f"site: {given!r} is not a candidate site of this network. Valid sites: {names}. "
            "Sites are 'stage.position' (before block `position` of `stage`); positions in front "
            "of a shape-changing block are not candidates."
        )

    def depth(self) -> int:
        """Number of residual blocks in the growable stages."""
        return sum(len(self.stage(s)) for s in self.growable_stages)

    # -- blocks --------------------------------------------------------------------------
    def neighbour_tensor(self, site: Site) -> torch.Tensor:
        """A parameter next to ``site``: the new block takes its device and dtype."""
        stage = self.stage(site.stage)
        for module in (stage, self):
            for p in module.parameters():
                return p
        raise ValueError("network: it has no parameters to take a new block's device/dtype from")

    def new_block(self, site: Site | str, seed: int | None = None) -> nn.Module:
        """A fresh zero-output candidate block for ``site`` on the neighbours' device/dtype.

        With ``seed`` the feature weights ``U_0`` come from a private RNG stream (the global
        RNG is left untouched), so candidates are reproducible across resumes and ranks.
        """
        site = self.site(site)
        # Built on the CPU whatever torch.set_default_device says: the seeded stream is the CPU
        # generator (fork_rng(devices=[]) restores only that one), so a block built on CUDA would
        # draw from, and advance, the global CUDA RNG and differ from the same seed on a CPU run.
        with torch.device("cpu"):
            if seed is None:
                block = self.make_block(site.stage)
            else:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(int(seed))
                    block = self.make_block(site.stage)
        ref = self.neighbour_tensor(site)
        return block.to(device=ref.device, dtype=ref.dtype)

    def grow(self, site: Site | str, block: nn.Module | None = None) -> nn.Module:
        """Insert a zero-output block at ``site`` and return it.

        Every check runs before the network changes: an invalid site, a block that is not an
        ``nn.Module``, already part of the network, or whose terminal map is not exactly zero
        raises and leaves the network as it was.
        """
        site = self.site(site)
        if block is None:
            block = self.new_block(site)
        else:
            if not isinstance(block, nn.Module):
                raise TypeError(f"block: expected an nn.Module, got {type(block).__name__}")
            if any(block is m for m in self.modules()):  # type: ignore[attr-defined]
                raise ValueError("block: this block is already part of the network; pass a fresh block")
            ref = self.neighbour_tensor(site)
            block = block.to(device=ref.device, dtype=ref.dtype)
        nonzero = [tuple(p.shape) for p in terminal_parameters(block) if bool(torch.any(p.detach() != 0))]
        if nonzero:
            raise ValueError(
                f"block: its terminal parameters must be exactly zero (function-preserving insertion), "
                f"but tensors of shape {nonzero} are not. Call block.zero_init_last() first."
            )
        if self.training != block.training:  # type: ignore[attr-defined]
            block.train(self.training)  # type: ignore[attr-defined]
        self.stage(site.stage).insert(site.index, block)
        self.growth_log.append({"site": site.name, "stage": site.stage, "index": site.index})
        self._grown_blocks.append(block)
        return block

    def undo_growth(self, blocks: Sequence[nn.Module], log_len: int) -> None:
        """Take back insertions: remove ``blocks`` (returned by ``grow``) and trim ``growth_log``
        to its first ``log_len`` records, leaving the network as it was before them.

        ``blocks`` must be the insertions recorded after ``log_len``, one per record. Every check
        runs before anything changes.
        """
        blocks = list(blocks)
        if isinstance(log_len, bool) or not isinstance(log_len, int) or not 0 <= log_len <= len(self.growth_log):
            raise ValueError(
                f"log_len: expected the growth_log length before the insertions (0..{len(self.growth_log)}), got {log_len!r}"
            )
        if len(blocks) != len(self.growth_log) - log_len:
            raise ValueError(
                f"blocks: {len(self.growth_log) - log_len} insertions were recorded after log_len={log_len}, but "
                f"{len(blocks)} blocks were given; pass exactly the blocks grow() returned for them"
            )
        if len({id(b) for b in blocks}) != len(blocks):
            raise ValueError("blocks: a block is listed twice; pass each inserted block once")
        stages = [self.stage(name) for name in self.growable_stages]
        places = []  # (stage list, block) for each block, found before anything is removed
        for i, block in enumerate(blocks):
            if not any(block is g for g in self._grown_blocks):
                raise ValueError(f"blocks[{i}]: {type(block).__name__} was not inserted by grow() into this network")
            holder = next((st for st in stages if any(m is block for m in st)), None)
            if holder is None:
                raise ValueError(f"blocks[{i}]: {type(block).__name__} is no longer in any stage of this network")
            places.append((holder, block))
        for holder, block in reversed(places):  # newest first: earlier positions stay valid
            del holder[next(j for j, m in enumerate(holder) if m is block)]
            del self._grown_blocks[max(j for j, g in enumerate(self._grown_blocks) if g is block)]
        del self.growth_log[log_len:]


def _growth_records(state: Any) -> list[dict]:
    """The records of a growable network's extra state, checked: the JSON of ``{"growth": [...]}`` as
    its UTF-8 bytes in a 1-D uint8 tensor (``get_extra_state``), or as a string (what an FSDP2-sharded
    network writes)."""
    text = None
    if isinstance(state, str):
        text = state
    elif isinstance(state, torch.Tensor) and state.dtype == torch.uint8 and state.dim() == 1 and not state.is_meta:
        try:
            text = bytes(state.cpu().tolist()).decode("utf-8")
        except UnicodeDecodeError:
            text = None
    try:
        records = json.loads(text).get("growth") if text is not None else None
    except (ValueError, AttributeError):
        records = None
    if not isinstance(records, list):
        if isinstance(state, torch.Tensor):  # not its repr: a corrupted record can be long
            given = f"a tensor of dtype {state.dtype} and shape {tuple(state.shape)} on {state.device}"
            if text is not None:
                given += f" holding {text[:200]!r}"
        else:
            given = repr(state)[:300]
        raise ValueError(
            f"state_dict: a growable network's extra state must be the JSON of {{'growth': [records]}}, as UTF-8 "
            f"bytes in a 1-D uint8 tensor (or as a string), got {given}. The checkpoint was not written by a growtrain "
            "network or is corrupted (a dtype conversion of the whole state dict corrupts it too: convert only the "
            "floating-point tensors); nothing was loaded."
        )
    return records


def _sharded(module: nn.Module) -> bool:
    from growtrain.fsdp import is_sharded  # lazily: building a network needs no torch.distributed

    return is_sharded(module)


def grown_blocks(network: nn.Module) -> list[nn.Module]:
    """The blocks inserted by ``grow``, in growth order (empty for a network never grown)."""
    return list(getattr(network, "_grown_blocks", []))


def replay_growth(network: GrowableNetwork, records: Sequence[dict]) -> list[nn.Module]:
    """Rebuild a grown architecture from ``network.growth_log`` records.

    Inserts fresh zero-output blocks at the recorded sites, in order, skipping the records the
    network already has. The weights are expected to come from ``load_state_dict`` next.
    """
    done = len(getattr(network, "growth_log", []))
    if done > len(records):
        raise ValueError(
            f"records: the network already has {done} insertions but the record lists only "
            f"{len(records)}; load the checkpoint into a freshly built (ungrown) network."
        )
    if list(network.growth_log) != list(records[:done]):
        raise ValueError("records: the network's existing growth differs from the recorded growth")
    for k, rec in enumerate(records[done:], done):  # check every record before the network changes
        if not (isinstance(rec, dict) and isinstance(rec.get("stage"), str)
                and isinstance(rec.get("index"), int) and not isinstance(rec.get("index"), bool)):  # fmt: skip
            raise ValueError(
                f"records[{k}]: a growth record must be a dict with 'stage' (str) and 'index' (int), got {rec!r}. "
                "The checkpoint's growth record is corrupted or was not written by growtrain; nothing was loaded."
            )
    return [network.grow(Site(rec["stage"], rec["index"])) for rec in records[done:]]


def find_growable(module: nn.Module) -> nn.Module | None:
    """The first submodule (itself included) that has ``sites()`` and ``grow()``."""
    for m in module.modules():
        if callable(getattr(m, "sites", None)) and callable(getattr(m, "grow", None)):
            return m
    return None


# -- the network and the probe loss of a model ---------------------------------------------------
def resolve_network(module: nn.Module, spec: nn.Module | str | None = None, *, required: bool = True) -> nn.Module | None:
    """The growable network inside ``module`` (a LightningModule or any ``nn.Module``).

    ``spec`` (the user's ``network`` argument): ``None`` finds the first growable submodule
    (``module`` itself included); a ``str`` is a dotted attribute path (``"network"``,
    ``"model.trunk"``); an ``nn.Module`` must be part of ``module`` (else the optimizer would
    not train it). The result is checked against the full :class:`GrowableNetwork` contract.
    ``required=False`` returns ``None`` instead of raising when nothing is found (a module that
    builds its layers later, in ``configure_model``); a network that is found but not growable
    raises either way.
    """
    if isinstance(spec, nn.Module):
        if not any(m is spec for m in module.modules()):
            raise ValueError(
                "network: the given module is not part of the model, so the optimizer would not train it. "
                "Fix: pass the attribute path instead, e.g. network='network'."
            )
        network = spec
    elif isinstance(spec, str):
        try:
            network = module.get_submodule(spec)
        except AttributeError:
            if not required:
                return None
            raise ValueError(
                f"network: {type(module).__name__} has no submodule {spec!r}. Fix: pass the attribute path of your "
                "growable network (e.g. network='network') or leave network=None to find it."
            ) from None
    elif spec is None:
        network = find_growable(module)
        if network is None:
            if not required:
                return None
            raise ValueError(
                f"network: {type(module).__name__} has no growable submodule (one with sites() and grow()). "
                "Fix: build your network with growtrain.models.cifar_resnet or wrap your residual blocks in "
                "growtrain.GrowableStack, or pass network='<attribute path>'."
            )
    else:
        raise TypeError(
            f"network: expected None (find it), an attribute path (str) or a submodule (nn.Module), "
            f"got {type(spec).__name__}"
        )
    check_growable(network, "network")
    return network


def insertion_order(names: Sequence[str]) -> list[str]:
    """Sites as ``stage.index`` names, deepest index first within a stage, so that inserting one
    never shifts the index of a site not yet used."""

    def key(name: str):
        stage, _, index = name.rpartition(".")
        return (stage, -int(index)) if index.isdigit() else (name, 0)

    return sorted(names, key=key)


# Absolute tolerance per unit of output scale for the insertion check, by output dtype.
_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def insertion_tolerance(dtype: torch.dtype, scale: float) -> float:
    """Largest acceptable ``max|Δ output|`` after inserting zero-output blocks: the
    function-preservation check of an insertion (the network editor's, and the probe setup's)."""
    return _TOLERANCE.get(dtype, 1e-5) * max(1.0, float(scale))


def probe_loss_for(module: nn.Module, loss_fn: Callable | None = None) -> Callable:
    """The loss the probe scores candidates with: ``loss_fn`` if given, else the model's
    ``probe_loss`` (the batch-mean loss it trains on, e.g. ``LanguageModel``'s token-mean
    cross-entropy), else ``F.cross_entropy``."""
    if loss_fn is not None:
        if not callable(loss_fn):
            raise TypeError(f"loss_fn: expected a callable (output, target) -> mean loss, got {type(loss_fn).__name__}")
        return loss_fn
    probe_loss = getattr(module, "probe_loss", None)
    return probe_loss if callable(probe_loss) else F.cross_entropy
