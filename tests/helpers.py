"""Graph builders and evaluation helpers shared by the tests."""

import math
import zlib

import numpy as np
import tensorflow as tf

import graphgrad as gg

tf1 = tf.compat.v1


def dense(x, units, name, activation=None, seed=0):
  """A dense layer from get_variable with fixed initial values."""
  rng = np.random.default_rng(zlib.crc32(name.encode()) + seed)
  fan_in = int(x.shape[-1])
  with tf1.variable_scope(name):
    w = tf1.get_variable(
        "kernel", initializer=(rng.normal(size=(fan_in, units))
                               / np.sqrt(fan_in)).astype(np.float32))
    b = tf1.get_variable(
        "bias", initializer=rng.normal(size=(units,)).astype(np.float32) * 0.1)
    out = tf.nn.bias_add(tf.matmul(x, w), b)
    return activation(out) if activation else out


def opaque(fn):
  """``fn`` as a plain callable: the same rewrite, with no linear factor.

  A plan then calls it on the gradient, with a second backward pass,
  instead of weighting one pass by its factor.
  """
  return lambda g: fn(g)


def evaluate(tensors, feed=None):
  """Initializes the default graph's variables and evaluates ``tensors``."""
  with tf1.Session() as sess:
    sess.run(tf1.global_variables_initializer())
    return sess.run(tensors, feed)


def densify(g):
  """A numpy array from a dense or IndexedSlices gradient value."""
  if hasattr(g, "indices") and hasattr(g, "dense_shape"):  # IndexedSlicesValue
    out = np.zeros(g.dense_shape, g.values.dtype)
    np.add.at(out, g.indices, g.values)
    return out
  return g


def clipped_mean_reference(loss_of, variables, n, clip):
  """DP-SGD's noise-free gradient by hand, and the per-example norms.

  ``loss_of(i)`` computes example ``i``'s scalar loss (under one
  ``tf.GradientTape`` per example); each example's gradient over all
  ``variables`` is clipped to ``clip`` in numpy (float64), summed and
  divided by ``n``.
  """
  total, norms = None, []
  for i in range(n):
    with tf.GradientTape() as t:
      loss = loss_of(i)
    grads = [np.zeros(v.shape) if g is None
             else densify(tf.convert_to_tensor(g).numpy()).astype(np.float64)
             for g, v in zip(t.gradient(loss, variables), variables)]
    norm = np.sqrt(sum(np.sum(g * g) for g in grads))
    norms.append(norm)
    c = min(1.0, clip / norm)
    total = ([c * g for g in grads] if total is None
             else [a + c * g for a, g in zip(total, grads)])
  return [a / n for a in total], np.array(norms)


def assert_grads_close(actual, expected, rtol=1e-5, atol=1e-6):
  assert len(actual) == len(expected)
  for a, e in zip(actual, expected):
    np.testing.assert_allclose(densify(a), densify(e), rtol=rtol, atol=atol)


def add(*grad_lists):
  """Elementwise sum of gradient lists, treating None as zero."""
  out = []
  for parts in zip(*grad_lists):
    parts = [p for p in parts if p is not None]
    out.append(tf.add_n(parts) if parts else None)
  return out


def trainable(scope):
  """The trainable variables under ``scope/``, in creation order."""
  return tf1.get_collection(tf1.GraphKeys.TRAINABLE_VARIABLES, scope + "/")


def feed(*xs, rows=8, seed=0):
  """A feed dict of N(0, 1) batches of ``rows`` rows, one rng for all."""
  rng = np.random.default_rng(seed)
  return {x: rng.normal(size=(rows,) + tuple(x.shape[1:])).astype(np.float32)
          for x in xs}


def grads_of(plan_or_gv, variables=None):
  """Gradients of a plan (or of a ``(grad, var)`` list).

  Args:
    plan_or_gv: a plan (its ``compute_gradients()`` is taken) or a list of
      ``(grad, var)`` pairs.
    variables: ``None`` for every gradient in order; a scope name for the
      gradients of the variables under it; or a list of variables, whose
      gradients are returned in its order.
  """
  gv = (plan_or_gv.compute_gradients()
        if hasattr(plan_or_gv, "compute_gradients") else list(plan_or_gv))
  if variables is None:
    return [g for g, _ in gv]
  if isinstance(variables, str):
    return [g for g, v in gv if v.op.name.startswith(variables + "/")]
  by_name = {v.name: g for g, v in gv}
  return [by_name[v.name] for v in variables]


def evaluate_grads(grads, feed=None):
  """Evaluates a gradient list as numpy arrays, keeping its ``None``s."""
  fetch = [g for g in grads if g is not None]
  values = iter(evaluate(fetch, feed))
  return [None if g is None else densify(next(values)) for g in grads]


def global_norm(arrays) -> float:
  """The global L2 norm of numpy arrays, summed in float64."""
  return math.sqrt(sum(float(np.sum(np.square(a, dtype=np.float64)))
                       for a in arrays))


def error_line(capsys, argv):
  """The one stderr line of a command line that fails with exit code 2.

  argparse's own errors exit from the parser; they count too. The line must
  be the only one, and no traceback.
  """
  from graphgrad.cli import _main  # pylint: disable=g-import-not-at-top
  try:
    code = _main.main(argv)
  except SystemExit as e:
    code = e.code
  assert code == 2
  err = capsys.readouterr().err
  lines = err.strip().splitlines()
  assert len(lines) == 1 and "Traceback" not in err, err
  return lines[0]



class HalfThroughKernel(gg.backward.Replacement):
  """A user replacement built from ``context.dense()`` and ``context.vjp``
  alone: half of what the kernel product sends below. The same class serves
  both plans, which is the point of the tests that use it."""

  name = "half_through_kernel"

  def backward(self, context):
    d = context.dense()
    delta, = context.vjp(d.outputs, [d.pre], context.upstream,
                         stop=context.inputs)
    return context.vjp([d.pre], context.inputs, [0.5 * delta])


def bert_like(num_layers):
  """Embeddings and ``num_layers`` encoder blocks of two scopes each, with
  fixed initial values."""
  ids = tf.constant([[1, 2, 0, 4], [3, 1, 2, 2]])
  rng = np.random.default_rng(7)
  with tf1.variable_scope("bert"):
    with tf1.variable_scope("embeddings"):
      table = tf1.get_variable("word_embeddings", initializer=rng.normal(
          size=(5, 6)).astype(np.float32))
      h = tf.reshape(tf.gather(table, ids), [8, 6])
    for i in range(num_layers):
      with tf1.variable_scope(f"encoder/layer_{i}"):
        a = dense(h, 6, "attention/output/dense", tf.nn.tanh, seed=i)
        h = h + dense(a, 6, "output/dense", seed=i)
  logits = dense(h, 3, "cls")
  labels = tf.constant([0, 1, 2, 1, 0, 2, 1, 0])
  return tf.reduce_mean(
      tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))
