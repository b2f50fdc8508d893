"""Gradient overrides lost on re-import: named, explained and restored.

The MetaGraph is exported by a fresh process that registered the three
gradient functions and recorded the gradients ``tf.gradients`` computes with
them; another fresh process imports it (the functions are gone there), and
``gg.analyze`` must name each lost override, guess the declaration, and the
plan made of those declarations must give the original gradients.
"""

import json

import legacy_graphs
import pytest

# Two fresh processes that import TensorFlow (the export, tests/conftest.py's
# legacy_export, is shared with tests/cli/test_inspect_legacy.py).
pytestmark = pytest.mark.slow

ANALYZE = r'''
import io, json, logging
import numpy as np, tensorflow as tf, graphgrad as gg
import legacy_graphs
tf1 = tf.compat.v1
stream = io.StringIO()
logging.getLogger("graphgrad").addHandler(logging.StreamHandler(stream))
out = {}
with tf.Graph().as_default() as g:
  tf1.train.import_meta_graph("legacy.meta")
  loss = g.get_tensor_by_name("loss:0")
  net = gg.analyze(loss)
  out["names"] = list(net.names)
  out["log"] = stream.getvalue()
  out["lost"] = [[l.op.name, l.override, l.kind, l.declaration, l.hint]
                 for l in net.lost_overrides]
  try:
    gg.GradientPlan(loss, net).compute_gradients()
  except gg.GraphGradError as e:
    out["error"] = str(e)
  plan = (gg.GradientPlan(loss, net)
          .straight_through("flip")
          .transform_edge("MatMul", "MatMul_2",
                          gg.transforms.reverse(legacy_graphs.LAMBDA))
          .straight_through("quantize")
          .override_gradient("squash", legacy_graphs.softsign_tanh_grad))
  gv = plan.compute_gradients()
  with tf1.Session() as sess:
    sess.run(tf1.global_variables_initializer())
    values = sess.run([gr for gr, _ in gv])
  ref = np.load("reference.npz")
  out["diff"] = max(float(np.abs(val - ref[v.op.name]).max() /
                          np.abs(ref[v.op.name]).max())
                    for val, (_, v) in zip(values, gv))
  out["compared"] = sorted(v.op.name for _, v in gv)
  out["reference"] = sorted(ref.files)
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def analysed(legacy_export):
  run = legacy_graphs.run_python(ANALYZE, legacy_export)
  assert run.returncode == 0, run.stderr
  return json.loads(run.stdout.strip().splitlines()[-1])


def test_analyze_names_each_lost_override(analysed):
  assert analysed["names"] == ["MatMul", "MatMul_1", "MatMul_2"]
  lost = {name: rest for name, *rest in analysed["lost"]}
  assert [n for n, *_ in analysed["lost"]] == ["quantize", "squash", "flip"]
  override, kind, declaration, hint = lost["flip"]
  assert (override, kind) == ("FlipGradient0", "reversal")
  assert declaration == ("plan.straight_through('flip').transform_edge("
                         "'MatMul', 'MatMul_2', gg.transforms.reverse(l))")
  assert "looks like a gradient reversal" in hint
  assert "the scalar 'l' near it, which may be its factor" in hint
  assert "not recorded in the graph" in hint
  assert lost["quantize"][:3] == ["StraightThroughRound", "straight_through",
                                  "plan.straight_through('quantize')"]
  assert "looks like a straight-through estimator" in lost["quantize"][3]
  assert lost["squash"][:3] == ["SoftsignTanhGrad", "unknown",
                                "plan.override_gradient('squash', fn)"]
  assert "cannot tell what the lost function did" in lost["squash"][3]


def test_analyze_logs_them_once(analysed):
  log = analysed["log"]
  assert log.count("gg.analyze: 3 op(s) of loss:0 carry a gradient override "
                   "that is not registered in this process") == 1
  assert ("1. quantize (type Round) carried the gradient override "
          "'StraightThroughRound' when its graph was built, and no gradient "
          "function of that name is registered in this process") in log
  assert "3. flip (type Identity)" in log


def test_the_plan_error_says_why(analysed):
  error = analysed["error"]
  assert ("crosses 3 ops with no registered gradient, where tf.gradients "
          "would stop with LookupError: quantize (type Round, glue), squash "
          "(type Tanh, glue), flip (type Identity, glue).") in error
  assert ("flip carried the gradient override 'FlipGradient0' when the graph "
          "was built; no gradient function of that name is registered in "
          "this process (@tf.RegisterGradient('FlipGradient0') ran only in "
          "the process that built it).") in error
  assert "gg.analyze(loss).lost_overrides suggests the declaration" in error


def test_the_suggested_declarations_restore_the_original_gradients(analysed):
  assert analysed["compared"] == analysed["reference"]
  assert len(analysed["compared"]) == 6
  assert analysed["diff"] < 1e-6
