"""2-process CPU (gloo) fits of GrowUntilSaturated under FSDP2 and DDP (run by tests/test_fsdp.py).

Lightning's launcher re-runs this script for rank 1, so it is a plain script:

    PYTHONPATH=. python tests/fsdp_script.py --out DIR --runs gpt:fsdp,gpt:ddp,llama:fsdp,...

Each run is a fit in the same two processes (one launch, several fits), on the same batches, of
growtrain's decoder (``gpt``: ``LanguageModel``), a tiny random HF Llama (``llama``: ``HFCausalLM``) or
a user's own module (``own``: a GrowableStack of MLP blocks with BatchNorm, ``ShardedBlocksMixin``):

* ``fsdp``: ``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)``, the module's
  own ``configure_model`` (one ``fully_shard`` unit per decoder block, then the root); a
  ``ModelCheckpoint`` writes a sharded checkpoint after every epoch;
* ``ddp``: ``strategy="ddp"``, the same module, data, seeds and callback;
* ``resume``: FSDP2 again, from the sharded checkpoint written after epoch ``--resume-epoch`` of
  the ``fsdp`` run, to the same number of epochs;
* ``resume_unhooked``: the same resume with the grower's resume hook taken away (must fail with
  a clear error, not train on at the wrong depth);
* ``full``: FSDP2 with ``save_distributed_checkpoint=False`` (one full-state file, rank 0);
* ``mp``: FSDP2 with bf16 compute (``MixedPrecisionPolicy``) and ``reshard_after_forward=False``
  on every unit: the new blocks must copy that policy;
* ``noshard``: FSDP2 with the new block left unsharded (the negative control: its gradients
  are never reduced, so the ranks drift apart);
* ``trial`` / ``trialddp``: the block-only trial decides each check, under FSDP2 (the trial
  block sharded like its neighbours) and under DDP (``TrialWatch`` records what each trial left);
* ``broken``: FSDP2 with the inserted block's output map made non-zero before sharding (the
  insertion must be caught by the output check and rolled back on every rank: the fit raises
  ``FunctionChangedError``, and the model, back at its depth, still runs sharded).

Each rank writes ``{model}:{run}_rank{r}.json`` (history, growth log, optimizer groups, facts about
the sharded new block seen right after the first growth) and rank 0 ``{model}:{run}_params.pt``
(the whole gathered state dict at the end); ``llama:fsdp`` also writes ``llama_hf`` with
``HFCausalLM.save_pretrained`` (gathered, written by rank 0).
"""

from __future__ import annotations

import argparse
import json
import os

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.utils.data import DataLoader, TensorDataset

from growtrain import GrowableStack, fsdp
from growtrain.callbacks import GrowUntilSaturated, Trial
from growtrain.fsdp import ShardedBlocksMixin
from growtrain.growable import grown_blocks
from growtrain.module import GrowableModuleMixin
from growtrain.optim import param_groups

VOCAB, T = 16, 8


class Tokens(L.LightningDataModule):
    """Random token sequences, next-token targets: 48 train, 20 probe (10 per rank), 8 per batch."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        # a learnable pattern (each token mostly predicts the next) plus noise
        base = torch.randint(0, VOCAB, (68, 1), generator=g)
        steps = torch.randint(0, 3, (68, T), generator=g)
        seq = (base + steps.cumsum(1)) % VOCAB
        x, y = seq[:, :-1], seq[:, 1:]
        self.train_set = TensorDataset(x[:48], y[:48])
        self.probe_set = TensorDataset(x[48:], y[48:])
        self.vocab_size = VOCAB

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=8, shuffle=True)

    def probe_dataloader(self):
        return DataLoader(self.probe_set, batch_size=8)


class Blobs(L.LightningDataModule):
    """4 Gaussian blobs in 4 dimensions: 96 train, 20 probe, 8 per batch (for ``own``)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        y = torch.randint(0, 4, (116,), generator=g)
        x = torch.randn(116, 4, generator=g) + 2 * torch.nn.functional.one_hot(y, 4).float()
        self.train_set, self.probe_set = TensorDataset(x[:96], y[:96]), TensorDataset(x[96:], y[96:])

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=8, shuffle=True)

    def probe_dataloader(self):
        return DataLoader(self.probe_set, batch_size=8)


