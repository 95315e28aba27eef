"""notebooks/growth_walkthrough.ipynb runs top to bottom (GROWTRAIN_NOTEBOOK_FAST=1 budgets)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "growth_walkthrough.ipynb"


def test_walkthrough_notebook_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("GROWTRAIN_NOTEBOOK_FAST", "1")
    monkeypatch.setenv("GROWTRAIN_NOTEBOOK_OUT", str(tmp_path / "out"))
    # One intra-op thread: on a shared 2-core machine spinning threads fight other processes
    # (see tests/conftest.py); the kernel is a subprocess, so it is told through the env.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})  # fmt: skip
    client.execute()
    out = tmp_path / "out"
    assert (out / "gamma_trace.png").stat().st_size > 0
    assert (out / "measure_before" / "measure.json").exists() and (out / "measure_after" / "measure.json").exists()
    assert "Train loss Scratch" in (out / "compare" / "compare.md").read_text()
    errors = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", []) if o.output_type == "error"]
    assert not errors
    images = [o for cell in notebook.cells for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
    assert images, "the Γ̂ trace is displayed"
