"""GrowUntilSaturated under FSDP2 (Lightning's ModelParallelStrategy): 2 CPU processes (gloo).

One launch of ``tests/fsdp_script.py`` runs fifteen fits in the same two processes (see its
docstring): growtrain's decoder (``gpt``) under FSDP2 and under DDP on the same batches (with the
first-order rule and the block-only trial deciding), a resume
from the FSDP2 run's sharded checkpoint, the same resume without the grower's hook, a full-state
checkpoint, bf16 compute with a non-default policy, two negative controls (the new block left
unsharded; an insertion that changes the function), a tiny random HF Llama under FSDP2, under
DDP and resumed, and a user's own module (``ShardedBlocksMixin`` over a GrowableStack of MLP
blocks with BatchNorm, SGD with momentum) under FSDP2 and DDP. The independent references are the DDP runs (the established path,
tests/test_ddp.py) and the uninterrupted run; the checks fail when a piece is taken away
(noshard, broken, resume_unhooked; and by hand: reinit_root, the policy copy, reshard_all and
the explicit zero state each disabled makes a test here fail).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from growtrain.callbacks import GrowUntilSaturated
from growtrain.callbacks.sharded import equal_shards

from tests.test_ddp import ROOT, _free_port, clean_env

RUNS = ("gpt:fsdp", "gpt:ddp", "gpt:resume", "gpt:resume_unhooked", "gpt:full", "gpt:mp", "gpt:noshard",
        "gpt:broken", "llama:fsdp", "llama:ddp", "llama:resume", "own:fsdp", "own:ddp",
        "gpt:trial", "gpt:trialddp")  # fmt: skip
LOCAL = ("max_abs_change", "tolerance")  # each rank verifies the insertion on its own first probe batch


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "fsdp_script.py"), "--out", str(out), "--runs", ",".join(RUNS)],
        cwd=ROOT, env=clean_env(dict(__import__("os").environ), _free_port()), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:]
    results = {name: [json.loads((out / f"{name}_rank{r}.json").read_text()) for r in (0, 1)] for name in RUNS}
    return results, out


def _params(out: Path, name: str) -> dict:
    """A run's gathered weights (the growth record, the network's extra state, is compared as each run's growth_log)."""
    return {k: v for k, v in torch.load(out / f"{name}_params.pt", weights_only=True).items() if torch.is_tensor(v)}


def _strip(history):
    return [{k: v for k, v in h.items() if k not in LOCAL} for h in history]


@pytest.mark.parametrize("model", ["gpt", "llama", "own"])
def test_growth_under_fsdp2_shards_the_new_block_like_its_neighbours(runs, model):
    results, _ = runs
    r0, r1 = results[f"{model}:fsdp"]
    assert r0["world_size"] == 2 and r0["error"] is None
    assert _strip(r0["history"]) == _strip(r1["history"])  # every rank the same verdicts and figures
    assert [h["action"] for h in r0["history"]] == ["grow", "grow", "budget"] and len(r0["growth_log"]) == 2
    assert r0["history"][0]["n"] == 20  # the probe's 20 samples, 10 per rank, all-reduced
    facts = r0["after_growth"]
    assert facts == r1["after_growth"]
    assert facts["block_is_unit"] and facts["dtensor_params"] and facts["same_policy"]
    # one root, whose lazily initialised list of units includes the new one, sharing its context
    assert facts["roots"] == 1 and facts["in_root_states"] and facts["shared_ctx"]
    # zero state, written at once: AdamW's step 0 and zero moments; SGD's zero momentum buffer (own)
    assert facts["new_group_state_zero"]
    assert facts["new_state_keys"] == (["momentum_buffer"] if model == "own" else ["exp_avg", "exp_avg_sq", "step"])
    groups = ["base", "growth0", "growth1"] if model == "own" else [  # own: SGD over param_groups(network)
        "base", "base/no_decay", "growth0", "growth0/no_decay", "growth1", "growth1/no_decay"]  # fmt: skip
    assert facts["new_groups"] == [g for g in groups if g.startswith("growth0")] and r0["param_groups"] == groups
    assert r0["units"] == r0["depth"] + 1 == 5 and r0["root_states"] == [5]  # blocks + root
    assert r0["history"][0]["max_abs_change"] == 0.0  # the sharded insertion is exact in float32
    assert r0["grown_sum"] == r1["grown_sum"]


