"""Image data for growtrain: dataset registry, batched on-device transforms, datamodules.

Only `datamodule.py` imports Lightning; `sources`, `formats`, `transforms` and `imagefolder`
are plain torch/numpy so probe sets can be built and inspected without a Trainer.
"""

from .datamodule import ImageDataModule, SyntheticImageDataModule
from .formats import CorruptDatasetError, DatasetNotFoundError, read_idx
from .imagefolder import ImageFolder
from .text import ByteTokenizer, CharTokenizer, TextDataModule
from .sources import DATASET_INFO, DATASETS, DatasetInfo, load_images
from .transforms import augment_batch, normalize_batch

__all__ = [
    "DATASETS",
    "ByteTokenizer",
    "CharTokenizer",
    "TextDataModule",
    "DATASET_INFO",
    "CorruptDatasetError",
    "DatasetInfo",
    "DatasetNotFoundError",
    "ImageDataModule",
    "ImageFolder",
    "SyntheticImageDataModule",
    "augment_batch",
    "load_images",
    "normalize_batch",
    "read_idx",
]
