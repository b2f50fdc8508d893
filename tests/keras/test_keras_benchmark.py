"""The KerasPlan benchmark runs as a module and reports every variant."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_benchmark_runs_and_prints_ratios():
  env = dict(os.environ)
  env.pop("TF_USE_LEGACY_KERAS", None)  # the benchmark measures Keras 3
  out = subprocess.run(
      [sys.executable, "-m", "benchmarks.keras_step", "--reps", "2",
       "--steps", "2", "--batch", "8", "--width", "8", "--depth", "2"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
      check=True).stdout
  rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[2:]}
  assert sorted(rows) == ["forced", "identity", "plain", "transformed"]
  assert rows["plain"][1] == "1.000"
  assert rows["identity"][2] == rows["plain"][2]  # same op count
  assert int(rows["transformed"][2]) > int(rows["plain"][2])