class OwnModule(GrowableModuleMixin, ShardedBlocksMixin, L.LightningModule):
    """A user's own module as docs/fsdp.md's "Your own LightningModule" shows it: a GrowableStack of
    residual MLP blocks with BatchNorm (tests/helpers.MLPBlock), sharded by ShardedBlocksMixin."""

    growable_attr = "network"

    def __init__(self):
        super().__init__()
        from tests.helpers import MLP_TERMINAL, MLPBlock

        self.network = GrowableStack([MLPBlock(4, 8), MLPBlock(4, 8)], lambda: MLPBlock(4, 8), MLP_TERMINAL)

    def forward(self, x):
        return self.network(x)

    def training_step(self, batch, batch_idx):
        loss = torch.nn.functional.cross_entropy(self(batch[0]), batch[1])
        self.log("train_loss", loss, on_epoch=True, on_step=False)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(param_groups(self.network), lr=0.05, momentum=0.9)


def make_module(model: str):
    if model == "own":
        return OwnModule()
    if model == "gpt":
        from growtrain.lm import LanguageModel

        return LanguageModel(n_layer=2, d_model=16, n_head=2, block_size=T, vocab_size=VOCAB,
                             optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3))  # fmt: skip
    from growtrain.hf import HFCausalLM
    from growtrain.hf.tiny import tiny_model

    return HFCausalLM(model=tiny_model("llama", seed=0, vocab=VOCAB, hidden=16, layers=2, heads=2, context=T),
                      optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3))  # fmt: skip


class AfterGrowth(L.Callback):
    """After the grower: what the first growth left on this rank (the new block's parameters,
    FSDP's root state, the optimizer's groups and state)."""

    def __init__(self):
        self.facts: dict = {}

    def on_train_epoch_end(self, trainer, pl_module):
        blocks = grown_blocks(pl_module.growable_network)
        if not blocks or self.facts:
            return
        from torch.distributed.tensor import DTensor

        block = blocks[0]
        opt = trainer.optimizers[0]
        new = {id(p) for p in block.parameters()}
        groups = [g for g in opt.param_groups if any(id(p) in new for p in g["params"])]
        units = fsdp.fsdp_units(pl_module)
        roots = [u for u in units if u._get_fsdp_state()._is_root]
        root_state = roots[0]._get_fsdp_state() if len(roots) == 1 else None
        self.facts = {
            "block_is_unit": fsdp.is_sharded(block) and block in units,
            "dtensor_params": all(isinstance(p, DTensor) for p in block.parameters()),
            "in_root_states": root_state is not None and block in units
            and block._get_fsdp_state() in root_state._state_ctx.all_states,
            "roots": len(roots),
            "shared_ctx": root_state is not None and block in units
            and block._get_fsdp_state()._state_ctx is root_state._state_ctx
            # the communication context too: the implicit prefetch order (post_forward_order) lives there
            and all(g.comm_ctx is root_state._comm_ctx for g in block._get_fsdp_state()._fsdp_param_groups),
            "new_groups": [g.get("name") for g in groups],
            # zero state: what AdamW's first step would create (step 0, zero moments), written at once
            "new_group_state_zero": all(
                bool(opt.state.get(p)) and all(float(v.abs().sum()) == 0 for v in opt.state[p].values())
                for g in groups for p in g["params"]) if run_kind(trainer) == "fsdp" else
                all(len(opt.state.get(p, {})) == 0 for g in groups for p in g["params"]),
            "new_state_keys": sorted(opt.state.get(groups[0]["params"][0], {})) if groups else [],
            "policy": {k: str(getattr(v, "param_dtype", v)) for k, v in fsdp.shard_policy(block).items()
                       if k in ("mp_policy", "reshard_after_forward")} if fsdp.is_sharded(block) else None,
            "same_policy": _policy(block) == _policy(pl_module.growable_network.stage(
                pl_module.growable_network.growable_stages[0])[-1]) if fsdp.is_sharded(block) else None,
        }  # fmt: skip


