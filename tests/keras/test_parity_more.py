"""Parity of GradientPlan and KerasPlan beyond tests/keras/test_parity.py.

The same three graph shapes (chain, skip, two_heads of keras_cases, with
test_parity's two task losses), the same three runs (tf-keras eagerly,
Keras 3 eagerly and in a ``tf.function``) and the same tolerance
(``rtol=1e-5, atol=1e-6``), for the declarations test_parity.py leaves out:

* overrides: ``straight_through`` and a nonlinear ``override_gradient`` on a
  relu that follows one layer of each shape: a Keras ``Activation("relu")``
  layer on one side, the ``Relu`` op on the other;
* ``recompute()`` and ``recompute(keep=[...])``, alone and beside nonlinear
  upstream transforms: equal to each other and to the plan without
  recompute, which each plan must really recompute;
* ``combine_tasks(layers, ..., at="parameters")`` on chain and skip, and on
  a subset of the layers beside an upstream transform (two_heads over all
  layers and every method: tests/keras/test_mtl_parity.py);
* a loss scale: ``GradientPlan(loss, loss_scale=`` a TF1
  ``MixedPrecisionLossScaleOptimizer``) against ``plan.tape(loss_scale=`` a
  Keras ``LossScaleOptimizer``), both with the fixed scale 1024, bare and
  with nonlinear upstream and parameter transforms, which must see the
  unscaled gradient;
* one loss-scale policy for task combinations, backward replacements and
  overrides on both plans (``test_loss_scale_*``).

Each case is shown to matter: the declaration changes some gradient against
the plan without it (recompute: the plans rebuild forward ops in the
backward pass; a loss scale: the gradients the tape returns are scaled).
"""

import logging

import numpy as np
import pytest
import tensorflow as tf
from test_parity import RUNS, SHAPES, _tasks

import graphgrad as gg
import keras_cases
from keras_cases import FLAVOURS

tf1 = tf.compat.v1
RTOL, ATOL = 1e-5, 1e-6
SCALE = 1024.0
MPLSO = tf1.mixed_precision.MixedPrecisionLossScaleOptimizer

# The layer a relu follows, per shape: its output has one consumer (chain),
# two (skip: l2 and the sum) or two layers (two_heads).
RELU_AFTER = {"chain": "l1", "skip": "l1", "two_heads": "features"}
# The layer whose output recompute(keep=...) keeps, per shape.
KEEP = {"chain": "l1", "skip": "l1", "two_heads": "base"}


class _ReluAfter:
  """keras_cases' ops with a relu after the layer named ``at``."""

  def __init__(self, ops, at):
    self._ops, self._at = ops, at

  def __getattr__(self, name):
    return getattr(self._ops, name)

  def dense(self, x, units, name, act=None):
    out = self._ops.dense(x, units, name, act)
    return self._ops.relu(out) if name == self._at else out


def _squash(op, dy):
  """A backward pass nonlinear in ``dy`` that reads the op's input; the
  signature of a registered gradient function, which both plans take."""
  return [keras_cases.nonlinear(dy)
          * tf.cast(op.inputs[0] > -0.2, dy.dtype)]


class _Side:
  """What a declaration needs of one plan: the shape's layer names, the
  task losses (GradientPlan: tensors; KerasPlan: None, given per step) and
  the relu (GradientPlan: the op type; KerasPlan: the Activation layer)."""

  def __init__(self, shape, tasks=None, relu=None):
    self.shape, self.s, self.tasks, self.relu = (shape, SHAPES[shape], tasks,
                                                 relu)

  def combine(self, plan, layers, method):
    if self.tasks is None:
      return plan.combine_tasks(layers, method, at="parameters")
    return plan.combine_tasks(layers, self.tasks, method, at="parameters")


T = gg.transforms


def _two_upstreams(p, d):
  return (p.transform_upstream(d.s["mid"], keras_cases.nonlinear)
          .transform_upstream(d.s["top"], T.clip_by_norm(0.05)))


def _clip_mid(p, d):
  return p.transform_upstream(d.s["mid"], T.clip_by_norm(0.05))


