"""``growtrain`` command line: LightningCLI with growtrain's module and data as defaults.

    growtrain fit --config configs/quickstart.yaml
    growtrain fit --config configs/resnet.yaml --trainer.max_epochs=10
    growtrain fit --print_config              # every key, with its default

Design choices:
- Model and data are in *subclass mode*: ``model.class_path`` may name any LightningModule
  (``ImageClassifier`` by default) and ``data.class_path`` any LightningDataModule
  (``ImageDataModule`` by default). Keys of the default classes work without a class_path
  (``--model.width=8``).
- The datamodule's ``num_classes`` and ``in_channels`` are linked into the model's arguments
  when the classes are instantiated, so a config names the dataset once.
- No top-level ``optimizer:``/``lr_scheduler:`` keys: LightningCLI builds those once over the
  parameters that exist at start-up, and a grown network would keep training with that stale
  optimizer. The optimizer is a model argument (``model.init_args.optimizer``), rebuilt by
  ``configure_optimizers`` whenever Lightning asks.
- Extra subcommands ``compare``, ``stopping``, ``measure``, ``sweep``, ``match`` are methods of
  ``growtrain.trainer.GrowTrainer`` (the ``trainer_class``), listed in ``subcommands()``
  (name -> arguments to skip) as LightningCLI requires; each takes the config's model and data.
- Messages: ``growtrain --help`` describes growtrain; ``fit --help`` says how to list
  the growth callback's arguments; a parse error is one ``error:`` line (no usage dump) and a
  YAML error names its file (``GrowtrainParser``); a class's own validation error comes out as
  itself (``instantiate_classes``), one line from ``main``; a ``ckpt_path`` is checked before
  LightningCLI reads its hyper-parameters, and the model arguments they override are reported.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI

from growtrain.data import ImageDataModule
from growtrain.module import ImageClassifier
from growtrain.quiet import quiet_upstream_noise
from growtrain.resume import CLI_ARGV_ATTRIBUTE
from growtrain.trainer import EXPERIMENTS, GrowTrainer

__all__ = ["GrowtrainCLI", "main"]

# A first command that needs no file from the repository (the default model and data need no arguments)
START_ANYWHERE = ("growtrain fit --trainer.callbacks+=growtrain.callbacks.GrowUntilSaturated "
                  "--trainer.callbacks.schedule.monitor=val_loss --trainer.max_epochs=60 --trainer.default_root_dir=runs/first")
DESCRIPTION = (
    "growtrain: train a residual network (or a small transformer) with PyTorch Lightning and make it deeper, one "
    "function-preserving block at a time, while a statistical test on a held-out probe sample says more depth still "
    "lowers the loss; then stop (the paper's 'grow until saturated'). Subcommands: fit | validate | test | predict "
    "(Lightning's), and the experiments compare | stopping | sweep | measure | match. Start with, in a checkout of "
    "the repository (the configs are not installed with the package): growtrain fit --config configs/quickstart.yaml. "
    "Anywhere else, the built-in ResNet on the embedded Fashion-MNIST subset with the growth callback: "
    f"{START_ANYWHERE}"
)
FIT_DESCRIPTION = (
    "Train a model; with growtrain.callbacks.GrowUntilSaturated among trainer.callbacks (as in configs/quickstart.yaml) "
    "it grows. The growth callback's arguments: growtrain fit --trainer.callbacks.help "
    "growtrain.callbacks.GrowUntilSaturated. Add it on the command line: --trainer.callbacks+="
    "growtrain.callbacks.GrowUntilSaturated --trainer.callbacks.schedule.monitor=val_loss"
)


class GrowtrainParser(LightningArgumentParser):
    """A parse error is one ``error:`` line first (the usage, hundreds of Trainer options long, is
    left to ``--help``), and a YAML error names its config file instead of ``"<unicode string>"``."""

    config_files: tuple[str, ...] = ()

    def error(self, message: str, ex: Exception | None = None):  # type: ignore[override]
        if len(self.config_files) == 1:
            message = message.replace('"<unicode string>"', repr(self.config_files[0]))
        elif self.config_files:
            message = message.replace('"<unicode string>"', f"one of the config files {list(self.config_files)}")
        from jsonargparse._common import debug_mode_active

        if not self.exit_on_error or debug_mode_active():
            return super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        prog = parser.prog.replace(" [options]", "")
        sys.stderr.write(f"error: {message}\ntip: {prog} --help lists every option\n")
        self.exit(2)


class ConfigError(Exception):
    """Marks an error raised while the config's classes were built (shown as one line by ``main``)."""


