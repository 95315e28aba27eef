"""Growth of FSDP2-sharded networks (``torch.distributed.fsdp.fully_shard``); no Lightning here.

A network sharded with FSDP2 has one ``fully_shard`` unit per decoder block and a root unit
(the embeddings, final norm, head). Growth inserts a block mid-fit, so the new block has to
become a unit like its neighbours, and FSDP's root has to know about it:

* ``shard_blocks(root, blocks, mesh)`` shards each block, then the root (what
  ``configure_model`` of ``growtrain.lm.LanguageModel`` / ``growtrain.hf.HFCausalLM`` calls);
* ``shard_like_neighbours(network, blocks)`` shards just-inserted blocks on their
  neighbours' mesh with the neighbours' mixed-precision / offload / reshard policy (read back
  from the neighbours' FSDP state, so a user's own ``fully_shard`` settings carry over);
* ``reinit_root(module)`` redoes FSDP's lazy root initialisation. FSDP builds the list of
  its units, their shared communication context and the parameter names once, at the first
  forward (``FSDPState._lazy_init``); a unit added later would otherwise make itself a second
  root at its first forward (it would keep its parameters gathered, run its own post-backward
  callback and be missing from the root's list). After an insertion or its rollback the root
  forgets that initialisation and does it again, so the new unit is one of the root's units
  (its parameters are all-gathered, resharded and reduce-scattered like the neighbours').
  This touches FSDP2's private state (``_is_root``, ``_state_ctx``): checked against torch 2.13.
* ``reshard_all(module)`` puts every unit back in its sharded state, so ``module.parameters()``
  are the sharded ``DTensor`` s the optimizer holds.

Every rank must call these in the same order (``fully_shard`` and the state-dict helpers run
collectives).
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch
from torch import nn

__all__ = [
    "fsdp_available", "unsharded_class", "is_sharded", "fsdp_units", "shard_blocks", "shard_policy", "shard_like_neighbours",
    "reinit_root", "reshard_all", "full_state_dict", "dp_mesh_of", "ShardedBlocksMixin", "zero_optimizer_state",
]  # fmt: skip


def fsdp_available() -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule, fully_shard  # noqa: F401
    except ImportError:  # pragma: no cover - torch < 2.6
        return False
    return True


def _state(module: nn.Module):
    """The FSDP2 state of ``module`` (None if it is no ``fully_shard`` unit)."""
    if not fsdp_available():  # pragma: no cover
        return None
    from torch.distributed.fsdp import FSDPModule

    return module._get_fsdp_state() if isinstance(module, FSDPModule) else None


def unsharded_class(module: nn.Module) -> type:
    """``module``'s own class: ``fully_shard`` swaps it for a generated ``FSDP<Class>`` subclass."""
    mro = type(module).__mro__
    if fsdp_available():
        from torch.distributed.fsdp import FSDPModule

        if FSDPModule in mro:
            return mro[mro.index(FSDPModule) + 1]
    return type(module)


def is_sharded(module: nn.Module) -> bool:
    """Is any submodule of ``module`` (itself included) an FSDP2 unit?"""
    return any(_state(m) is not None for m in module.modules())


def fsdp_units(module: nn.Module) -> list[nn.Module]:
    """The FSDP2 units in ``module`` (itself included), in ``modules()`` order."""
    return [m for m in module.modules() if _state(m) is not None]


def dp_mesh_of(device_mesh: Any) -> Any:
    """The data-parallel mesh of a Lightning ``ModelParallelStrategy`` mesh (its
    ``"data_parallel"`` dimension), or ``device_mesh`` itself when it has no named dimensions."""
    names = getattr(device_mesh, "mesh_dim_names", None) or ()
    return device_mesh["data_parallel"] if "data_parallel" in names else device_mesh


def shard_blocks(root: nn.Module, blocks: Iterable[nn.Module], mesh: Any, **policy: Any) -> nn.Module:
    """``fully_shard`` each of ``blocks`` then ``root`` on ``mesh`` with the same ``policy``
    (``mp_policy``, ``offload_policy``, ``reshard_after_forward``: ``fully_shard``'s own
    arguments). Units already sharded are left as they are, so this is safe to call again
    (Lightning calls ``configure_model`` at every ``fit``/``validate``/``test``)."""
    from torch.distributed.fsdp import fully_shard

    for block in blocks:
        if _state(block) is None:
            fully_shard(block, mesh=mesh, **policy)
    if _state(root) is None:
        fully_shard(root, mesh=mesh, **policy)
    return root


