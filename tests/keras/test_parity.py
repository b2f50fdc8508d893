"""Parity: every declaration gives equal gradients in both plans.

GradientPlan and KerasPlan are compared.

Each declaration runs on a chain, a skip connection and two heads, built once
as a Keras functional model (tf-keras eagerly, Keras 3 eagerly and in a
``tf.function``) and once as the equivalent tf.compat.v1 graph from
``get_variable`` with the Keras model's initial weights (run in a Session).
Both plans get the same batch and must give the same gradients, to
``rtol=1e-5, atol=1e-6``: the model's, and
the synthetic-gradient modules' too. Feedback matrices and synthetic modules
are made on each side from the same seed (the first run checks that they
are equal); then every such variable is set to equal random values on both
sides, which needs no shared generator, and the gradients are compared
again (modules then predict something other than the zeros they start
from).

With ``GG_PARITY_OUT=path`` set, the largest difference seen per
declaration, Keras flavour and mode, and graph shape is written there as
JSON.
"""

import json
import os
import re

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
import keras_cases
from keras_cases import FLAVOURS

tf1 = tf.compat.v1
RTOL, ATOL = 1e-5, 1e-6
MATRIX = {}

# Per graph shape: a middle layer, the top layer, an edge, the layers that
# get a replacement, DFA's error layer and the shared layer of the tasks.
SHAPES = {
    "chain": dict(mid="l2", top="l3", edge=("l2", "l3"), replaced=["l2", "l3"],
                  error=None, shared="l2"),
    "skip": dict(mid="l2", top="l3", edge=("l1", "l3"), replaced=["l2", "l3"],
                 error=None, shared="l1"),
    "two_heads": dict(mid="features", top="head",
                      edge=("features", "domain_head"),
                      replaced=["features", "head"], error="head",
                      shared="features"),
}


def _tasks(name, outs, labels):
  """Two task losses whose sum is the loss of every test here."""
  ce = lambda y, o: tf.reduce_mean(  # noqa: E731
      tf.nn.softmax_cross_entropy_with_logits(labels=y, logits=o))
  if name == "two_heads":
    return [ce(labels[0], outs[0]), ce(labels[1], outs[1])]
  # The same output with the labels reversed: a task that conflicts.
  return [ce(labels[0], outs[0]), -0.2 * ce(labels[0][::-1], outs[0])]


class _ScaledVJP(gg.backward.Replacement):
  """A user's replacement written once for both plans: ``c`` times the
  chain rule, through ``context.vjp``, with ``c`` a variable of the plan
  (``context.variable``), 0.5 until the test sets it."""

  name = "scaled_vjp"

  def backward(self, context):
    c = context.variable(self.name, lambda: tf.constant(0.5), name="B")
    pairs = [(y, g) for y, g in zip(context.outputs, context.upstream)
             if g is not None]
    return context.vjp([y for y, _ in pairs], context.inputs,
                       [c * g for _, g in pairs], stop=context.inputs)


def _declare(decl, shape, plan, tf1_side, labels=None, tasks=None):
  s = SHAPES[shape]
  T, B = gg.transforms, gg.backward
  if decl == "upstream":
    plan.transform_upstream(s["mid"], keras_cases.nonlinear)
    plan.transform_upstream(s["top"], T.scale(-0.5))
  elif decl == "gradients":
    plan.transform_gradients(s["mid"], T.scale(0.5))
    plan.transform_gradients(s["mid"], keras_cases.nonlinear)
  elif decl == "clip_by_global_norm":
    plan.transform_gradients(s["mid"], T.clip_by_global_norm(0.05))
    plan.transform_gradients(s["top"], T.clip_by_global_norm(100.0))
  elif decl == "trust_ratio":
    plan.transform_gradients(s["mid"], T.trust_ratio(0.01))
  elif decl == "edge":
    plan.transform_edge(*s["edge"], T.reverse(0.3))
    plan.transform_upstream(s["edge"][0], keras_cases.nonlinear)
  elif decl == "feedback_alignment":
    for layer in s["replaced"]:
      plan.replace_backward(layer, B.feedback_alignment(seed=3))
  elif decl == "upstream+feedback_alignment":  # fn sees the transformed g
    for layer in s["replaced"]:
      plan.transform_upstream(layer, keras_cases.nonlinear)
      plan.replace_backward(layer, B.feedback_alignment(seed=6))
  elif decl == "dfa":
    for layer in s["replaced"]:
      plan.replace_backward(layer, B.direct_feedback_alignment(
          seed=4, error_layer=s["error"]))
  elif decl == "synthetic":
    for layer in s["replaced"]:
      plan.replace_backward(layer, B.synthetic(
          hidden=(4,), seed=5, labels=labels if tf1_side else None))
  elif decl == "user_vjp":
    for layer in s["replaced"]:
      plan.replace_backward(layer, _ScaledVJP())
  elif decl == "project_conflicts":
    if tf1_side:
      plan.project_conflicts(s["shared"], tasks)
    else:
      plan.project_conflicts(s["shared"])
  else:
    raise ValueError(decl)
  return plan


def _tf1_key(name):
  """(layer, kernel_j | bias_j | B) of a TF1 method variable's name."""
  layer = re.search(r"replace_backward_(.+?)/", name).group(1)
  last = name.rsplit("/", 1)[-1].split(":")[0]
  return (layer, "B" if last.startswith("B") else last)


def _tf2_key(key):
  """The same for a KerasPlan's method variable key."""
  parts = key.split("/")
  if parts[0] == "synthetic":  # synthetic/<layer>/<input>/<name>
    return (parts[1], parts[3])
  return (parts[1], "B")  # <method key>/<layer>


