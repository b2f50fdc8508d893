"""examples/keras_fit_distributed.py runs and trains (fresh subprocess: its
two logical CPUs must be set before TensorFlow runs an op)."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_keras_fit_distributed_example_trains(tmp_path):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
  env.pop("TF_USE_LEGACY_KERAS", None)
  done = subprocess.run(
      [sys.executable, str(ROOT / "examples" / "keras_fit_distributed.py"),
       "--epochs", "4", "--backup", str(tmp_path / "backup")], env=env,
      capture_output=True, text=True, timeout=600, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  losses = [float(v) for v in re.findall(r"epoch \d+: loss ([\d.]+)",
                                         done.stdout)]
  assert len(losses) == 4 and losses[-1] < losses[0]
  assert "on 2 replicas" in done.stdout