DECLARATIONS = {
    "straight_through": lambda p, d: p.straight_through(d.relu),
    "straight_through+upstream": lambda p, d: (
        p.straight_through(d.relu)
        .transform_upstream(RELU_AFTER[d.shape], keras_cases.nonlinear)),
    "override_nonlinear": lambda p, d: p.override_gradient(d.relu, _squash),
    "recompute": lambda p, d: p.recompute(),
    "upstream+recompute": lambda p, d: _two_upstreams(p, d).recompute(),
    "clip+recompute_keep": lambda p, d: _clip_mid(p, d).recompute(
        keep=[KEEP[d.shape]]),
    "tasks_parameters": lambda p, d: d.combine(p, None, gg.mtl.upgrad()),
    "tasks_parameters_subset+upstream": lambda p, d: d.combine(
        p, [d.s["mid"], d.s["top"]], gg.mtl.mgda()).transform_upstream(
            d.s["mid"], keras_cases.nonlinear),
    # With a loss scale (LOSS_SCALE): none, or transforms that a wrong
    # scale would change.
    "none": lambda p, d: p,
    "transforms": lambda p, d: (
        p.transform_upstream(d.s["mid"], T.clip_by_norm(0.02))
        .transform_upstream(d.s["top"], keras_cases.nonlinear)
        .transform_gradients(d.s["mid"], T.clip_by_norm(0.05))),
}
OVERRIDES = ["straight_through", "straight_through+upstream",
             "override_nonlinear"]
# Each recompute declaration, and the same without recompute.
RECOMPUTE = {"recompute": lambda p, d: p,
             "upstream+recompute": _two_upstreams,
             "clip+recompute_keep": _clip_mid}
PARAMETER_TASKS = [("tasks_parameters", "chain"), ("tasks_parameters", "skip"),
                   ("tasks_parameters_subset+upstream", "chain"),
                   ("tasks_parameters_subset+upstream", "skip"),
                   ("tasks_parameters_subset+upstream", "two_heads")]
# A bare plan on the chain; the transforms on every shape.
LOSS_SCALE = [("none", "chain")] + [("transforms", shape)
                                    for shape in sorted(SHAPES)]


def _ops(ops, shape, relu):
  return _ReluAfter(ops, RELU_AFTER[shape]) if relu else ops


def _tf1(shape, weights, x, labels, declare=None, relu=False, scale=None,
         scaled_loss=False):
  """The TF1 plan's gradients by variable name, and the number of forward
  ops it rebuilt for recompute.

  ``scale``: make the plan with a MixedPrecisionLossScaleOptimizer of that
  fixed scale. ``scaled_loss``: the plan of ``SCALE * loss``, its
  gradients divided by ``SCALE`` (the scale its transforms must not see).
  """
  with tf.Graph().as_default() as graph:
    outs = keras_cases.CASES[shape].forward(
        _ops(keras_cases.TF1Ops(weights), shape, relu), tf.constant(x))
    tasks = _tasks(shape, outs, [tf.constant(l) for l in labels])
    loss = tf.add_n(tasks)
    opt = (None if scale is None else
           MPLSO(tf1.train.GradientDescentOptimizer(0.1), scale))
    plan = gg.GradientPlan(SCALE * loss if scaled_loss else loss,
                           loss_scale=opt)
    if declare is not None:
      declare(plan, _Side(shape, tasks, "Relu"))
    gv = plan.compute_gradients()
    rebuilt = [op for op in graph.get_operations()
               if "/recompute_" in op.name and "gradients" not in op.name]
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      values = sess.run([g for g, _ in gv])
  grads = {v.op.name: g / SCALE if scaled_loss else g
           for (_, v), g in zip(gv, values)}
  return grads, len(rebuilt)


_PLAIN = {}


def _plain(shape, weights, x, labels, relu=False):
  """The TF1 plan's gradients without declarations, built once per model
  (the weights of one Keras flavour) and batch."""
  key = (shape, relu, tuple(np.asarray(w).tobytes()
                            for name in sorted(weights)
                            for w in weights[name]), x.tobytes())
  if key not in _PLAIN:
    _PLAIN[key] = _tf1(shape, weights, x, labels, relu=relu)[0]
  return _PLAIN[key]


def _loss_scale_optimizer(flavour, K):
  if keras_cases.is_keras3(K):
    return K.optimizers.LossScaleOptimizer(K.optimizers.SGD(0.1),
                                           initial_scale=SCALE)
  return K.mixed_precision.LossScaleOptimizer(
      K.optimizers.SGD(0.1), dynamic=False, initial_scale=SCALE)


