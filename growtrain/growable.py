"""Growable networks: candidate sites, function-preserving insertion, growth records.

A growable network keeps its residual stages as plain ``nn.ModuleList`` attributes. A *site*
is a position inside a stage where a block of the same input/output shape fits; ``layer2.1``
means "before block 1 of stage ``layer2``" and ``layer2.<len>`` the end of that stage. Sites
are listed in a stable order (stage order, then position) fixed before any gradient is seen.

Inserted blocks are *zero-output*: ``block(z) == z`` because their terminal map ``V``
(``block.terminal_parameters()``) is zero. ``grow`` checks that before it changes anything.

This module imports no Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
from torch import nn

__all__ = [
    "Site",
    "GrowableMixin",
    "GrowableStack",
    "replay_growth",
    "grown_blocks",
    "find_growable",
    "terminal_parameters",
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


def grown_blocks(network: nn.Module) -> list[nn.Module]:
    """The blocks inserted by ``grow``, in growth order (empty for a network never grown)."""
    return list(getattr(network, "_grown_blocks", []))


def replay_growth(network: nn.Module, records: Sequence[dict]) -> list[nn.Module]:
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
    added = []
    for rec in records[done:]:
        site = Site(str(rec["stage"]), int(rec["index"]))
        added.append(network.grow(site))
    return added


def find_growable(module: nn.Module) -> nn.Module | None:
    """The first submodule (itself included) that has ``sites()`` and ``grow()``."""
    for m in module.modules():
        if callable(getattr(m, "sites", None)) and callable(getattr(m, "grow", None)):
            return m
    return None


class GrowableStack(GrowableMixin, nn.Module):
    """Make a user's own stack of residual blocks growable.

    ``blocks`` is an ``nn.ModuleList``/``nn.Sequential`` of blocks whose input and output
    shapes agree; ``factory()`` builds a fresh block; ``terminal`` names the parameters of the
    terminal map inside a block (e.g. ``("fc2.weight", "fc2.bias")``). New blocks are wrapped
    in :class:`growtrain.families.generic.ResidualAdapter` only to expose
    ``terminal_parameters()``/``zero_init_last()``; they compute exactly ``factory()``'s block.

    ``GrowableStack(blocks, factory, terminal)(x)`` runs the blocks in order; use it in place
    of your ``nn.Sequential``.
    """

    growable_stages = ("blocks",)

    def __init__(self, blocks: Iterable[nn.Module], factory: Callable[[], nn.Module], terminal: Sequence[str]):
        super().__init__()
        from growtrain.families.generic import ResidualAdapter

        if not callable(factory):
            raise TypeError(f"factory: expected a callable returning a block, got {type(factory).__name__}")
        terminal = tuple(terminal)
        if not terminal:
            raise ValueError("terminal: name at least one parameter of the block's terminal map, e.g. ('fc2.weight',)")
        probe = factory()
        names = dict(probe.named_parameters())
        missing = [t for t in terminal if t not in names]
        if missing:
            raise ValueError(
                f"terminal: {missing} are not parameters of factory()'s block; its parameters are {sorted(names)}"
            )
        self.factory = factory
        self.terminal = terminal
        self.blocks = nn.ModuleList(
            b if hasattr(b, "terminal_parameters") else ResidualAdapter(b, terminal) for b in blocks
        )
        self._adapter = ResidualAdapter
        self._init_growth()

    def make_block(self, stage: str) -> nn.Module:
        block = self._adapter(self.factory(), self.terminal)
        block.zero_init_last()
        return block

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x
