"""KerasPlan under tf.distribute: N replicas give the one-device update.

Each strategy runs in fresh processes (strategy_worker.py): the logical
devices and the cluster must be set before TensorFlow runs an op. One
process runs both MirroredStrategy case sets (the module fixture). The
reference is the same plan on one device with the global batch; a third
run, with the parameter transforms applied to each replica's gradient before
the sum, shows that the comparison can fail.
"""

import json
import os
import subprocess
import sys

import pytest
import tensorflow as tf

import graphgrad as gg
from graphgrad.keras import _tape

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      "strategy_worker.py")
TIMEOUT = 900  # a loaded 2-core machine; about 3 minutes when it is not
# float32 sums over 8 examples per replica against 16 on one device, and
# 3 SGD steps: the plain model without a plan differs by as much.
TOLERANCE = 1e-6


def _env():
  env = dict(os.environ)
  root = os.path.dirname(os.path.dirname(os.path.dirname(WORKER)))
  env["PYTHONPATH"] = os.pathsep.join([root] + [
      p for p in [env.get("PYTHONPATH")] if p])
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  return env


def _check(results, groups=("clip", "global")):
  """Checks every case; returns the largest difference from one device."""
  seen = set()
  for r in results["results"]:
    case = (r["flavour"], r["optimizer"], r["group"])
    seen.add(case)
    if r["group"] in ("clip", "global"):
      assert r["diff"] < TOLERANCE, case
      # Transforms before the sum miss by 100 times more, at least.
      assert r["per_replica_diff"] > 100 * TOLERANCE, case
    elif r["group"] in ("scale", "value"):
      # Linear and element-wise rewrites do not depend on the split.
      assert r["diff"] < TOLERANCE, case
      assert r["per_replica_diff"] < TOLERANCE, case
    else:
      # An upstream clip of the whole tensor sees each replica's examples:
      # it is the per-replica result, not the one-device one.
      assert r["vs_per_replica"] < TOLERANCE, case
      assert r["diff"] > 100 * TOLERANCE, case
  assert {c[2] for c in seen} == set(groups)
  if "clip" in groups:
    assert {c[1] for c in seen} == {"keras3", "tf_keras", "legacy"}
  return max(r["diff"] for r in results["results"]
             if r["group"] != "norm")


