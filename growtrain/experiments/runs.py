"""What the experiments share: rebuilding the configured module at another depth, loading
checkpoints, the resumable run log, and mean ± std formatting.

Rebuilding: an experiment never trains the module it was given; it builds fresh ones from the
module's *configuration* — ``model.hparams`` (through LightningCLI's own instantiator when the
CLI built the module, so ``OptimizerCallable`` configs come back as callables), with the
depth hyper-parameter changed. growtrain's modules drop callables given from Python from
their hparams and keep them as ``<name>_factory`` attributes; those are carried over. A
module whose configuration cannot be rebuilt (e.g. ``ImageClassifier(network=my_net)``) is
refused up front with a pointer to ``module_factory``.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from torch import nn

from growtrain.ckpt_file import check_checkpoint_file
from growtrain.growable import GrowableNetwork, probe_loss_for, replay_growth, resolve_network

__all__ = [
    "DEPTH_KWARGS",
    "ModuleFactory",
    "RunLog",
    "architecture",
    "architecture_digest",
    "load_checkpoint_into",
    "read_checkpoint_into",
    "read_checkpoint",
    "apply_checkpoint",
    "mean_std",
    "module_at_depth",
    "module_with_stages",
    "parse_depths",
    "probe_loss_of",
    "rebuild_module",
    "resolve_depth_kwarg",
    "rich_table",
    "stage_sizes",
]

# Hyper-parameters that set a model's depth, tried in this order when none is named.
DEPTH_KWARGS = ("added", "n_layer", "depth", "num_layers", "n_blocks")

ModuleFactory = Callable[..., LightningModule]
_CLI_INSTANTIATOR = "lightning.pytorch.cli.instantiate_module"


# -- the network inside a module ---------------------------------------------------------------
def growable_of(module: nn.Module) -> nn.Module:
    """The growable network inside ``module`` (``growtrain.growable.resolve_network``)."""
    try:
        return resolve_network(module)
    except (TypeError, ValueError) as err:
        raise TypeError(f"model: {err}") from err


def stage_sizes(network: GrowableNetwork) -> dict[str, int]:
    """Blocks per growable stage, in stage order: ``{"layer1": 2, "layer2": 1, …}``."""
    stages = getattr(network, "growable_stages", None) or list(dict.fromkeys(s.stage for s in network.sites()))
    return {s: len(network.stage(s)) for s in stages}


def architecture(module: nn.Module) -> list[tuple]:
    """The module tree: every submodule's name and type, every parameter's name and shape."""
    modules = [(name, type(m).__name__) for name, m in module.named_modules()]
    params = [(name, tuple(p.shape)) for name, p in module.named_parameters()]
    return modules + params


def architecture_digest(module: nn.Module) -> str:
    return hashlib.sha1(repr(architecture(module)).encode()).hexdigest()[:16]


# The module's probe loss (``module.probe_loss``, else cross-entropy): the library's one rule.
probe_loss_of = probe_loss_for


# -- rebuilding the configured module ----------------------------------------------------------
def _hparams(model: LightningModule) -> dict:
    return dict(getattr(model, "hparams", {}) or {})


def rebuild_module(model: LightningModule, module_factory: ModuleFactory | None = None, **overrides: Any):
    """A freshly initialised module with ``model``'s configuration and ``overrides``.

    Initialisation follows the global RNG: seed it first (``lightning.seed_everything``).
    """
    if module_factory is not None:
        return module_factory(**overrides)
    hp = _hparams(model)
    instantiator = hp.pop("_instantiator", None)
    hp.update(overrides)
    # The CLI links the datamodule's num_classes/in_channels into every model; a model class
    # without those arguments is saved with them as None (e.g. a LanguageModel), and
    # re-instantiation would pass them on. They carry no configuration: drop them.
    accepted = inspect.signature(type(model).__init__).parameters
    for key in [k for k, v in hp.items() if v is None and k not in accepted]:
        del hp[key]
    if instantiator == _CLI_INSTANTIATOR:
        from lightning.pytorch.cli import instantiate_module
        from lightning.pytorch.core.mixins.hparams_mixin import _given_hyperparameters_context

        # As LightningCLI itself does: the module saves its config (with `_class_path`), so
        # checkpoints of these runs load with `growtrain measure --ckpt_path` like `fit`'s do.
        with _given_hyperparameters_context(hparams=dict(hp), instantiator=_CLI_INSTANTIATOR):
            fresh = instantiate_module(type(model), hp)
    else:
        hp.pop("_class_path", None)
        fresh = type(model)(**hp)
    # growtrain modules keep callables given from Python (not in hparams) as `<name>_factory`.
    for name in _missing_init_args(model, hp):
        attr = f"{name}_factory"
        if hasattr(model, attr) and hasattr(fresh, attr):
            setattr(fresh, attr, getattr(model, attr))
    return fresh


def _missing_init_args(model: LightningModule, hp: dict) -> list[str]:
    params = inspect.signature(type(model).__init__).parameters.values()
    kinds = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [p.name for p in params if p.name != "self" and p.kind not in kinds and p.name not in hp]


def reference_module(model: LightningModule, module_factory: ModuleFactory | None = None, **overrides: Any):
    """A module built only to read its architecture: on the meta device (no memory, no RNG use)."""
    with torch.device("meta"):
        return rebuild_module(model, module_factory, **overrides)


def check_rebuildable(model: LightningModule, module_factory: ModuleFactory | None = None) -> None:
    """Refuse a module whose configuration does not rebuild its own architecture."""
    network = growable_of(model)
    records = list(getattr(network, "growth_log", []))
    if records:  # replaying growth needs real tensors
        with torch.random.fork_rng(devices=[]):
            fresh_net = growable_of(rebuild_module(model, module_factory))
        replay_growth(fresh_net, records)
    else:
        fresh_net = growable_of(reference_module(model, module_factory))
    if architecture(fresh_net) != architecture(network):
        raise ValueError(
            f"model: rebuilding {type(model).__name__} from its hyper-parameters gives a different network "
            "(was it built around a network passed from Python?). Pass module_factory=lambda **overrides: "
            "YourModule(..., **overrides) so the experiments can build fresh copies at other depths."
        )
    unknown = [n for n in _missing_init_args(model, _hparams(model)) if n != "network" and not hasattr(model, f"{n}_factory")]
    if unknown and module_factory is None:
        warnings.warn(
            f"model: {unknown} were given to {type(model).__name__} but are not in its hparams; fresh modules "
            "use their defaults. Pass module_factory to keep them.",
            stacklevel=3,
        )


def depth_offset(model: LightningModule, depth_kwarg: str) -> int:
    """Residual blocks minus the depth hyper-parameter (cifar_resnet ``added``: the 3 backbone
    blocks; GPT ``n_layer``: 0), read from the template module without building another."""
    network = growable_of(model)
    built = sum(stage_sizes(network).values()) - len(getattr(network, "growth_log", []))
    return built - int(_hparams(model)[depth_kwarg])


def resolve_depth_kwarg(model: LightningModule, depth_kwarg: str | None = None) -> str:
    """The hyper-parameter that sets depth: ``depth_kwarg`` or the first of ``DEPTH_KWARGS``."""
    hp = _hparams(model)
    if depth_kwarg is not None:
        if depth_kwarg not in hp:
            raise ValueError(f"depth_kwarg: {depth_kwarg!r} is not a hyper-parameter of the model; it has {sorted(hp)}")
        return depth_kwarg
    for name in DEPTH_KWARGS:
        if name in hp:
            return name
    raise ValueError(
        f"depth_kwarg: none of {list(DEPTH_KWARGS)} is a hyper-parameter of {type(model).__name__} "
        f"(it has {sorted(hp)}); name the one that sets depth, e.g. depth_kwarg='num_blocks'."
    )


def module_at_depth(model, value: int, depth_kwarg: str | None = None, module_factory=None):
    """A fresh module with its depth hyper-parameter set to ``value`` (e.g. ``added=N``)."""
    name = resolve_depth_kwarg(model, depth_kwarg)
    if not isinstance(value, int) or value < 0:
        raise ValueError(f"depth: expected a value of {name} ≥ 0, got {value!r}")
    return rebuild_module(model, module_factory, **{name: value})


def module_with_stages(model, sizes: dict[str, int], depth_kwarg: str | None = None, module_factory=None):
    """A fresh, constructor-initialised module whose growable stages have ``sizes`` blocks.

    A ``blocks`` hyper-parameter with one count per stage (cifar_resnet) gets the sizes (and
    ``added=0``); a single-stage network (GPT) gets its depth hyper-parameter. Every block is
    then initialised by the model's constructor, as in training from scratch.
    """
    hp, stages = _hparams(model), list(sizes)
    blocks = hp.get("blocks")
    if isinstance(blocks, (list, tuple)) and len(blocks) == len(stages):
        overrides = {"blocks": [int(sizes[s]) for s in stages]}
        if "added" in hp:
            overrides["added"] = 0
    elif len(stages) == 1:
        name = resolve_depth_kwarg(model, depth_kwarg)
        overrides = {name: int(sizes[stages[0]]) - depth_offset(model, name)}
    else:
        raise ValueError(
            f"model: cannot express stage sizes {sizes} through {type(model).__name__}'s hyper-parameters "
            "(expected `blocks` with one count per stage, or a single-stage network); pass module_factory."
        )
    fresh = rebuild_module(model, module_factory, **overrides)
    got = stage_sizes(growable_of(fresh))
    if got != dict(sizes):
        raise ValueError(f"model: asked for stage sizes {dict(sizes)} with {overrides}, the rebuilt network has {got}")
    return fresh


def load_checkpoint_into(module: LightningModule, ckpt_path: str | os.PathLike) -> LightningModule:
    """Load a Lightning checkpoint's weights into ``module``, in Lightning's order.

    ``on_load_checkpoint`` first (growtrain modules replay the recorded growth there), then
    ``load_state_dict``. Loaded with ``weights_only=True``, like ``LightningCLI``.
    """
    read_checkpoint_into(module, ckpt_path)
    return module


def read_checkpoint_into(module: LightningModule, ckpt_path: str | os.PathLike) -> dict:
    """:func:`load_checkpoint_into`, returning the checkpoint (its callbacks' states included),
    so a caller that needs more of it does not read the file twice."""
    checkpoint = read_checkpoint(ckpt_path)
    apply_checkpoint(module, checkpoint)
    return checkpoint


def read_checkpoint(ckpt_path: str | os.PathLike, *, mmap: bool = False) -> dict:
    """The checkpoint file as a dict, checked first (a missing or truncated file is an error that
    names it). ``mmap=True`` maps the tensors instead of reading them: a look at its other
    entries (the datamodule's split, the callbacks' states) costs no copy of the weights."""
    path = Path(ckpt_path)
    if not path.is_file():
        raise FileNotFoundError(f"ckpt_path: no checkpoint file at {str(path)!r}")
    check_checkpoint_file(path)
    if mmap:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # torch's legacy (pickle) format cannot be mapped: read it
            pass
    return torch.load(path, map_location="cpu", weights_only=True)


def apply_checkpoint(module: LightningModule, checkpoint: dict) -> None:
    """Load a read checkpoint into ``module`` in Lightning's order (growth replayed first)."""
    module.on_load_checkpoint(checkpoint)
    module.load_state_dict(checkpoint["state_dict"])


# -- data ---------------------------------------------------------------------------------------
def prepare(datamodule: LightningDataModule | None, what: str) -> LightningDataModule:
    if datamodule is None:
        raise ValueError(f"{what}: needs a datamodule (--data in the config); got None")
    datamodule.prepare_data()
    datamodule.setup("fit")
    return datamodule


def batches(
    datamodule: LightningDataModule, split: str, limit: int | None = None, device: torch.device | str | None = None
) -> Iterator[tuple]:
    """Batches of one split as the model sees them in evaluation: moved to ``device`` and
    through the datamodule's ``on_after_batch_transfer`` (normalisation), never augmented
    (no trainer is training). ``limit`` caps the number of samples."""
    saved = getattr(datamodule, "trainer", None)
    datamodule.trainer = None
    try:
        seen = 0
        for batch in getattr(datamodule, f"{split}_dataloader")():
            if device is not None:
                batch = datamodule.transfer_batch_to_device(batch, torch.device(device), 0)
            batch = datamodule.on_after_batch_transfer(batch, 0)
            x, y = batch[0], batch[1]
            if limit is not None:
                x, y = x[: limit - seen], y[: limit - seen]
            yield x, y
            seen += len(x)
            if limit is not None and seen >= limit:
                return
    finally:
        datamodule.trainer = saved


# -- results ------------------------------------------------------------------------------------
def fingerprint(*parts: Any) -> str:
    """A short digest of a configuration (callbacks by their type and plain settings)."""

    def plain(obj):
        if isinstance(obj, torch.Tensor):
            return obj.tolist()
        if isinstance(obj, Path):
            return str(obj)
        settings = {k: v for k, v in vars(obj).items() if not k.startswith("_") and isinstance(v, (int, float, str, bool, type(None)))} if hasattr(obj, "__dict__") else {}  # fmt: skip
        return {"type": type(obj).__qualname__, **settings}

    text = json.dumps(parts, sort_keys=True, default=plain)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


class RunLog:
    """Append-only JSON-lines record of finished runs, keyed; a rerun skips what it holds.

    Every row carries the configuration's fingerprint; a log written under another
    configuration is refused (results of different setups must not be averaged).
    """

    def __init__(self, path: str | os.PathLike, fingerprint: str, resume: bool = True):
        self.path, self.fingerprint = Path(path), fingerprint
        self.rows: dict[str, dict] = {}
        if self.path.exists() and not resume:
            rows = sum(1 for line in self.path.read_text().splitlines() if line.strip())
            warnings.warn(f"output_dir: resume=False discards the {rows} earlier result row(s) in {self.path} (as asked); "
                          "pass another output_dir to keep them.", UserWarning, stacklevel=2)  # fmt: skip
            self.path.unlink()
        if self.path.exists():
            for number, line in enumerate(self.path.read_text().splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by a kill: that run is redone
                    continue
                if row.get("fingerprint") != fingerprint:
                    raise ValueError(
                        f"output_dir: {self.path} (line {number}) holds results of a different configuration "
                        f"(fingerprint {row.get('fingerprint')} ≠ {fingerprint}). Use another output_dir, or resume=False "
                        "to discard them."
                    )
                self.rows[row["key"]] = row

    def get(self, key: str) -> dict | None:
        return self.rows.get(key)

    def add(self, key: str, row: dict) -> dict:
        row = {"key": key, "fingerprint": self.fingerprint, **row}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(row, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.rows[key] = row
        return row


def mean_std(values: Iterable[float | None]) -> tuple[float | None, float | None, int]:
    """Mean, sample standard deviation (ddof 1; None for one value) and count, Nones skipped."""
    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not xs:
        return None, None, 0
    mean = sum(xs) / len(xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else None
    return mean, std, len(xs)


def fmt(value: float | None, digits: int = 4) -> str:
    if value is None:
        return "—"
    if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
        return f"{value:.{max(digits - 1, 1)}e}"
    return f"{value:.{digits}f}"


def fmt_mean_std(stats: tuple, digits: int = 4) -> str:
    mean, std, _ = stats
    if mean is None:
        return "—"
    return fmt(mean, digits) if std is None else f"{fmt(mean, digits)} ± {fmt(std, digits)}"


def parse_depths(depths: str | Sequence[int]) -> list[int]:
    """``"a..b"`` (inclusive), ``"a..b..step"``, ``"1,3,5"`` or a list of ints."""
    if isinstance(depths, str):
        text = depths.strip()
        try:
            if ".." in text:
                parts = [int(p) for p in text.split("..")]
                if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] < 1):
                    raise ValueError
                start, stop, step = parts[0], parts[1], parts[2] if len(parts) == 3 else 1
                out = list(range(start, stop + 1, step))
            else:
                out = [int(p) for p in text.split(",") if p.strip()]
        except ValueError:
            raise ValueError(f"depths: expected 'a..b', 'a..b..step', '1,3,5' or a list of ints; got {depths!r}") from None
    else:
        out = [int(d) for d in depths]
    if not out or min(out) < 0:
        raise ValueError(f"depths: expected a non-empty list of depths ≥ 0, got {depths!r}")
    return out


def rich_table(header: Sequence[str], rows: Sequence[Sequence[str]], *, title: str, caption: str | None = None,
               left_columns: int = 1):  # fmt: skip
    """A rich Table: the first ``left_columns`` columns left-aligned (names), the rest right (numbers)."""
    from rich.table import Table

    table = Table(title=title, caption=caption)
    for i, name in enumerate(header):
        table.add_column(name, justify="left" if i < left_columns else "right")
    for cells in rows:
        table.add_row(*cells)
    return table


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