class TrialWatch:
    """Wraps ``BlockTrials._one`` for a fit: what each trial left on this rank — the parameters'
    local checksum and gradient objects before and after, the number of FSDP units, and whether
    the trial block was one of them while it trained (read in ``train_block``)."""

    def __init__(self):
        from growtrain.callbacks import trial_check

        self.seen: list[dict] = []
        self.module, self.real = trial_check, trial_check.BlockTrials._one
        self.real_train = trial_check.train_block
        watch = self

        def train_block(forward, module, block, *args, **kwargs):
            watch.seen[-1]["block_sharded"] = fsdp.is_sharded(block) and block in fsdp.fsdp_units(module)
            return watch.real_train(forward, module, block, *args, **kwargs)

        def one(trials, trainer, pl_module, network, *args, **kwargs):
            params = list(pl_module.parameters())
            entry = {"sum_before": _local_sum(params), "units_before": len(fsdp.fsdp_units(pl_module))}
            grads = [p.grad for p in params]
            grad_sum = _local_sum([g for g in grads if g is not None])
            watch.seen.append(entry)
            out = watch.real(trials, trainer, pl_module, network, *args, **kwargs)
            after = list(pl_module.parameters())
            roots = [u._get_fsdp_state() for u in fsdp.fsdp_units(pl_module) if u._get_fsdp_state()._is_root]
            entry.update(sum_after=_local_sum(after), units_after=len(fsdp.fsdp_units(pl_module)),
                         root_states_after=[len(r._state_ctx.all_states) for r in roots],
                         same_params=len(after) == len(params) and all(a is b for a, b in zip(after, params)),
                         grads_kept=all(p.grad is g for p, g in zip(params, grads)),
                         grad_sum_before=grad_sum, grad_sum_after=_local_sum([g for g in grads if g is not None]),
                         grads_present=sum(g is not None for g in grads))  # fmt: skip
            return out

        trial_check.BlockTrials._one, trial_check.train_block = one, train_block

    def close(self):
        self.module.BlockTrials._one, self.module.train_block = self.real, self.real_train


def _local_sum(tensors) -> float:
    return float(sum(t.to_local().double().abs().sum() if hasattr(t, "to_local") else t.double().abs().sum()
                     for t in tensors))


def run_kind(trainer) -> str:
    return "fsdp" if type(trainer.strategy).__name__ == "ModelParallelStrategy" else "ddp"


def _policy(unit) -> str:
    p = fsdp.shard_policy(unit)
    return repr((p["mesh"], p["mp_policy"], p["offload_policy"], p.get("reshard_after_forward")))