@pytest.fixture(scope="module")
def mirrored(tmp_path_factory):
  """Both MirroredStrategy case sets, run by one worker process (one
  TensorFlow start-up): {"rewrites": results, "transforms": results}."""
  directory = tmp_path_factory.mktemp("mirrored")
  cases = ("rewrites", "transforms", "private", "summaries")
  args = [a for c in cases for a in (str(directory / f"{c}.json"), c)]
  proc = subprocess.run([sys.executable, WORKER, "mirrored", *args],
                        env=_env(), capture_output=True, text=True,
                        timeout=TIMEOUT, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return {c: json.loads((directory / f"{c}.json").read_text())
          for c in cases}


@pytest.mark.slow
def test_mirrored_summaries_are_the_global_batchs(mirrored):
  """plan.summaries() in a step of two replicas gives the figures of one
  device with the global batch (an upstream scale and a parameter clip,
  or an element-wise upstream clip), and replica 0 alone writes them."""
  for case in mirrored["summaries"]["summaries"]:
    assert any("upstream_norm/l2" in t for t in case["tags"]), case
    assert any("grad_norm/l2" in t for t in case["tags"]), case
    assert case["diff"] < 1e-5, case
    assert case["written"] == {t: 1 for t in case["tags"]}, case


@pytest.mark.slow
def test_mirrored_upstream_rewrites_per_replica(mirrored):
  results = mirrored["rewrites"]
  assert results["replicas"] == 2
  print("MirroredStrategy x2, linear and element-wise rewrites:",
        _check(results, ("scale", "value", "norm")))
  # plan.recompute() with batch norm: the weights and moving statistics of
  # the same plan without recompute, under the same strategy.
  assert {r["flavour"].split(".")[0] for r in results["recompute"]} >= {
      "keras"}
  for r in results["recompute"]:
    assert r["diff"] < TOLERANCE, r
    assert r["moving_mean_moved"] > 1000 * TOLERANCE, r
  print("  recompute:", max(r["diff"] for r in results["recompute"]))


@pytest.mark.slow
def test_mirrored_two_replicas_equal_one_device(mirrored):
  results = mirrored["transforms"]
  assert results["replicas"] == 2
  print("MirroredStrategy x2, largest weight difference:", _check(results))
  # model.fit with a train_step that runs the plan's tape: the compiled
  # loss's convention, and the aggregation in tape.gradient, as in a loop.
  assert {f["flavour"].split(".")[0] for f in results["fit"]} == {
      "keras", "tf_keras"}
  for f in results["fit"]:
    assert f["diff"] < TOLERANCE, f
    assert f["moved"] > 1000 * TOLERANCE, f
  print("  model.fit:", max(f["diff"] for f in results["fit"]))


def _check_private(results) -> float:
  """DP-SGD across replicas, in a loop and in ``model.fit`` (the "fit"
  results): with no noise, the sum of the replicas' gradients is one
  device's with the global batch; the noise's std is
  sigma C / B_global within 5% (one draw per global batch: sqrt(2) times
  more for one draw per replica, half as much with each replica's share
  halved)."""
  assert {r["flavour"].split(".")[0] for r in results["private"]} >= {
      "keras"}
  for r in results["private"] + results["fit"]:
    assert r["size"] > 1000 * TOLERANCE, r
    assert r["diff"] < TOLERANCE, r
    assert abs(r["noise_std"] / r["expected_std"] - 1) < 0.05, r
  for r in results["fit"]:
    # a new draw at each step, not the first one again
    assert r["draws"] > 1 and abs(r["noise_corr"]) < 0.5, r
  return max(r["diff"] for r in results["private"] + results["fit"])


@pytest.mark.slow
def test_mirrored_privatize_adds_one_noise_draw_per_global_batch(mirrored):
  results = mirrored["private"]
  assert results["replicas"] == 2
  # model.fit with the private plan attached, on both Keras flavours: the
  # weights after STEPS steps (no noise) and the noise in each update.
  assert {r["flavour"].split(".")[0] for r in results["fit"]} == {
      "keras", "tf_keras"}
  print("MirroredStrategy x2, privatize (and model.fit):",
        _check_private(results))


@pytest.mark.slow
def test_multi_worker_two_processes_equal_one_device(tmp_path):
  workers = [f"127.0.0.1:{p}" for p in gg.cluster.free_ports(2)]
  outs = [tmp_path / f"worker{i}.json" for i in range(2)]
  logs = [open(tmp_path / f"worker{i}.log", "w", encoding="utf-8")
          for i in range(2)]
  procs = [subprocess.Popen(
      [sys.executable, WORKER, "multiworker", str(outs[i]), str(i),
       json.dumps(workers)], env=_env(), stdout=subprocess.DEVNULL,
      stderr=logs[i], start_new_session=True) for i in range(2)]
  try:
    for i, p in enumerate(procs):
      code = p.wait(timeout=TIMEOUT)
      log = (tmp_path / f"worker{i}.log").read_text()[-3000:]
      assert code == 0, log
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
    for f in logs:
      f.close()
  first, second = (json.loads(o.read_text()) for o in outs)
  assert first["replicas"] == second["replicas"] == 2
  print("MultiWorkerMirroredStrategy x2, largest weight difference:",
        _check(first), _check(second))
  # Both workers hold the same (mirrored) weights.
  for a, b in zip(first["results"], second["results"]):
    assert a["weights"] == b["weights"]
  for o in outs:
    private = json.loads(o.with_name(o.name + ".private").read_text())
    assert private["replicas"] == 2
    print("  privatize:", _check_private(private))


class _Uninitialized:
  """Makes an instance of a strategy class without running its __init__.

  A TPUStrategy cannot be built without a TPU, nor a ParameterServerStrategy
  without a cluster; the refusal is a type check, and an instance that was
  never initialised has the real type.
  """

  def __init__(self, cls):
    self.instance = cls.__new__(cls)


@pytest.mark.parametrize("cls,name", [
    (tf.distribute.TPUStrategy, "TPUStrategy"),
    (tf.distribute.experimental.TPUStrategy, "TPUStrategy"),
    (tf.compat.v1.distribute.experimental.TPUStrategy, "TPUStrategy"),
    (tf.distribute.experimental.ParameterServerStrategy,
     "ParameterServerStrategy"),
    (tf.compat.v1.distribute.experimental.ParameterServerStrategy,
     "ParameterServerStrategy"),
])
def test_refused_strategies(cls, name):
  with pytest.raises(gg.GraphGradError,
                     match=f"KerasPlan does not support {name} .*"
                           f"MirroredStrategy or MultiWorkerMirroredStrategy"):
    _tape.check_strategy(_Uninitialized(cls).instance)


def test_supported_strategies_pass_the_check():
  _tape.check_strategy(tf.distribute.get_strategy())
  _tape.check_strategy(tf.distribute.OneDeviceStrategy("/cpu:0"))
  assert _tape.replicas_in_sync() == 1


def test_only_nonlinear_parameter_transforms_wait_for_the_sum():
  t = gg.transforms
  assert not _tape.needs_sum([t.scale(0.5), t.reverse(1.0)])
  assert not _tape.needs_sum([t.chain(t.scale(2.0), t.zero())])
  assert _tape.needs_sum([t.clip_by_norm(1.0)])
  assert _tape.needs_sum([t.scale(0.5), t.clip_by_global_norm(1.0)])
  assert _tape.needs_sum([t.add_noise(0.1, seed=0)])
