"""An attached fit under MirroredStrategy, interrupted and resumed by
BackupAndRestore, ends where an uninterrupted run ends (subprocesses: the
two logical CPUs must be set before TensorFlow runs an op)."""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _phase(flavour, phase, out, backup):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
  env.pop("TF_USE_LEGACY_KERAS", None)
  done = subprocess.run(
      [sys.executable, str(HERE / "keras_fit_worker.py"), flavour, phase,
       str(out), str(backup)], env=env, capture_output=True, text=True,
      timeout=600, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  return done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("flavour", ["keras3", "tf_keras"])
def test_interrupted_fit_resumes_to_the_uninterrupted_weights(flavour,
                                                              tmp_path):
  backup = tmp_path / "backup"
  _phase(flavour, "whole", tmp_path / "whole.npz", backup)
  out = _phase(flavour, "interrupt", tmp_path / "cut.npz", backup)
  assert "INTERRUPTED at step 8" in out  # 2 of 4 epochs, 4 steps each
  _phase(flavour, "resume", tmp_path / "resumed.npz", backup)
  whole = np.load(tmp_path / "whole.npz")
  resumed = np.load(tmp_path / "resumed.npz")
  cut = np.load(tmp_path / "cut.npz")
  assert int(whole["step"]) == int(resumed["step"]) == 16
  for key in whole.files:
    np.testing.assert_allclose(resumed[key], whole[key], rtol=1e-6,
                               atol=1e-7)
  # The interrupted run had not arrived.
  assert max(float(np.max(np.abs(cut[k] - whole[k])))
             for k in whole.files if k != "step") > 1e-4
