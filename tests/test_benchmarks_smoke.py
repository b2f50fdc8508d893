"""The benchmark suite runs in its tiny configuration: output only, no timing.

This test asserts that ``python -m benchmarks --tiny`` runs and writes a
well-formed report. It checks no timing threshold: the numbers of a shared
CI machine prove nothing, and the suite's own RESULTS.md reports the noise.
The runs have no timer of their own: a loaded machine may take any time,
and the CI job's limit bounds them.
"""

import hashlib
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMITTED = os.path.join(ROOT, "benchmarks", "RESULTS.md")


def _digest(path):
  if not os.path.exists(path):
    return None
  with open(path, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()


def test_tiny_benchmark_run_writes_a_well_formed_report(tmp_path):
  before = _digest(COMMITTED)
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  env.pop("TF_USE_LEGACY_KERAS", None)  # the benchmarks do not need it
  proc = subprocess.run(
      [sys.executable, "-m", "benchmarks", "--tiny", "--out", str(tmp_path)],
      cwd=ROOT, env=env, capture_output=True, text=True)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.strip().endswith("RESULTS.md")
  assert _digest(COMMITTED) == before  # the committed report is untouched

  report = (tmp_path / "RESULTS.md").read_text()
  for heading in ("## Gradient plans against minimize() and the hand recipe",
                  "### Targets", "### Growth with depth",
                  "## gg.analyze on large graphs", "## Machine and noise"):
    assert heading in report
  assert (tmp_path / "depth.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

  data = json.loads((tmp_path / "results.json").read_text())
  assert data["tiny"] is True
  plans = data["suites"]["gradient_plans"]["data"]
  names = [m["model"] for m in plans["models"]]
  assert names == ["seed", "mlp2", "mlp4"]
  for m in plans["models"]:
    assert set(m["variants"]) == {"minimize", "naive", "gg_identity",
                                  "gg_all", "gg_cut", "gg_edge"}
    for v, e in m["variants"].items():
      assert e["ops_added"] > 0 and e["executed_ops"] > 0, (m["model"], v)
      for key in ("build_s", "step_s"):
        s = e[key]
        assert 0 < s["min"] <= s["median"] <= s["max"], (m["model"], v, key)
    # The identity plan is the very call minimize() makes: same ops.
    assert (m["variants"]["gg_identity"]["ops_added"]
            == m["variants"]["minimize"]["ops_added"])
  seed = plans["models"][0]["variants"]
  rss = seed["gg_all"]["rss"]
  assert rss["peak_mb"] >= rss["base_mb"] > 0
  assert set(plans["fits"]) >= {"minimize", "gg_identity", "gg_all"}
  sizes = data["suites"]["analyze_scale"]["data"]["sizes"]
  assert len(sizes) == 2 and all(r["layers"] == r["blocks"] for r in sizes)


def test_privacy_benchmark_times_both_plans(tmp_path):
  """``benchmarks.privacy``'s timing child runs both plans on the conv net
  (a batch of 8, one repetition), and GradientPlan's noise floor: the
  figures are well formed, not fast."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  env.pop("TF_USE_LEGACY_KERAS", None)
  proc = subprocess.run(
      [sys.executable, "-m", "benchmarks.privacy", "time", "1", "--reps", "1",
       "--batch", "8", "--models", "convnet", "--variants",
       "minimize,privatize,clip_only,philox_bits,noise_only"], cwd=ROOT,
      env=env, capture_output=True, text=True)
  assert proc.returncode == 0, proc.stderr[-3000:]
  data = json.loads(proc.stdout.strip().splitlines()[-1])
  assert set(data) == {"convnet/graph", "convnet/keras"}
  for key, res in data.items():
    floors = {"philox_bits", "noise_only"} if key == "convnet/graph" else set()
    assert set(res["ratio"]) == {"minimize", "privatize", "clip_only",
                                 *floors}, key
    assert res["ratio"]["minimize"]["median"] == 1.0
    for v, s in res["step_s"].items():
      assert 0 < s["min"] <= s["median"] <= s["max"], (key, v)