@pytest.mark.parametrize("model", ["gpt", "llama", "own"])
def test_fsdp2_and_ddp_make_the_same_decisions_and_reach_the_same_parameters(runs, model):
    results, out = runs
    fs, dd = results[f"{model}:fsdp"][0], results[f"{model}:ddp"][0]
    assert fs["growth_log"] == dd["growth_log"]
    assert [(h["action"], h.get("site")) for h in fs["history"]] == [(h["action"], h.get("site")) for h in dd["history"]]
    for a, b in zip(fs["history"], dd["history"]):
        for key in ("params_before", "params", "depth_before", "depth", "saturated", "level"):  # DTensor numel = global
            assert a.get(key) == b.get(key), key
        for key in ("gamma", "n"):
            if b.get(key) is None:  # the budget check does not probe
                assert a.get(key) is None, key
                continue
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), key
        for sa, sb in zip(a.get("site_scores", []), b.get("site_scores", [])):
            assert sa["site"] == sb["site"]
            for key in ("grad_norm", "variance", "lower"):
                if sb[key] is None:  # σ̂² is computed only where a rule needs it (the paper rule)
                    assert sa[key] is None, (sa["site"], key)
                    continue
                assert sa[key] == pytest.approx(sb[key], rel=1e-5, abs=1e-8), (sa["site"], key)
    p_fsdp, p_ddp = _params(out, f"{model}:fsdp"), _params(out, f"{model}:ddp")
    # the growth record (the extra state: a tensor unsharded, a string under FSDP2) is compared by the decisions above
    p_fsdp = {k: v for k, v in p_fsdp.items() if not k.endswith("_extra_state")}
    ddp_keys = {k.removeprefix("module."): v for k, v in p_ddp.items() if not k.endswith("_extra_state")}
    assert set(p_fsdp) == set(ddp_keys) and len(p_fsdp) > 10
    for key, value in p_fsdp.items():
        torch.testing.assert_close(value, ddp_keys[key], rtol=1e-5, atol=1e-6, msg=key)


def test_block_only_trials_run_under_fsdp2_as_under_ddp_and_leave_the_network_as_it_was(runs):
    """decision='trial' under FSDP2: each trial block is sharded like its neighbours while it trains
    (FSDP gathers it and averages its gradients) and taken out again with its unit. The trials'
    figures, the verdicts and the grown network are those of the same fit under DDP (the trial's
    established path), and each trial leaves every rank's parameters, gradients and FSDP units as
    they were."""
    results, out = runs
    (fs, fs1), dd = results["gpt:trial"], results["gpt:trialddp"][0]
    assert [(h["action"], h.get("site")) for h in fs["history"]] == [(h["action"], h.get("site")) for h in dd["history"]]
    assert fs["history"] == fs1["history"]  # one decision on every rank
    judged = [(a["trial"]["trials"], b["trial"]["trials"]) for a, b in zip(fs["history"], dd["history"]) if "trial" in a]
    assert len(judged) >= 2 and fs["history"][0]["action"] == "grow"  # trials decided, and growth followed them
    for sharded_trials, ddp_trials in judged:
        assert [t["site"] for t in sharded_trials] == [t["site"] for t in ddp_trials]
        for a, b in zip(sharded_trials, ddp_trials):
            assert not a["diverged"] and a["steps"] == b["steps"] >= 100
            for key in ("gain_frac", "lower_frac", "upper_frac"):
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-7), key
    for rank in (fs, fs1):
        assert len(rank["trial_watch"]) == len(judged)
        for seen in rank["trial_watch"]:
            assert seen["block_sharded"] is True  # its own FSDP unit while it trained
            assert seen["sum_after"] == seen["sum_before"] and seen["same_params"] and seen["grads_kept"]
            # the training step's gradients, there at the check, untouched by the trial's backward
            assert seen["grads_present"] > 0 and seen["grad_sum_after"] == seen["grad_sum_before"]
            assert seen["units_after"] == seen["units_before"]
            assert seen["root_states_after"] == [seen["units_after"]]  # the root forgot the trial block's unit
        assert rank["root_states"] == [rank["units"]]  # the root forgot every trial block's unit
    assert all(seen["block_sharded"] is False for seen in dd["trial_watch"])
    p_fsdp, p_ddp = _params(out, "gpt:trial"), _params(out, "gpt:trialddp")
    # the growth record (the extra state: a tensor unsharded, a string under FSDP2) is compared by the decisions above
    p_fsdp = {k: v for k, v in p_fsdp.items() if not k.endswith("_extra_state")}
    ddp_keys = {k.removeprefix("module."): v for k, v in p_ddp.items() if not k.endswith("_extra_state")}
    assert set(p_fsdp) == set(ddp_keys)
    for key, value in p_fsdp.items():
        torch.testing.assert_close(value, ddp_keys[key], rtol=1e-5, atol=1e-6, msg=key)


