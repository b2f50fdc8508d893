"""Notebooks 04 (TF1 to TF2 migration) and 06 (training at scale) run top
to bottom, and are committed run."""

import os
import pathlib
import re

import nbclient
import nbformat
import pytest
from test_notebooks import LEGACY_MODES, set_keras_mode

from graphgrad import _compat

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "04_tf2_migration.ipynb"
TRAINING = ROOT / "notebooks" / "06_training_at_scale.ipynb"


@pytest.mark.parametrize("path", [NOTEBOOK, TRAINING], ids=lambda p: p.stem)
def test_notebook_is_committed_with_outputs(path):
  nb = nbformat.read(path, as_version=4)
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert code and all(c.execution_count is not None for c in code)
  assert all(c.outputs for c in code)
  assert not any("graphgrad._" in c.source for c in code)


def _executed_text(monkeypatch, legacy, path) -> str:
  """Executes the notebook at ``path`` in the Keras mode; returns its text."""
  set_keras_mode(monkeypatch, legacy)
  monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "3")
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
      [str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
  nb = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(
      nb, timeout=300, kernel_name="python3",
      resources={"metadata": {"path": str(path.parent)}})
  client.execute()  # raises CellExecutionError on any failing cell
  return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                 for o in c.outputs)


@pytest.mark.skipif(_compat.TF_VERSION < (2, 16),
                    reason="the notebook shows TF2 with Keras 3, which TF 2.15 "
                           "does not bundle")
@pytest.mark.parametrize("legacy", LEGACY_MODES)
def test_notebook_04_executes(monkeypatch, legacy):
  # The notebook shows TF2 as users get it: Keras 3 behind tf.keras; it also
  # runs with TF_USE_LEGACY_KERAS=1 (tf-keras), which the README tells
  # tf.compat.v1.layers users to set. It must import this checkout's
  # graphgrad, installed or not.
  text = _executed_text(monkeypatch, legacy, NOTEBOOK)
  assert "equal within rtol=1e-5, atol=1e-6" in text
  # The hand recipe's TF2 failure, in the words of each Keras.
  assert ("has never been called" if legacy is None
          else "has no inbound nodes") in text



@pytest.mark.slow
@pytest.mark.skipif(_compat.TF_VERSION < (2, 16),
                    reason="the notebook shows TF2 with Keras 3, which TF 2.15 "
                           "does not bundle")
@pytest.mark.parametrize("legacy", LEGACY_MODES)
def test_notebook_06_executes(monkeypatch, legacy):
  text = _executed_text(monkeypatch, legacy, TRAINING)
  assert "fit vs hand-written loop" in text and "replicas: 2" in text
  errors = [float(e) for e in re.findall(
      r"loss_scale=optimizer: largest difference to float32 ([\d.e+-]+)",
      text)]
  unscaled = [float(e) for e in re.findall(
      r"loss_scale=None: largest difference to float32 ([\d.e+-]+)", text)]
  assert errors and errors[0] < 2e-4 < unscaled[0]
