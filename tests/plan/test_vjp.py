"""GraphVJP, the TF1 executor's one VJP (``core._vjp.VJP``).

It is the only module of ``graphgrad/plan`` and ``graphgrad/methods`` that
differentiates; its ``vjp``, ``task_vjps`` and ``per_example`` equal plain
``tf.gradients`` references, with and without ``plan.recompute``'s option.
"""

import ast
import pathlib

import numpy as np
import tensorflow as tf

import graphgrad as gg
from graphgrad.plan import _recompute
from graphgrad.plan._backprop import GraphVJP
from tests.helpers import dense

tf1 = tf.compat.v1
ROOT = pathlib.Path(__file__).resolve().parents[2] / "graphgrad"


def _differentiating(path: pathlib.Path):
  """Lines of ``path`` that call ``*.gradients`` of TensorFlow (``tf``,
  ``tf1``, ``tf.compat.v1``) or make a ``GradientTape``."""
  found = []
  for node in ast.walk(ast.parse(path.read_text())):
    if not isinstance(node, ast.Attribute):
      continue
    base = ast.unparse(node.value)
    if (node.attr == "gradients" and base in (
        "tf", "tf1", "tf.compat.v1", "compat.v1", "v1")) or (
            node.attr == "GradientTape"):
      found.append(node.lineno)
  return found


def test_only_the_vjp_module_differentiates():
  where = {str(p.relative_to(ROOT)): lines
           for folder in ("plan", "methods")
           for p in sorted((ROOT / folder).glob("*.py"))
           for lines in [_differentiating(p)] if lines}
  assert list(where) == ["plan/_backprop.py"], where


def _two_tasks():
  x = tf.constant(np.random.default_rng(0).normal(size=(6, 4)), tf.float32)
  h = dense(x, 5, "l0", tf.tanh)
  h = dense(h, 5, "l1", tf.tanh)
  h = dense(h, 5, "l2", tf.tanh)
  la = tf.reduce_sum(tf.square(dense(h, 2, "a")))
  lb = tf.reduce_sum(dense(h, 3, "b"))
  return la, lb, h


def _run(*tensors):
  with tf1.Session() as s:
    s.run(tf1.global_variables_initializer())
    return s.run(list(tensors))


def _recomputing(loss, keep):
  net = gg.analyze(loss)
  return _recompute.Recompute(lambda: _recompute.kept_tensors(net, keep),
                              lambda op: False)


def test_vjp_and_task_vjps_equal_tf_gradients(graph):
  la, lb, h = _two_tasks()
  loss = 2.0 * la + lb
  variables = tf1.trainable_variables()
  for recompute in (None, _recomputing(loss, ["l1"])):
    vjp = GraphVJP(recompute=recompute)
    got = vjp.vjp([loss], variables)
    seeded = vjp.vjp([loss], variables, [tf.constant(3.0)], stop=[h])
    per_task = vjp.task_vjps(loss, [la, lb], [h])
    want = tf1.gradients(loss, variables)
    want_seeded = tf1.gradients(loss, variables, grad_ys=tf.constant(3.0),
                                stop_gradients=[h])
    want_tasks = [tf1.gradients(2.0 * la, [h]), tf1.gradients(lb, [h])]
    assert [g is None for g in seeded] == [g is None for g in want_seeded]
    seeded = [g for g in seeded if g is not None]
    want_seeded = [g for g in want_seeded if g is not None]
    values = _run(got, want, seeded, want_seeded, per_task, want_tasks)
    for a, b in zip(values[0::2], values[1::2]):
      for x, y in zip(tf.nest.flatten(a), tf.nest.flatten(b)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_none_grads_send_nothing(graph):
  la, lb, h = _two_tasks()
  vjp = GraphVJP()
  assert vjp.vjp([la, lb], [h], [None, None]) == [None]
  only_b, = vjp.vjp([la, lb], [h], [None, tf.constant(1.0)])
  want, = tf1.gradients(lb, [h])
  a, b = _run(only_b, want)
  np.testing.assert_allclose(a, b, rtol=1e-6)


def test_seed_scales_the_task_vjps(graph):
  la, lb, h = _two_tasks()
  loss = la + lb
  vjp = GraphVJP(seed=lambda t: tf.constant(8.0) if t is loss else None)
  (ga,), (gb,) = vjp.task_vjps(loss, [la, lb], [h])
  wa, wb = tf1.gradients(la, [h])[0], tf1.gradients(lb, [h])[0]
  a, b, c, d = _run(ga, gb, wa, wb)
  np.testing.assert_allclose(a, 8.0 * c, rtol=1e-6)
  np.testing.assert_allclose(b, 8.0 * d, rtol=1e-6)


def test_per_example_masks_all_rows_but_one(graph):
  x = tf.constant(np.random.default_rng(1).normal(size=(4, 3)), tf.float32)
  w = tf1.get_variable("w", initializer=np.ones((3, 2), np.float32))
  y = tf.matmul(x, tf.identity(w))
  g = tf.constant(np.random.default_rng(2).normal(size=(4, 2)), tf.float32)
  unreached = tf.constant(np.zeros((2, 2), np.float32))
  per, none = GraphVJP().per_example([y], [y.op.inputs[1], unreached], [g],
                                     4)
  assert none is None
  got, xs, gs = _run(per, x, g)
  assert got.shape == (4, 3, 2)
  for i in range(4):
    np.testing.assert_allclose(got[i], np.outer(xs[i], gs[i]), rtol=1e-5)
