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
- Extra subcommands ``compare``, ``measure``, ``sweep``, ``match`` are methods of
  ``growtrain.trainer.GrowTrainer`` (the ``trainer_class``), listed in ``subcommands()``
  (name -> arguments to skip) as LightningCLI requires; each takes the config's model and data.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI

from growtrain.data import ImageDataModule
from growtrain.module import ImageClassifier
from growtrain.trainer import EXPERIMENTS, GrowTrainer

__all__ = ["GrowtrainCLI", "main"]

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
        kwargs.setdefault("trainer_class", GrowTrainer)  # its methods are the experiment subcommands
        super().__init__(*args, **kwargs)

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        # compare | measure | sweep | match: GrowTrainer methods, model and data from the config as for fit
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

        check_checkpoint_file(ckpt_path)
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
        return super().init_parser(**kwargs)

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

    Returns None: the console-script wrapper passes the return value to ``sys.exit``.
    """
    cli_class(args=args)


if __name__ == "__main__":  # pragma: no cover - `python -m growtrain.cli`
    main()
