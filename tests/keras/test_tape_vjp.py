"""TapeVJP: the one module where the Keras executor differentiates.

The layout check reads every module of ``graphgrad/keras`` with ``ast``: no
other one asks a tape (or ``tf.gradients``) for a gradient. The unit tests
pin the protocol's conventions on a tape: a ``None`` entry sends nothing, a
per-example VJP is the VJP of one row, a replay restores the state.
"""

import ast
import pathlib

import numpy as np
import pytest
import tensorflow as tf

from graphgrad import _errors
from graphgrad.keras._tape_vjp import TapeVJP

KERAS = pathlib.Path(__file__).resolve().parents[2] / "graphgrad" / "keras"
_DIFFERENTIATES = {"gradient", "gradients", "jacobian", "batch_jacobian"}


def _calls(path: pathlib.Path):
  tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
  return [f"{path.name}:{n.lineno} .{n.func.attr}(...)"
          for n in ast.walk(tree) if isinstance(n, ast.Call)
          and isinstance(n.func, ast.Attribute)
          and n.func.attr in _DIFFERENTIATES]


def test_only_the_vjp_module_differentiates():
  assert _calls(KERAS / "_tape_vjp.py")  # the check sees its calls
  others = [c for p in sorted(KERAS.glob("*.py")) if p.name != "_tape_vjp.py"
            for c in _calls(p)]
  assert not others


def test_a_none_gradient_sends_nothing_and_none_grads_are_ones():
  x = tf.constant([1.0, 2.0])
  vjp, (a, b) = TapeVJP.record(lambda t: (2.0 * t, t * t), [x])
  got = vjp.vjp([a, b], [x], [None, tf.ones_like(b)])
  np.testing.assert_allclose(got[0].numpy(), [2.0, 4.0])
  got = vjp.vjp([a, b], [x])
  np.testing.assert_allclose(got[0].numpy(), [4.0, 6.0])
  assert vjp.vjp([a, b], [x], [None, None]) == [None]
  assert vjp.vjp([a], [], [tf.ones_like(a)]) == []


def test_per_example_is_the_vjp_of_one_row():
  layer = tf.keras.layers.Dense(3, activation="tanh")
  x = tf.random.stateless_normal((4, 5), seed=(1, 2))
  y = layer(x)
  dy = tf.random.stateless_normal((4, 3), seed=(3, 4))
  variables = [layer.kernel, layer.bias]
  per = TapeVJP.of_call(layer.call, [x]).per_example([y], variables, [dy], 4)
  for i in range(4):
    rows = tf.one_hot(i, 4)[:, None] * dy
    vjp, out = TapeVJP.record(layer.call, [x])
    want = vjp.vjp([out], variables, [rows])
    for p, w in zip(per, want):
      np.testing.assert_allclose(p[i].numpy(), w.numpy(), rtol=1e-5,
                                 atol=1e-6)


def test_task_vjps_weigh_each_task_by_the_target():
  w = tf.Variable([1.0, -1.0])
  with tf.GradientTape(persistent=True) as tape:
    la = tf.reduce_sum(w * w)
    lb = tf.reduce_sum(3.0 * w)
    target = 2.0 * la + 0.5 * lb
  per = TapeVJP.outer(tape).task_vjps(target, [la, lb], [w])
  np.testing.assert_allclose(per[0][0].numpy(), [4.0, -4.0])
  np.testing.assert_allclose(per[1][0].numpy(), [1.5, 1.5])
  with pytest.raises(_errors.NotConnectedError, match=r"task_losses\[1\]"):
    TapeVJP.outer(tape).task_vjps(la, [la, lb], [w])


def test_a_replay_reads_the_snapshot_and_restores_the_state():
  state = tf.Variable(5.0)

  def call(x):
    state.assign_add(1.0)
    return x * state

  x = tf.constant(2.0)
  vjp, outs = TapeVJP.replay(call, [x], state=[state],
                             snapshot=[tf.constant(1.0)])
  assert outs[0].numpy() == 4.0  # ran from the snapshot, 1 + 1
  assert state.numpy() == 5.0  # the value the forward pass left
  assert vjp.vjp(outs, vjp.inputs)[0].numpy() == 2.0