def _perturbation(keys, seed=0):
  rng = np.random.default_rng(seed)
  return {k: rng.normal(size=shape).astype(np.float32) * 0.3
          for k, shape in sorted(keys.items())}


def _tf1(shape, decl, weights, x, labels, declare=True):
  """Two runs on the TF1 plan: as built, then with the methods' variables
  (feedback matrices, synthetic modules) set to _perturbation's values."""
  case = keras_cases.CASES[shape]
  with tf.Graph().as_default():
    ops = keras_cases.TF1Ops(weights)
    outs = case.forward(ops, tf.constant(x))
    ys = [tf.constant(l) for l in labels]
    tasks = _tasks(shape, outs, ys)
    plan = gg.GradientPlan(tf.add_n(tasks))
    if declare:
      _declare(decl, shape, plan, True, labels=ys[0], tasks=tasks)
    gv = plan.compute_gradients()
    n = sum(1 for _, v in gv if "replace_backward" not in v.name)
    model, extra = gv[:n], gv[n:]
    owned = [v for v in tf1.global_variables() if "replace_backward" in v.name]
    values = _perturbation({_tf1_key(v.name): v.shape.as_list()
                            for v in owned})
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      first = sess.run([g for g, _ in gv])
      for v in owned:
        v.load(values[_tf1_key(v.name)], sess)
      second = sess.run([g for g, _ in gv]) if owned else None
  out = []
  for run in (first, second):
    if run is None:
      out.append(None)
      continue
    by_layer = {}
    for (_, v), value in zip(model, run[:n]):
      by_layer.setdefault(v.op.name.rsplit("/", 1)[0], []).append(value)
    mods = {_tf1_key(v.name): value for (_, v), value in zip(extra, run[n:])}
    out.append((by_layer, mods))
  return out


def _tf2(shape, decl, model, x, labels, traced=False):
  """The same two runs on the KerasPlan."""
  plan = _declare(decl, shape, gg.KerasPlan(model), False)
  y0 = tf.constant(labels[0])

  def step(x):
    with plan.tape(labels=y0 if decl == "synthetic" else None) as tape:
      outs = model(x)
      outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
      tasks = _tasks(shape, outs, labels)
      loss = tf.add_n(tasks)
    gv = tape.grads_and_vars(
        loss, task_losses=tasks if decl == "project_conflicts" else None)
    variables[:] = [v for _, v in gv]  # a traced step returns tensors only
    return [g for g, _ in gv]

  variables = []
  step = tf.function(step) if traced else step
  runs = []
  for _ in range(2):
    gv = list(zip(step(tf.constant(x)), variables))
    key_of = {id(v): _tf2_key(k)
              for k, v in plan.method_variables.by_key.items()}
    n = len(model.trainable_variables)
    by_var = {id(v): np.asarray(g) for g, v in gv[:n]}
    by_layer = {l.name: [by_var[id(v)] for v in l.trainable_weights]
                for l in model.layers if l.trainable_weights}
    runs.append((by_layer, {key_of[id(v)]: np.asarray(g) for g, v in gv[n:]}))
    owned = plan.method_variables.by_key
    if not owned:
      return runs + [None]
    values = _perturbation({_tf2_key(k): v.shape.as_list()
                            for k, v in owned.items()})
    for k, v in owned.items():
      v.assign(values[_tf2_key(k)])
  return runs


def _compare(got, want, where):
  assert sorted(got) == sorted(want), where
  worst = 0.0
  for key in want:
    for a, e in zip(got[key], want[key]) if isinstance(want[key], list) else (
        [(got[key], want[key])]):
      np.testing.assert_allclose(a, e, rtol=RTOL, atol=ATOL,
                                 err_msg=f"{where} {key}")
      worst = max(worst, float(np.max(np.abs(np.asarray(a) - e))))
  return worst


DECLARATIONS = ["upstream", "gradients", "clip_by_global_norm", "trust_ratio",
                "edge", "feedback_alignment", "upstream+feedback_alignment",
                "dfa", "synthetic", "user_vjp",
                "project_conflicts"]


RUNS = ["tf_keras-eager", "keras3-eager", "keras3-function"]


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("decl", DECLARATIONS)
@pytest.mark.parametrize("run", RUNS)
def test_declaration_parity(run, decl, shape):
  flavour, mode = run.split("-")
  K = FLAVOURS[flavour]
  case = keras_cases.CASES[shape]
  model = keras_cases.keras_model(case, K)
  x, labels = keras_cases.batch(case)
  weights = keras_cases.layer_weights(model)
  want = _tf1(shape, decl, weights, x, labels)
  plain = _tf1(shape, decl, weights, x, labels, declare=False)[0][0]
  got = _tf2(shape, decl, model, x, labels, traced=mode == "function")
  worst = 0.0
  for i, (g, w) in enumerate(zip(got, want)):
    assert (g is None) == (w is None), (decl, i)
    if w is None:
      continue
    worst = max(worst, _compare(g[0], w[0], f"{decl} step {i} model"),
                _compare(g[1], w[1], f"{decl} step {i} modules"))
  MATRIX[(decl, run, shape)] = worst
  # The declaration really changes the gradients of some layer.
  assert any(not np.allclose(a, p) for layer in plain
             for a, p in zip(want[-1 if want[1] else 0][0][layer],
                             plain[layer])), decl


def teardown_module(module):
  path = os.environ.get("GG_PARITY_OUT")
  if path and MATRIX:
    with open(path, "w") as f:
      json.dump({"/".join(k): v for k, v in sorted(MATRIX.items())}, f,
                indent=1)