def test_a_new_block_copies_a_non_default_policy_bf16_compute_and_no_reshard_after_forward(runs):
    results, _ = runs
    r0, r1 = results["gpt:mp"]
    assert r0["error"] is None and _strip(r0["history"]) == _strip(r1["history"])
    assert [h["action"] for h in r0["history"]] == ["grow", "grow", "budget"]
    facts = r0["after_growth"]
    assert facts["policy"] == {"mp_policy": "torch.bfloat16", "reshard_after_forward": "False"}
    assert facts["same_policy"] and facts["roots"] == 1 and facts["in_root_states"]
    # resharded before the optimizer took them, though these units keep their parameters gathered after a forward
    assert facts["dtensor_params"] and facts["new_groups"] == ["growth0", "growth0/no_decay"]
    # the probe ran in bf16 (autocast to the policy's dtype) and decided as the float32 run did
    fp32 = results["gpt:fsdp"][0]["history"]
    assert [h.get("site") for h in r0["history"]] == [h.get("site") for h in fp32]
    assert r0["history"][0]["gamma"] == pytest.approx(fp32[0]["gamma"], rel=0.05)


def test_negative_control_an_unsharded_new_block_drifts_apart_across_ranks(runs):
    results, _ = runs
    s0, _ = results["gpt:fsdp"]
    r0, r1 = results["gpt:noshard"]
    assert [h["action"] for h in r0["history"]][:1] == [h["action"] for h in s0["history"]][:1] == ["grow"]
    assert not r0["after_growth"]["block_is_unit"] and r0["units"] == 3  # the new blocks are no FSDP units
    assert r0["grown_sum"] != r1["grown_sum"]  # each rank trained its copy on its own gradients


def test_an_insertion_that_changes_the_function_is_rolled_back_on_every_rank(runs):
    results, _ = runs
    for r in results["gpt:broken"]:
        assert r["error"].startswith("FunctionChangedError: inserting blocks at ['h.2'] changed the network's output")
        assert r["growth_log"] == [] and r["depth"] == 2 and r["param_groups"] == ["base", "base/no_decay"]
        assert r["units"] == 3 and r["root_states"] == [3]  # the root forgot the removed unit
        # ... and the model still runs sharded collectives afterwards (the script gathered its state)


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_sharded_checkpoint_resume_grows_first_and_continues_identically(runs, model):
    results, out = runs
    full, resumed = results[f"{model}:fsdp"], results[f"{model}:resume"]
    for a, b in zip(full, resumed):  # resumed from the checkpoint written right after the second growth
        assert b["error"] is None and b["growth_log"] == a["growth_log"] and len(a["growth_log"]) == 2
        assert _strip(b["history"]) == _strip(a["history"])
        assert b["param_groups"] == a["param_groups"] and b["units"] == a["units"] == 5
    p_full, p_resumed = _params(out, f"{model}:fsdp"), _params(out, f"{model}:resume")
    assert set(p_full) == set(p_resumed)
    for key in p_full:
        torch.testing.assert_close(p_resumed[key], p_full[key], rtol=1e-6, atol=1e-7, msg=key)


def test_a_sharded_resume_without_the_growers_hook_is_a_clear_error(runs):
    results, _ = runs
    for r in results["gpt:resume_unhooked"]:  # without the grower's hook: refused, not trained at the wrong depth
        # the network's own load refuses (any module, the mixin not needed), before the mixin's hook would
        assert "RuntimeError: state_dict: it records 2 growth(s) but this FSDP2-sharded network has 0" in r["error"]
        assert "Fix: load it with GrowUntilSaturated in the trainer's callbacks" in r["error"]


def test_a_full_state_checkpoint_of_the_grown_model_loads_on_one_device(runs):
    from growtrain.lm import LanguageModel

    results, out = runs
    path = out / "gpt:full_ckpt" / "epoch=2.ckpt"
    assert path.is_file()  # save_distributed_checkpoint=False: one file, written by rank 0
    module = LanguageModel.load_from_checkpoint(path, map_location="cpu", weights_only=False,
                                                optimizer=lambda p: torch.optim.AdamW(p))  # fmt: skip
    assert module.network.depth() == 4 and module.network.growth_log == results["gpt:full"][0]["growth_log"]
    gathered = _params(out, "gpt:fsdp")
    for key, value in module.state_dict().items():
        if key in gathered:
            torch.testing.assert_close(value, gathered[key], rtol=1e-6, atol=1e-7, msg=key)
    assert module(torch.zeros(1, 7, dtype=torch.long)).shape == (1, 7, 16)


