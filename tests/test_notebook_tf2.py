"""Notebooks 04 (TF1 to TF2 migration), 06 (training at scale) and 08
(private training) run top to bottom, and are committed run."""

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
PRIVACY = ROOT / "notebooks" / "08_private_training.ipynb"


@pytest.mark.parametrize("path", [NOTEBOOK, TRAINING, PRIVACY],
                         ids=lambda p: p.stem)
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


def _number(pattern: str, text: str) -> float:
  found = re.search(pattern, text)
  assert found, pattern
  return float(found.group(1))


def _table(text: str):
  """Notebook 08's table: target to (epsilon, mean accuracy)."""
  rows = re.finditer(
      r"^ +(none|[\d.]+) +(?:-|[\d.]+) +(inf|[\d.]+) +[\d. ]+ ([\d.]+)$",
      text, re.MULTILINE)
  return {m.group(1): (float(m.group(2)), float(m.group(3))) for m in rows}


def test_the_readme_quotes_notebook_08():
  nb = nbformat.read(PRIVACY, as_version=4)
  rows = _table("".join(o.get("text", "") for c in nb.cells
                        if c.cell_type == "code" for o in c.outputs))
  private = ", ".join(f"{rows[t][1]:.0%}" for t in ("1", "2", "4"))
  with open(ROOT / "README.md", encoding="utf-8") as f:
    readme = " ".join(f.read().split())
  assert (f"reaches {private} and {rows['8'][1]:.0%} test accuracy at epsilon "
          f"1, 2, 4 and 8") in readme
  assert f"against {rows['none'][1]:.0%} without privacy" in readme


def test_notebook_08_shows_a_picture():
  nb = nbformat.read(PRIVACY, as_version=4)
  assert any("image/png" in out.get("data", {})
             for c in nb.cells if c.cell_type == "code" for out in c.outputs)


@pytest.mark.slow
@pytest.mark.skipif(_compat.TF_VERSION < (2, 16),
                    reason="the notebook shows TF2 with Keras 3, which TF 2.15 "
                           "does not bundle")
def test_notebook_08_executes(monkeypatch):
  # Keras 3 only: its ten training runs take about a minute, and privatize
  # in each Keras flavour's fit is tested in
  # tests/keras/test_keras_privatize.py.
  text = _executed_text(monkeypatch, None, PRIVACY)
  assert _number(r"reference: largest difference ([\d.e+-]+)", text) < 1e-6
  std = _number(r"std ([\d.e+-]+);", text)
  want = _number(r"sigma \* C / B = ([\d.e+-]+)", text)
  assert abs(std / want - 1) < 0.05
  assert _number(r"epsilon_callback \(target 2\): ([\d.]+)", text) <= 2.0
  rows = _table(text)
  for target in ("1", "2", "4", "8"):
    assert rows[target][0] <= float(target) + 1e-6, rows
  baseline, private = rows["none"][1], [rows[t][1] for t in ("1", "8")]
  assert baseline > 0.9 and private[0] < private[1] < baseline + 0.02, rows