def _tf2(shape, model, x, labels, declare, traced, relu=False, opt=None,
         tasks=False):
  """The KerasPlan's gradients by variable name (scaled, when ``opt`` is a
  loss-scale optimizer) and, traced, the number of forward ops (BiasAdd)
  its backward pass replays for recompute."""
  layer = None
  if relu:
    layer, = [l for l in model.layers if type(l).__name__ == "Activation"]
  plan = declare(gg.KerasPlan(model), _Side(shape, relu=layer))
  y = [tf.constant(l) for l in labels]
  replayed = []

  def step(x):
    with plan.tape(loss_scale=opt) as tape:
      outs = model(x)
      outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
      losses = _tasks(shape, outs, y)
      loss = tf.add_n(losses)
      if opt is not None:
        loss = (opt.scale_loss(loss) if hasattr(opt, "scale_loss")
                else opt.get_scaled_loss(loss))
    grads = tape.gradient(loss, task_losses=losses if tasks else None)
    if not tf.executing_eagerly():
      replayed.extend(
          op for op in tf1.get_default_graph().get_operations()
          if op.type == "BiasAdd" and "/recompute" in op.name)
    return grads

  step = tf.function(step) if traced else step
  names = [f"{l.name}/{w.name.split('/')[-1].split(':')[0]}"
           for l in model.layers for w in l.trainable_weights]
  grads = dict(zip(names, [np.asarray(g) for g in step(tf.constant(x))]))
  return grads, len(replayed)


def _close(got, want, where, rtol=RTOL, atol=ATOL):
  assert sorted(got) == sorted(want), where
  for name in want:
    np.testing.assert_allclose(got[name], want[name], rtol=rtol, atol=atol,
                               err_msg=f"{where} {name}")


def _recompute_close(got, want, where):
  """As tests/plan/test_recompute.py: rtol 1e-6 of the largest entry."""
  scale = max(float(np.abs(w).max()) for w in want.values())
  _close(got, want, where, rtol=1e-6, atol=1e-6 * scale)


def _changed(got, plain):
  return any(not np.allclose(got[k], plain[k]) for k in plain)


def _setup(run, shape, relu=False):
  flavour, mode = run.split("-")
  K = FLAVOURS[flavour]
  case = keras_cases.CASES[shape]
  inp = K.Input((case.inputs,))
  model = K.Model(inp, case.forward(
      _ops(keras_cases.KerasOps(K), shape, relu), inp))
  x, labels = keras_cases.batch(case)
  return flavour, K, model, mode == "function", x, labels


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("decl", OVERRIDES)
@pytest.mark.parametrize("run", RUNS)
def test_override_parity(run, decl, shape):
  _, _, model, traced, x, labels = _setup(run, shape, relu=True)
  weights = keras_cases.layer_weights(model)
  declare = DECLARATIONS[decl]
  want, _ = _tf1(shape, weights, x, labels, declare, relu=True)
  got, _ = _tf2(shape, model, x, labels, declare, traced, relu=True)
  _close(got, want, decl)
  plain = _plain(shape, weights, x, labels, relu=True)
  assert _changed(want, plain), decl
  # The relu's own backward pass is gone: the layer below it learns from
  # the rows that relu zeroes too.
  below = f"{RELU_AFTER[shape]}/kernel"
  assert not np.allclose(want[below], plain[below]), decl


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("decl", RECOMPUTE)
@pytest.mark.parametrize("run", RUNS)
def test_recompute_parity(run, decl, shape):
  _, _, model, traced, x, labels = _setup(run, shape)
  weights = keras_cases.layer_weights(model)
  declare = DECLARATIONS[decl]
  want, rebuilt = _tf1(shape, weights, x, labels, declare)
  got, replayed = _tf2(shape, model, x, labels, declare, traced)
  _close(got, want, decl)
  plain = _plain(shape, weights, x, labels)
  without = (plain if decl == "recompute" else
             _tf1(shape, weights, x, labels, RECOMPUTE[decl])[0])
  _recompute_close(want, without, f"{decl} against no recompute")
  _close(got, without, f"{decl} (Keras) against no recompute")
  # Both plans really recompute: GradientPlan rebuilds forward ops; a
  # traced KerasPlan step replays layer calls (an eager one keeps every
  # activation).
  assert rebuilt > 0, decl
  assert replayed > 0 or not traced, decl
  assert _changed(want, plain) == (decl != "recompute"), decl


@pytest.mark.parametrize("decl,shape", PARAMETER_TASKS)
@pytest.mark.parametrize("run", RUNS)
def test_parameter_tasks_parity(run, decl, shape):
  _, _, model, traced, x, labels = _setup(run, shape)
  weights = keras_cases.layer_weights(model)
  declare = DECLARATIONS[decl]
  want, _ = _tf1(shape, weights, x, labels, declare)
  got, _ = _tf2(shape, model, x, labels, declare, traced, tasks=True)
  _close(got, want, decl)
  assert _changed(want, _plain(shape, weights, x, labels)), decl
  if decl == "tasks_parameters_subset+upstream":
    # The layers outside the subset keep the plan's gradient (the upstream
    # transform's, below mid).
    alone, _ = _tf1(shape, weights, x, labels, lambda p, d: (
        p.transform_upstream(d.s["mid"], keras_cases.nonlinear)))
    inside = (SHAPES[shape]["mid"], SHAPES[shape]["top"])
    for name in want:
      if not name.startswith(inside):
        np.testing.assert_allclose(want[name], alone[name], rtol=1e-6,
                                   atol=1e-7, err_msg=name)


