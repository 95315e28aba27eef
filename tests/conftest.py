"""Shared tiny fixtures. Every test here must stay small: the CI machine may have 2 shared cores."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from growtrain.data import ImageDataModule


@pytest.fixture(autouse=True)
def _one_thread():
    # Measured on the shared 2-core machine under load: a width-4 ResNet step took ~2 s with
    # torch's default 2 intra-op threads and ~30 ms with 1 (spinning threads fight the other
    # processes). On an idle machine 1 thread costs these tiny tests almost nothing.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _work_in_tmp(tmp_path, monkeypatch):
    """Every test runs in its own temporary directory: a Trainer without ``default_root_dir``
    writes ``lightning_logs/`` and ``growth_history.json`` into the working directory, which must
    never be the checkout. Tests reach repository files through absolute paths."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(autouse=True)
def _isolated_random_state():
    """Every test starts from the same global random state and leaves none behind.

    A test that draws from the global generators (``torch.randn`` without ``generator=``,
    ``random``, ``numpy.random``) would otherwise see whatever earlier tests consumed, so its
    numbers would depend on which tests ran before it. ``lightning.seed_everything`` also sets
    ``PL_GLOBAL_SEED``/``PL_SEED_WORKERS`` in the environment; those are restored too.
    """
    py_state, np_state = random.getstate(), np.random.get_state()
    env = {k: os.environ.get(k) for k in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        random.seed(0)
        np.random.seed(0)
        yield
    random.setstate(py_state)
    np.random.set_state(np_state)
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def tiny_data() -> ImageDataModule:
    """256 learnable synthetic 8×8 RGB images in 4 classes: 192 train, 32 probe, 32 val."""
    return ImageDataModule(
        dataset="synthetic",
        synthetic_size=256,
        synthetic_classes=4,
        image_size=8,
        channels=3,
        probe_size=32,
        val_size=32,
        batch_size=32,
    )


@pytest.fixture
def quiet_trainer_kwargs(tmp_path) -> dict:
    """Trainer settings for tests: CPU, no logger, no progress bar, files under tmp_path."""
    return dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
    )


@pytest.fixture(autouse=True)
def _lightning_logs_reach_caplog(monkeypatch):
    """Lightning's logger does not propagate to the root logger, where ``caplog`` listens: a test that
    reads its lines would pass or fail by which test ran before it in the same worker."""
    import logging

    monkeypatch.setattr(logging.getLogger("lightning.pytorch"), "propagate", True)