def shard_policy(unit: nn.Module) -> dict:
    """The ``fully_shard`` keyword arguments that reproduce ``unit``'s sharding: its mesh,
    mixed-precision policy, offload policy and reshard-after-forward setting."""
    state = _state(unit)
    if state is None:
        raise ValueError(f"unit: {type(unit).__name__} is not an FSDP2 unit (fully_shard was not applied to it)")
    groups = state._fsdp_param_groups
    if not groups:  # a unit without parameters of its own: only the mixed-precision policy is known
        return {"mp_policy": state._mp_policy}
    group = groups[0]
    policy: dict[str, Any] = {"mesh": group.mesh_info.mesh, "mp_policy": state._mp_policy,
                              "offload_policy": group.offload_policy}  # fmt: skip
    if not state._auto_reshard_after_forward:
        after = group.post_forward_mesh_info
        if after is None:
            policy["reshard_after_forward"] = False
        elif after.shard_mesh_size == group.mesh_info.shard_mesh_size:
            policy["reshard_after_forward"] = True
        else:
            policy["reshard_after_forward"] = int(after.shard_mesh_size)
    return policy


def _neighbour_unit(network: nn.Module, block: nn.Module) -> nn.Module | None:
    """An FSDP unit to copy ``block``'s sharding from: another block of the stage that holds
    ``block`` (the nearest one), else the nearest unit above it."""
    for stage_name in getattr(network, "growable_stages", ()):
        stage = network.stage(stage_name)
        position = next((i for i, m in enumerate(stage) if m is block), None)
        if position is None:
            continue
        others = sorted((abs(i - position), i) for i, m in enumerate(stage) if m is not block and _state(m) is not None)
        if others:
            return stage[others[0][1]]
    parents = {id(c): m for m in network.modules() for c in m.children()}
    node = parents.get(id(block))
    while node is not None:
        if _state(node) is not None:
            return node
        node = parents.get(id(node))
    return None


def shard_like_neighbours(network: nn.Module, blocks: Sequence[nn.Module], root: nn.Module | None = None) -> list[dict]:
    """``fully_shard`` just-inserted ``blocks`` like their neighbours, then ``reinit_root``.

    Blocks of an unsharded network are left alone. Returns the policy each block was sharded
    with (empty when nothing was sharded)."""
    from torch.distributed.fsdp import fully_shard

    if not is_sharded(root if root is not None else network):
        return []
    policies = []
    for block in blocks:
        neighbour = _neighbour_unit(network, block)
        if neighbour is None:
            raise RuntimeError(
                f"network: it is sharded with FSDP2 but no FSDP unit holds or neighbours the inserted "
                f"{type(block).__name__}; fully_shard the growable blocks and the root in configure_model "
                "(growtrain.fsdp.shard_blocks) so that a new block can be sharded like its neighbours"
            )
        policy = shard_policy(neighbour)
        if "mesh" not in policy:
            raise RuntimeError(f"network: the FSDP unit next to the inserted block ({type(neighbour).__name__}) has "
                               "no parameters to read its mesh from")  # fmt: skip
        fully_shard(block, **policy)
        policies.append(policy)
    reinit_root(root if root is not None else network)
    return policies


def _root_state(module: nn.Module):
    """The initialised FSDP root state in ``module`` (None if none ran a forward yet)."""
    for m in module.modules():
        state = _state(m)
        if state is not None and state._is_root:
            return state
    return None


