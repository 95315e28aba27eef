"""Noise a user cannot act on is gone where growtrain is the entry point: Lightning's
logger tips, its LeafSpec deprecation, the model summary's "Total Flops 0" and ``v_num`` on the
progress bar."""

from __future__ import annotations

import logging
import warnings

from growtrain.data import ImageDataModule
from growtrain.experiments._training import BaseGrowTrainer
from growtrain.module import ImageClassifier
from growtrain.quiet import quiet_upstream_noise


def test_growtrains_trainer_has_no_tips_no_zero_flops_and_no_v_num(tmp_path, caplog):
    dm = ImageDataModule(dataset="synthetic", image_size=8, synthetic_size=96, synthetic_classes=4, probe_size=16,
                         val_size=16, batch_size=32, augment=False)  # fmt: skip
    module = ImageClassifier(width=4, in_channels=3, num_classes=4)
    # the "lightning.pytorch" logger: other tests raise its level
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"), warnings.catch_warnings(record=True) as caught:
        trainer = BaseGrowTrainer(max_epochs=1, limit_train_batches=1, limit_val_batches=0, accelerator="cpu",
                                  default_root_dir=tmp_path)  # default logger, summary and progress bar
        trainer.fit(module, dm)
    text = caplog.text
    assert "| Name" in text and "Total params" in text  # the summary is still there ...
    assert "FLOPs" not in text and "Total Flops" not in text  # ... without the FLOPs it never counted
    assert "💡 Tip" not in text and not [w for w in caught if "tensorboardX" in str(w.message)]
    assert "Skipping setting a default" not in text
    metrics = trainer.progress_bar_callback.get_metrics(trainer, module)
    assert "v_num" not in metrics and "train_loss" in metrics


def test_quiet_filters_drop_exactly_the_listed_messages(caplog):
    quiet_upstream_noise()
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        logger.info("💡 Tip: For seamless cloud logging and experiment tracking, try installing [litlogger]")
        logger.info("GPU available: False, used: False")
    assert "Tip" not in caplog.text and "GPU available" in caplog.text
    with warnings.catch_warnings(record=True) as caught:
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec)`", FutureWarning)
        warnings.warn("something else", FutureWarning)
    assert [str(w.message) for w in caught] == ["something else"]