def fit(args, name: str) -> None:
    out = args.out
    model, _, run = name.rpartition(":")
    model = model or "gpt"
    L.seed_everything(0)
    module = make_module(model)
    if run == "mp":  # a policy unlike fully_shard's defaults: the new blocks must copy it
        from torch.distributed.fsdp import MixedPrecisionPolicy

        module.fsdp_policy = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                              "reshard_after_forward": False}  # fmt: skip
    after = AfterGrowth()
    decision = "rule"  # the cross-fit rule at alpha=0.5 decides every check
    if run.startswith("trial"):  # the block-only trial decides: fsdp ("trial") against ddp ("trialddp")
        decision = Trial(min_gain=0.0)
    grow = GrowUntilSaturated(schedule="periodic", decision=decision, rule="crossfit", max_growths=2, alpha=0.5,
                              verbose=False, seed=1)  # fmt: skip
    trials = TrialWatch() if run.startswith("trial") else None
    ckpt_dir = os.path.join(out, f"{name}_ckpt")
    callbacks = [grow, after]
    strategy: object = "ddp"
    if run not in ("ddp", "trialddp"):
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1,
                                         save_distributed_checkpoint=run != "full")  # fmt: skip
    if run in ("fsdp", "full"):
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}", save_top_k=-1, every_n_epochs=1,
                                         save_on_train_epoch_end=True))  # fmt: skip
    epochs = args.epochs
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=epochs, callbacks=callbacks,
                        logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        default_root_dir=out, enable_checkpointing=run in ("fsdp", "full"))  # fmt: skip
    ckpt = None
    if run.startswith("resume"):
        ckpt = os.path.join(out, f"{model}:fsdp_ckpt", f"epoch={args.resume_epoch}.ckpt")
    error = None
    try:
        trainer.fit(module, Blobs() if model == "own" else Tokens(), ckpt_path=ckpt)
    except Exception as err:  # the "broken" run: recorded, then checked by the test
        if run not in ("broken", "resume_unhooked"):
            raise
        error = f"{type(err).__name__}: {err}"
    finally:
        if trials is not None:
            trials.close()
    rank = trainer.global_rank
    units = fsdp.fsdp_units(module)
    roots = [u._get_fsdp_state() for u in units if u._get_fsdp_state()._is_root]
    state = fsdp.full_state_dict(module)  # a collective (it runs after a rolled-back insertion too); rank 0 gets it
    grown = [p.full_tensor() if hasattr(p, "full_tensor") else p  # full_tensor: a collective, same order on all ranks
             for b in grown_blocks(module.growable_network) for p in b.parameters()]  # fmt: skip
    grown_sum = float(sum(t.detach().double().abs().sum() for t in grown)) if grown else None
    result = {
        "rank": rank, "run": run, "world_size": trainer.world_size, "history": grow.history,
        "growth_log": module.growable_network.growth_log, "error": error,
        "param_groups": [g.get("name") for g in trainer.optimizers[0].param_groups] if trainer.optimizers else [],
        "after_growth": after.facts, "depth": module.growable_network.depth(),
        "grown_sum": grown_sum, "trial_watch": trials.seen if trials is not None else None, "units": len(units), "root_states": [len(r._state_ctx.all_states) for r in roots],
        "local_checksum": float(sum(p.to_local().double().sum() if hasattr(p, "to_local") else p.double().sum()
                                    for p in module.parameters())),
    }  # fmt: skip
    if model == "llama" and run == "fsdp":
        module.save_pretrained(os.path.join(out, "llama_hf"))  # every rank: the state is gathered, rank 0 writes
    if rank == 0:
        torch.save(state, os.path.join(out, f"{name}_params.pt"))
    with open(os.path.join(out, f"{name}_rank{rank}.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--runs", default="gpt:fsdp,gpt:ddp", help="model:run,... (model gpt or llama)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--resume-epoch", type=int, default=1)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.set_num_threads(1)
    for name in args.runs.split(","):
        run = name.rpartition(":")[2]
        if run == "noshard":
            real = fsdp.shard_like_neighbours
            fsdp.shard_like_neighbours = lambda network, blocks, root=None: []
            try:
                fit(args, name)
            finally:
                fsdp.shard_like_neighbours = real
        elif run == "broken":
            real = fsdp.shard_like_neighbours

            def shard_then_break(network, blocks, root=None):
                with torch.no_grad():  # the inserted block's output map is no longer zero
                    for block in blocks:
                        for p in block.terminal_parameters():  # not a constant: ln_f would remove that
                            p.add_(torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) % 3 * 0.1)
                return real(network, blocks, root=root)

            fsdp.shard_like_neighbours = shard_then_break
            try:
                fit(args, name)
            finally:
                fsdp.shard_like_neighbours = real
        elif run == "resume_unhooked":  # the grower's resume hook taken away: a clear error, not wrong weights
            from growtrain.callbacks import sharded

            real_install = sharded.install_resume
            sharded.install_resume = lambda trainer, network_of: None
            try:
                fit(args, name)
            finally:
                sharded.install_resume = real_install
        else:
            fit(args, name)


if __name__ == "__main__":
    main()
