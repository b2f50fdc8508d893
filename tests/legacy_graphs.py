"""A tutorial-style unscoped graph with gradient_override_map, and the
process boundary that loses its overrides.

``python legacy_graphs.py export DIR`` builds the graph in a fresh process
(which registers the three gradient functions), writes ``DIR/legacy.meta``
and the reference gradients ``tf.gradients`` computes with them to
``DIR/reference.npz``. Any other process that imports the MetaGraph has the
override names but not the functions.
"""

import os
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LAMBDA = 0.3


def build(tf):
  """Features -> label head (through a quantizer) and -> flip -> domain head.

  Overrides: ``FlipGradient0`` on the Identity ``flip`` (-l * grad),
  ``StraightThroughRound`` on the Round (grad), ``SoftsignTanhGrad`` on the
  label head's Tanh (grad / (1 + |y|)^2, a made-up backward).
  """
  tf1 = tf.compat.v1
  rng = np.random.default_rng(11)
  g = tf1.get_default_graph()
  x = tf.constant(rng.normal(size=(8, 4)).astype(np.float32), name="x")
  tf1.placeholder_with_default(LAMBDA, [], name="l")
  w0 = tf1.Variable(rng.normal(size=(4, 6)).astype(np.float32) * 0.5)
  b0 = tf1.Variable(rng.normal(size=(6,)).astype(np.float32) * 0.1)
  w1 = tf1.Variable(rng.normal(size=(6, 3)).astype(np.float32) * 0.5)
  b1 = tf1.Variable(rng.normal(size=(3,)).astype(np.float32) * 0.1)
  w2 = tf1.Variable(rng.normal(size=(6, 2)).astype(np.float32) * 0.5)
  b2 = tf1.Variable(rng.normal(size=(2,)).astype(np.float32) * 0.1)
  f = tf.nn.relu(tf.matmul(x, w0) + b0)
  with g.gradient_override_map({"Round": "StraightThroughRound"}):
    q = tf.round(f * 4.0, name="quantize") / 4.0
  with g.gradient_override_map({"Tanh": "SoftsignTanhGrad"}):
    label = tf.tanh(tf.matmul(q, w1) + b1, name="squash")
  with g.gradient_override_map({"Identity": "FlipGradient0"}):
    flipped = tf.identity(f, name="flip")
  domain = tf.matmul(flipped, w2) + b2
  loss = tf.add(tf.reduce_sum(tf.square(label)),
                tf.reduce_sum(tf.square(domain)), name="loss")
  tf1.add_to_collection(tf1.GraphKeys.LOSSES, loss)
  return loss


def register(tf):
  """The three gradient functions, as the original code registered them."""
  @tf.RegisterGradient("FlipGradient0")
  def _flip(op, grad):
    del op
    return [-LAMBDA * grad]

  @tf.RegisterGradient("StraightThroughRound")
  def _straight_through(op, grad):
    del op
    return [grad]

  @tf.RegisterGradient("SoftsignTanhGrad")
  def _softsign(op, grad):
    return [grad / tf.square(1.0 + tf.abs(op.outputs[0]))]


def softsign_tanh_grad(op, grad):
  """``SoftsignTanhGrad`` written again for ``plan.override_gradient``."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return grad / tf.square(1.0 + tf.abs(op.outputs[0]))


def _export(directory):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf1 = tf.compat.v1
  register(tf)
  with tf.Graph().as_default():
    loss = build(tf)
    variables = tf1.trainable_variables()
    grads = tf1.gradients(loss, variables)
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      values = sess.run(grads)
    tf1.train.export_meta_graph(os.path.join(directory, "legacy.meta"))
  np.savez(os.path.join(directory, "reference.npz"),
           **{v.op.name: g for v, g in zip(variables, values)})


def export_in_subprocess(directory):
  """Runs :func:`_export` in a fresh Python process; returns the .meta path."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
             PYTHONPATH=os.pathsep.join([ROOT, HERE]))
  subprocess.run([sys.executable, os.path.abspath(__file__), "export",
                  str(directory)], check=True, env=env, timeout=300)
  return os.path.join(str(directory), "legacy.meta")


def run_python(code, cwd):
  """Runs ``code`` in a fresh process with this checkout importable."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
             PYTHONPATH=os.pathsep.join([ROOT, HERE]))
  return subprocess.run([sys.executable, "-c", code], cwd=str(cwd), env=env,
                        capture_output=True, text=True, timeout=300)


if __name__ == "__main__" and sys.argv[1:2] == ["export"]:
  _export(sys.argv[2])
