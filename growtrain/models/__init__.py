"""Growable networks built from the residual families."""

from growtrain.models.gpt import GPT, GPTConfig, gpt
from growtrain.models.resnet import CifarResNet, cifar_resnet, stage_counts

__all__ = ["CifarResNet", "cifar_resnet", "stage_counts", "GPT", "GPTConfig", "gpt"]