def test_save_pretrained_of_the_gathered_hf_model_loads_with_plain_transformers(runs):
    from transformers import AutoModelForCausalLM

    _, out = runs
    model = AutoModelForCausalLM.from_pretrained(out / "llama_hf", local_files_only=True)
    assert model.config.num_hidden_layers == 4 and len(model.model.layers) == 4
    gathered = _params(out, "llama:fsdp")
    state = model.state_dict()
    for key, value in gathered.items():
        torch.testing.assert_close(state[key.removeprefix("network.model.")], value, msg=key)


# -- single process: setup refusals and the probe shards ------------------------------------------
def _setup(strategy, world_size=2, **options):
    from growtrain.module import ImageClassifier

    trainer = SimpleNamespace(strategy=strategy, world_size=world_size, datamodule=None)
    GrowUntilSaturated(verbose=False, **options).setup(trainer, ImageClassifier(width=4), "fit")


def test_refused_strategies_name_the_reason_and_the_alternative():
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    with pytest.raises(RuntimeError, match=r"FSDPStrategy \(FSDP1 flattens .*Fix: use ModelParallelStrategy"):
        _setup(FSDPStrategy())
    deepspeed = type("DeepSpeedStrategy", (), {})()
    with pytest.raises(RuntimeError, match=r"DeepSpeed owns the optimizer.*Fix: use ModelParallelStrategy \(FSDP2\)"):
        _setup(deepspeed)
    with pytest.raises(RuntimeError, match=r"tensor_parallel_size=2 .*Fix: ModelParallelStrategy\(data_parallel_size=2"):
        _setup(ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2))
    fsdp2 = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    # every decision but the stage fork passes the strategy check under FSDP2 (the block-only trial too: gpt:trial
    # runs it); the stage fork's arm is a full, unsharded copy: refused with the fix
    for accepted in ({"schedule": "converged"}, {"schedule": "converged", "decision": "trial"},
                     {"schedule": "periodic", "decision": "trial"}, {"schedule": "converged", "decision": "rule"}):
        with pytest.raises(ValueError, match="probe: no probe data"):  # on to the next one (no datamodule here)
            _setup(fsdp2, **accepted)
    with pytest.raises(RuntimeError, match=r"^strategy: decision='stage_fork' .*\(decision='trial'\) under FSDP2"):
        _setup(fsdp2, schedule="periodic")
    with pytest.raises(RuntimeError, match=r"^strategy: decision='budget_fork' .*\(decision='trial'\) under FSDP2"):
        _setup(fsdp2)  # the default's fork arm, too: refused before training


def test_equal_shards_give_every_rank_the_same_number_of_probe_samples():
    loader = DataLoader(TensorDataset(torch.arange(21.0), torch.arange(21)), batch_size=4)
    shards = [[int(i) for i in equal_shards(loader, r, 2).sampler] for r in (0, 1)]
    assert [len(s) for s in shards] == [10, 10]
    assert sorted(shards[0] + shards[1]) == list(range(20))  # the last 21 mod 2 = 1 sample left out
    assert [len(list(equal_shards(loader, r, 2))) for r in (0, 1)] == [3, 3]  # batches line up
    with pytest.raises(ValueError, match="probe: 1 probe sample"):
        equal_shards(DataLoader(TensorDataset(torch.ones(1), torch.ones(1)), batch_size=1), 0, 2)


def test_sharded_blocks_mixin_refuses_parameters_outside_the_network_and_is_a_no_op_without_a_mesh():
    from growtrain import fsdp
    from growtrain.lm import LanguageModel

    module = LanguageModel(n_layer=1, d_model=8, n_head=2, block_size=4, vocab_size=8)
    module.configure_model()  # one device / DDP: no device mesh, nothing sharded
    assert not fsdp.is_sharded(module)
    module.extra = torch.nn.Linear(2, 2)
    module._device_mesh = object()  # as ModelParallelStrategy sets it; refused before any fully_shard
    with pytest.raises(ValueError, match=r"parameters outside it \(extra.weight, extra.bias\). Fix: override"):
        module.configure_model()