@pytest.mark.parametrize("decl,shape", LOSS_SCALE)
@pytest.mark.parametrize("run", RUNS)
def test_loss_scale_parity(run, decl, shape):
  flavour, K, model, traced, x, labels = _setup(run, shape)
  weights = keras_cases.layer_weights(model)
  declare = DECLARATIONS[decl]
  want, _ = _tf1(shape, weights, x, labels, declare, scale=SCALE)
  raw, _ = _tf2(shape, model, x, labels, declare, traced,
                opt=_loss_scale_optimizer(flavour, K))
  # The tape returns the scaled gradients, for the optimizer to unscale;
  # compute_gradients returns the unscaled ones. 1024 is a power of two.
  got = {k: v / SCALE for k, v in raw.items()}
  _close(got, want, decl)
  # Scaling is invisible: the plan without a loss scale gives the same.
  unscaled, _ = _tf1(shape, weights, x, labels, declare)
  _close(want, unscaled, f"{decl} against no loss scale", rtol=1e-6,
         atol=1e-7)
  plain = _plain(shape, weights, x, labels)
  assert not np.allclose(raw[f"{SHAPES[shape]['top']}/kernel"],
                         plain[f"{SHAPES[shape]['top']}/kernel"])
  if decl == "transforms":
    assert _changed(want, plain)
    # Transforms that saw the scaled gradient would give other gradients.
    wrong, _ = _tf1(shape, weights, x, labels, declare, scaled_loss=True)
    assert _changed(wrong, want)


# -- the loss-scale policy, one for both plans ---------------------------------
#
# A task combination or backward replacement under a loss scale receives the
# loss-scaled gradients. It is accepted when it is homogeneous,
# combine(S J) = S combine(J) (TaskMethod.homogeneous, Replacement.homogeneous,
# checked for every method in tests/methods/test_homogeneous.py), and refused
# by both plans, with one message, otherwise (graphgrad/core/_rules.py).
# Overrides pass on both, and their fn sees the loss-scaled gradient on both.

def _at_mid(method):
  """``combine_tasks`` at the middle layer, as each plan takes it."""
  def declare(p, d):
    losses = [] if d.tasks is None else [d.tasks]
    return p.combine_tasks(d.s["mid"], *losses, method)
  return declare


REFUSED = {
    "nash_mtl": _at_mid(gg.mtl.nash_mtl()),
    "nash_mtl_parameters": lambda p, d: d.combine(
        p, None, gg.mtl.nash_mtl()),
    "user_replacement": lambda p, d: p.replace_backward(
        d.s["mid"], _half_vjp),
    "synthetic": lambda p, d: p.replace_backward(
        d.s["mid"], gg.backward.synthetic(hidden=(4,), seed=5)),
}
REFUSAL = (r"^loss_scale: .* \(not homogeneous\), so they would be "
           r"silently wrong")


@pytest.mark.parametrize("decl", sorted(REFUSED))
def test_loss_scale_refuses_what_does_not_scale_on_both_plans(decl):
  _, K, model, _, x, labels = _setup("keras3-eager", "chain")
  weights = keras_cases.layer_weights(model)
  with pytest.raises(gg.GraphGradError, match=REFUSAL):
    _tf1("chain", weights, x, labels, REFUSED[decl], scale=SCALE)
  plan = REFUSED[decl](gg.KerasPlan(model), _Side("chain"))
  with pytest.raises(gg.GraphGradError, match=REFUSAL):
    plan.tape(loss_scale=_loss_scale_optimizer("keras3", K))


# Accepted: under a loss scale of 1024 each plan's gradients (Keras: over
# 1024, of the scaled loss and task losses) equal its own without a loss
# scale (the plans' parity without a loss scale is test_parity's).
ACCEPTED = {  # name: (declare, takes task losses)
    "pcgrad": (_at_mid(gg.mtl.pcgrad()), True),
    "mgda": (_at_mid(gg.mtl.mgda()), True),
    "pcgrad_parameters": (lambda p, d: d.combine(p, None, gg.mtl.pcgrad()),
                          True),
    "upgrad_parameters": (lambda p, d: d.combine(p, None, gg.mtl.upgrad()),
                          True),
    "feedback_alignment": (lambda p, d: p.replace_backward(
        d.s["mid"], gg.backward.feedback_alignment(seed=3)), False),
}