def _root_cause(error: BaseException) -> BaseException:
    while error.__cause__ is not None:
        error = error.__cause__
    return error


# Model arguments the datamodule decides (linked at instantiation; a model class without the
# argument ignores the link, so e.g. a language model can use the same CLI).
_LINKED = ("num_classes", "in_channels")


class GrowtrainCLI(LightningCLI):
    """LightningCLI with growtrain defaults; see the module docstring for the choices."""

    default_model: type[LightningModule] = ImageClassifier
    default_data: type[LightningDataModule] = ImageDataModule

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("model_class", LightningModule)
        kwargs.setdefault("datamodule_class", LightningDataModule)
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("auto_configure_optimizers", False)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        # Lightning's default (True) seeds with 0 anyway when PL_GLOBAL_SEED is unset, after a
        # "No seed found" warning on every run without a seed_everything line: say 0 outright
        kwargs.setdefault("seed_everything_default", 0)
        kwargs.setdefault("trainer_class", GrowTrainer)  # its methods are the experiment subcommands
        kwargs.setdefault("parser_class", GrowtrainParser)  # parse errors first, YAML errors name their file
        parser_kwargs = dict(kwargs.get("parser_kwargs") or {})
        parser_kwargs.setdefault("description", DESCRIPTION)
        parser_kwargs.setdefault("fit", {}).setdefault("description", FIT_DESCRIPTION)
        kwargs["parser_kwargs"] = parser_kwargs
        given = kwargs.get("args", args[0] if args else None)
        argv = sys.argv[1:] if given is None else given
        self._config_files = tuple(_config_files(argv))
        # the command line as given, for the command that resumes an interrupted fit (growtrain.resume)
        self._argv = [str(a) for a in argv] if isinstance(argv, (list, tuple)) else None
        super().__init__(*args, **kwargs)

    def instantiate_classes(self) -> None:
        """Build the config's classes; a growtrain (or user) validation error raised in a class's
        ``__init__`` comes out as itself, not inside jsonargparse's union-type dump."""
        try:
            super().instantiate_classes()
        except Exception as error:
            root = _root_cause(error)
            if root is error or not isinstance(root, (ValueError, TypeError)):
                raise
            root._growtrain_config_error = True  # type: ignore[attr-defined]
            raise root from None
        if self._argv is not None:
            setattr(self.trainer, CLI_ARGV_ATTRIBUTE, list(self._argv))

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        # compare | measure | sweep | match | stopping: GrowTrainer methods, model and data from the config as for fit
        return {**LightningCLI.subcommands(), **{name: {"model", "datamodule"} for name in EXPERIMENTS}}

    def _parse_ckpt_path(self) -> None:
        """LightningCLI builds the model from the checkpoint's hyper-parameters when ``ckpt_path`` is
        given (they made the saved weights), overriding the config's model section. growtrain checks
        the file first (a truncated file is an error naming it) and reports every model argument the
        checkpoint overrode, instead of ignoring the config silently."""
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if not ckpt_path:
            return super()._parse_ckpt_path()
        from growtrain.ckpt_file import check_checkpoint_file

        try:
            check_checkpoint_file(ckpt_path)
        except ValueError as error:
            error._growtrain_config_error = True  # type: ignore[attr-defined]
            raise
        before = _model_args(self.config[subcommand])
        super()._parse_ckpt_path()
        after = _model_args(self.config[subcommand])
        changed = {k: (before.get(k), after.get(k)) for k in sorted(set(before) | set(after))
                   if k not in _LINKED and before.get(k) != after.get(k)}  # fmt: skip
        if changed:
            import warnings

            listed = "; ".join(f"{k}: config {a!r}, checkpoint {b!r}" for k, (a, b) in changed.items())
            warnings.warn(
                f"ckpt_path: {ckpt_path} was saved with model arguments that differ from the config's model section "
                f"({listed}); the model is built with the checkpoint's (its weights need them). Fix: make the "
                "config's model section match the checkpoint, or pass the checkpoint that was meant.",
                UserWarning, stacklevel=2,
            )  # fmt: skip

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        # A mistyped key must be an error, not silently expanded to a longer key that happens
        # to start with it (argparse abbreviations; jsonargparse 5 turns them off too).
        kwargs.setdefault("allow_abbrev", False)
        parser = super().init_parser(**kwargs)
        parser.config_files = getattr(self, "_config_files", ())
        return parser

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.set_defaults(
            {
                "model": {"class_path": f"{self.default_model.__module__}.{self.default_model.__qualname__}"},
                "data": {"class_path": f"{self.default_data.__module__}.{self.default_data.__qualname__}"},
            }
        )
        for name in _LINKED:
            parser.link_arguments(
                "data",
                f"model.init_args.{name}",
                compute_fn=_attribute(name),
                apply_on="instantiate",
            )


