"""The notebooks run top to bottom, use only the public API, and are committed
with their outputs."""

import importlib.util
import os
import pathlib
import re

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Notebooks 04, 06 and 08 (TF2, Keras 3) have their own tests:
# test_notebook_tf2.py.
NOTEBOOKS = sorted(p for p in (ROOT / "notebooks").glob("*.ipynb")
                   if not p.name.startswith(("04_", "06_", "08_")))
PRIVATE = re.compile(r"\b(gg|graphgrad|demo)\._(?!_)"
                     r"|from graphgrad\._|import graphgrad\._")


def _code(nb):
  return [c for c in nb.cells if c.cell_type == "code"]


def test_the_notebooks_exist():
  assert [p.name for p in sorted((ROOT / "notebooks").glob("*.ipynb"))] == [
      "01_seed_walkthrough.ipynb", "02_gradient_reversal.ipynb",
      "03_inspect_a_legacy_graph.ipynb", "04_tf2_migration.ipynb",
      "05_legacy_surgery.ipynb", "06_training_at_scale.ipynb",
      "07_saving_memory.ipynb", "08_private_training.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_with_outputs_and_public_api(path):
  nb = nbformat.read(str(path), as_version=4)
  for cell in _code(nb):
    assert not PRIVATE.search(cell.source), cell.source
    assert cell.execution_count is not None, "commit the notebook executed"
    for out in cell.outputs:
      assert out.output_type != "error", out
  # Pictures render on a repository page as embedded PNGs.
  assert any("image/png" in out.get("data", {})
             for cell in _code(nb) for out in cell.outputs)


# The README tells tf.compat.v1.layers users to set TF_USE_LEGACY_KERAS=1;
# the notebooks run both with it and without it (then tf.keras is Keras 3).
LEGACY_MODES = [pytest.param("1", id="legacy-keras"),
                pytest.param(None, id="keras3")]


def set_keras_mode(monkeypatch, legacy):
  """Sets or unsets TF_USE_LEGACY_KERAS for a notebook kernel."""
  if legacy is None:
    monkeypatch.delenv("TF_USE_LEGACY_KERAS", raising=False)
  elif importlib.util.find_spec("tf_keras") is None:
    pytest.skip("TF_USE_LEGACY_KERAS=1 needs tf-keras, which is not installed")
  else:
    monkeypatch.setenv("TF_USE_LEGACY_KERAS", legacy)


@pytest.mark.slow
@pytest.mark.parametrize("legacy", LEGACY_MODES)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path, legacy, monkeypatch):
  set_keras_mode(monkeypatch, legacy)
  # The kernel must import this checkout's graphgrad, installed or not.
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
      [str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
  monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "3")
  nb = nbformat.read(str(path), as_version=4)
  client = nbclient.NotebookClient(
      nb, timeout=300, kernel_name="python3",
      resources={"metadata": {"path": str(path.parent)}})
  client.execute()  # raises CellExecutionError on the first failing cell
  assert all(c.execution_count for c in _code(nb))