def _half_vjp(ctx):
  """A user's replacement: half the chain rule, not marked homogeneous."""
  return ctx.vjp(list(ctx.outputs), ctx.inputs,
                 [0.5 * g for g in ctx.upstream], stop=ctx.inputs)


def _keras_scaled(model, x, labels, decl, opt, scaled):
  """The chain's KerasPlan gradients of one eager step: under
  ``plan.tape(loss_scale=opt)`` of ``SCALE * loss`` with the task losses
  scaled alike, over ``SCALE``; or of the plain loss without it."""
  declare, tasks = ACCEPTED[decl]
  plan = declare(gg.KerasPlan(model), _Side("chain"))
  with plan.tape(loss_scale=opt if scaled else None) as tape:
    losses = _tasks("chain", [model(tf.constant(x))],
                    [tf.constant(l) for l in labels])
    if scaled:
      losses = [SCALE * l for l in losses]
    loss = tf.add_n(losses)
  grads = tape.gradient(loss, task_losses=losses if tasks else None)
  return [np.asarray(g) / (SCALE if scaled else 1.0) for g in grads]


@pytest.mark.parametrize("decl", sorted(ACCEPTED))
def test_loss_scale_accepts_what_scales_on_both_plans(decl, caplog):
  K = FLAVOURS["keras3"]
  model = keras_cases.keras_model(keras_cases.CASES["chain"], K)
  x, labels = keras_cases.batch(keras_cases.CASES["chain"])
  weights = keras_cases.layer_weights(model)
  declare = ACCEPTED[decl][0]
  want, _ = _tf1("chain", weights, x, labels, declare)
  got, _ = _tf1("chain", weights, x, labels, declare, scale=SCALE)
  _close(got, want, f"{decl} GradientPlan")
  opt = _loss_scale_optimizer("keras3", K)
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    got = _keras_scaled(model, x, labels, decl, opt, True)
  assert not [r for r in caplog.records if r.name == "graphgrad"]
  want = _keras_scaled(model, x, labels, decl, opt, False)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL, err_msg=decl)


@pytest.mark.parametrize("run", RUNS)
def test_loss_scale_an_override_fn_sees_the_scaled_gradient(run):
  # Both plans accept an override under a loss scale and call its fn on
  # the loss-scaled gradient, as they are: a nonlinear fn then differs
  # from the plan without a loss scale (unlike a transform, see
  # test_loss_scale_parity), equally on both plans.
  flavour, K, model, traced, x, labels = _setup(run, "skip", relu=True)
  weights = keras_cases.layer_weights(model)
  declare = DECLARATIONS["override_nonlinear"]
  want, _ = _tf1("skip", weights, x, labels, declare, relu=True, scale=SCALE)
  raw, _ = _tf2("skip", model, x, labels, declare, traced, relu=True,
                opt=_loss_scale_optimizer(flavour, K))
  _close({k: v / SCALE for k, v in raw.items()}, want, "override")
  unscaled, _ = _tf1("skip", weights, x, labels, declare, relu=True)
  on_scaled, _ = _tf1("skip", weights, x, labels, declare, relu=True,
                      scaled_loss=True)
  assert _changed(want, unscaled)
  _close(want, on_scaled, "override sees S * g", rtol=1e-6, atol=1e-7)


# -- context.vjp: a None entry of grad_ys sends nothing, on both plans ---------


def _none_entry_vjp(ctx):
  """A user's replacement: the chain rule through ``context.vjp``, with a
  second ``ys`` entry whose ``grad_ys`` entry is ``None``."""
  y = ctx.outputs[0]
  return ctx.vjp([y, 3.0 * y], ctx.inputs, [ctx.upstream[0], None],
                 stop=ctx.inputs)


@pytest.mark.parametrize("run", RUNS)
def test_a_none_grad_ys_entry_sends_nothing_on_both_plans(run):
  _, _, model, traced, x, labels = _setup(run, "chain")
  weights = keras_cases.layer_weights(model)

  def declare(p, d):
    return p.replace_backward(d.s["mid"], _none_entry_vjp)

  want, _ = _tf1("chain", weights, x, labels, declare)
  got, _ = _tf2("chain", model, x, labels, declare, traced)
  _close(got, want, "None entry")
  # Only the other entry flows: the chain rule, tf.gradients' own.
  _close(want, _plain("chain", weights, x, labels), "None entry (TF1)")