def _model_args(config: Any) -> dict[str, Any]:
    """The model's arguments in a subcommand's config, as plain data (class path included)."""
    model = config.get("model")
    if model is None:
        return {}
    model = model.as_dict() if hasattr(model, "as_dict") else dict(model)
    args = dict(model.get("init_args") or {})
    args.update(model.get("dict_kwargs") or {})
    if model.get("class_path"):
        args["class_path"] = model["class_path"]
    return args


def _attribute(name: str):
    # None when the datamodule lacks the attribute: a model class without that argument
    # ignores the link (a language model with a text datamodule); ImageClassifier rejects None
    # with an error that names the datamodule attribute.
    def get(data: Any) -> Any:
        return getattr(data, name, None)

    return get


def main(args: ArgsType = None, cli_class: type[LightningCLI] = GrowtrainCLI) -> None:
    """Console entry point (``growtrain``); ``args`` as in LightningCLI (default: ``sys.argv``).

    Returns None: the console-script wrapper passes the return value to ``sys.exit``. An error in
    the config's values (raised while its classes are built, or a bad ``ckpt_path`` file) is one
    ``error:`` line and exit status 2, like a parse error; a data set that is neither on disk nor
    downloadable is one ``error:`` line naming the file and the fix (status 1); everything else keeps
    its traceback.
    """
    quiet_upstream_noise()
    try:
        cli_class(args=args)
    except Exception as error:
        from growtrain.data.formats import DatasetNotFoundError

        if isinstance(error, DatasetNotFoundError):  # a missing archive and no network: the file and the fix
            sys.stderr.write(f"error: {error}\n")
            raise SystemExit(1) from None
        if not getattr(error, "_growtrain_config_error", False):
            raise
        sys.stderr.write(f"error: {error}\n")
        raise SystemExit(2) from None


def _config_files(argv: Any) -> list[str]:
    """The ``--config``/``-c`` files named in ``argv`` (a list of strings; anything else: none)."""
    if not isinstance(argv, (list, tuple)):
        return []
    files, argv = [], [str(a) for a in argv]
    for i, arg in enumerate(argv):
        if arg in ("--config", "-c") and i + 1 < len(argv):
            files.append(argv[i + 1])
        elif arg.startswith("--config="):
            files.append(arg.split("=", 1)[1])
    return [os.fspath(f) for f in files]


if __name__ == "__main__":  # pragma: no cover - `python -m growtrain.cli`
    main()