def reinit_root(module: nn.Module) -> bool:
    """Redo FSDP2's lazy root initialisation over ``module``'s current units (see the module
    docstring). Returns False when no root was initialised yet (the first forward will do it).
    Call between iterations (no forward or backward in flight), on every rank."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPStateContext

    root = _root_state(module)
    if root is None:
        return False
    states = []
    for m in root._modules[0].modules():
        state = _state(m)
        if state is not None and state not in states:
            states.append(state)
    for state in states:
        state._is_root = None
        for group in state._fsdp_param_groups:
            group._module_fqn = None  # _init_fqns appends to a set name
    root._state_ctx = FSDPStateContext()
    root._lazy_init()
    return True


def reshard_all(module: nn.Module) -> None:
    """Every unit in its sharded state: the registered parameters are the sharded DTensors."""
    for unit in fsdp_units(module):
        unit.reshard()


def full_state_dict(module: nn.Module, *, cpu_offload: bool = True) -> dict[str, torch.Tensor]:
    """The whole (unsharded) state dict of an FSDP2-sharded ``module`` (a collective: call it
    on every rank). With ``cpu_offload`` (the default) it is gathered into rank 0's CPU memory
    and the other ranks get ``{}``; without, every rank gets it on the device. For a module
    that is not sharded this is its ordinary ``state_dict``."""
    if not is_sharded(module):
        return module.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload, broadcast_from_rank0=False)
    return get_model_state_dict(module, options=options)


class ShardedBlocksMixin:
    """``configure_model`` for a LightningModule with a growable network: under Lightning's
    ``ModelParallelStrategy`` (the module has a ``device_mesh``) it shards every block of the
    growable stages, then the network (the root unit: embeddings, final norm, head), on the
    mesh's data-parallel dimension; on one device or under DDP it does nothing.

    ``fsdp_policy`` (a dict, default empty) is passed to every ``fully_shard`` call, e.g.
    ``{"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)}``; blocks inserted by
    growth copy it from their neighbours. Needs ``growable_network`` (``GrowableModuleMixin``).
    """

    fsdp_policy: dict = {}

    def configure_model(self) -> None:
        mesh = getattr(self, "device_mesh", None)
        if mesh is None:
            return
        network = self.growable_network
        inside = {id(p) for p in network.parameters()}
        outside = [name for name, p in self.named_parameters() if id(p) not in inside]
        if outside:  # they would be neither sharded nor synchronised: the ranks would train them apart
            raise ValueError(
                f"configure_model: ShardedBlocksMixin shards the growable network only, but {type(self).__name__} "
                f"has parameters outside it ({', '.join(outside[:3])}{', ...' if len(outside) > 3 else ''}). Fix: "
                "override configure_model and fully_shard those modules too (growtrain.fsdp.shard_blocks shards the "
                "network's blocks and root)."
            )
        blocks = [b for stage in network.growable_stages for b in network.stage(stage)]
        shard_blocks(network, blocks, dp_mesh_of(mesh), **dict(self.fsdp_policy))


def zero_optimizer_state(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor]) -> list[str]:
    """Write the zero state that ``optimizer`` would create at the first step for each of
    ``params`` (new parameters, no state yet), so a checkpoint saved before that step has an
    entry for them: a distributed (DCP) checkpoint of an FSDP2 model is loaded into an optimizer
    whose every parameter has state, and fails on a parameter the checkpoint lacks.

    Adam/AdamW: ``step`` 0 and zero moments, exactly what their first step would create (so
    training is unchanged). SGD with momentum and no dampening: a zero momentum buffer (its first
    step then gives the same buffer, the gradient). Returns the problems for anything else (the
    state is left empty there: a sharded checkpoint saved before the new block's first step would
    not load)."""
    from torch.optim.optimizer import _get_scalar_dtype

    by_param = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    problems = []
    for p in params:
        group = by_param.get(id(p))
        if group is None or optimizer.state.get(p):
            continue
        if isinstance(optimizer, torch.optim.Adam) or isinstance(optimizer, getattr(torch.optim, "AdamW", ())):
            fused, capturable = bool(group.get("fused")), bool(group.get("capturable"))
            step = (torch.zeros((), dtype=_get_scalar_dtype(is_fused=fused), device=p.device) if fused or capturable
                    else torch.tensor(0.0, dtype=_get_scalar_dtype()))  # fmt: skip
            state = {"step": step, "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                     "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}  # fmt: skip
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            optimizer.state[p] = state
        elif isinstance(optimizer, torch.optim.SGD):
            if group.get("momentum", 0) and not group.get("dampening", 0):
                optimizer.state[p] = {"momentum_buffer": torch.zeros_like(p, memory_format=torch.preserve_format)}
            elif group.get("momentum", 0):
                problems.append(f"SGD with dampening={group['dampening']}")
        else:
            problems.append(type(optimizer).__name__)
    return sorted(set(problems))
