"""growtrain's own code emits no warning in a normal run: the suite no longer
blanket-ignores UserWarning, and these runs record every warning and fail on any raised from
growtrain's files or about a tensor that requires grad being converted to a number."""

from __future__ import annotations

import warnings
from pathlib import Path

import growtrain
from growtrain.data import ImageDataModule
from growtrain.experiments import run_match
from growtrain.module import ImageClassifier

PACKAGE = Path(growtrain.__file__).resolve().parent


def ours(caught) -> list[str]:
    bad = []
    for w in caught:
        text = str(w.message)
        if Path(w.filename).resolve().is_relative_to(PACKAGE) or "requires_grad=True to a scalar" in text:
            bad.append(f"{w.filename}:{w.lineno}: {w.category.__name__}: {text}")
    return bad


def test_match_emits_no_warning(tmp_path):
    data = ImageDataModule(dataset="synthetic", image_size=8, synthetic_size=160, synthetic_classes=4, probe_size=32,
                           val_size=16, batch_size=16, augment=False)  # fmt: skip
    model = ImageClassifier(width=4, in_channels=3, num_classes=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run_match(model, data, alpha=1e-2, seeds=[0], steps=5, samples=32, output_dir=tmp_path)
    assert len(result.runs) == 1
    assert not ours(caught), ours(caught)
