"""Parity: every gg.mtl method gives equal gradients on both plans.

As tests/keras/test_parity.py: two heads on a shared trunk (keras_cases'
``two_heads``), built once as a Keras functional model and once as the
equivalent tf.compat.v1 graph with the Keras model's weights. Both plans
combine the two task gradients at ``features`` with the same method, get the
same batch and must give the same gradients, ``rtol=1e-5, atol=1e-6``, at
two steps in a row (the second step reads the state a stateful method wrote
in the first). GradDrop draws random numbers, which a tf.Graph and eager
TensorFlow draw differently for one seed, so it is left out.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
import keras_cases

tf1 = tf.compat.v1
RTOL, ATOL = 1e-5, 1e-6
CASE = keras_cases.CASES["two_heads"]

METHODS = {
    "pcgrad": gg.mtl.pcgrad, "mgda": gg.mtl.mgda,
    "cagrad": lambda: gg.mtl.cagrad(0.4), "imtl_g": gg.mtl.imtl_g,
    "aligned_mtl": gg.mtl.aligned_mtl, "upgrad": gg.mtl.upgrad,
    "dualproj": gg.mtl.dualproj, "nash_mtl": gg.mtl.nash_mtl,
    "gradvac": gg.mtl.gradvac, "config": gg.mtl.config,
    "mean": gg.mtl.mean, "sum": gg.mtl.sum,
}


def _tasks(outs, labels):
  ce = lambda y, o: tf.reduce_mean(  # noqa: E731
      tf.nn.softmax_cross_entropy_with_logits(labels=y, logits=o))
  return [ce(labels[0], outs[0]), 2.0 * ce(labels[1], outs[1])]


def _declare(plan, method, tf1_tasks=None, layers=("features",),
             upstream=False, at="output"):
  if at == "parameters":  # one declaration over the layers (None: all)
    if tf1_tasks is None:
      plan.combine_tasks(layers, method, at=at)
    else:
      plan.combine_tasks(layers, tf1_tasks, method, at=at)
    return plan
  for layer in layers:
    if tf1_tasks is None:
      plan.combine_tasks(layer, method)
    else:
      plan.combine_tasks(layer, tf1_tasks, method)
  if upstream:
    plan.transform_upstream("features", keras_cases.nonlinear)
  return plan


def _tf1(weights, x, labels, method, steps=2, **kw):
  """The gradients of each step on the TF1 plan, by variable op name."""
  with tf.Graph().as_default():
    outs = CASE.forward(keras_cases.TF1Ops(weights), tf.constant(x))
    tasks = _tasks(outs, [tf.constant(l) for l in labels])
    plan = _declare(gg.GradientPlan(tf.add_n(tasks)), method, tasks, **kw)
    gv = plan.compute_gradients()
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      runs = [sess.run([g for g, _ in gv]) for _ in range(steps)]
    return [dict(zip([v.op.name for _, v in gv], r)) for r in runs]


def _tf2(K, method, traced, steps=2, **kw):
  model = keras_cases.keras_model(CASE, K)
  x, labels = keras_cases.batch(CASE)
  weights = keras_cases.layer_weights(model)
  plan = _declare(gg.KerasPlan(model), method, **kw)

  def step(x):
    with plan.tape() as tape:
      loss_terms = _tasks(model(x), labels)
      loss = tf.add_n(loss_terms)
    return tape.gradient(loss, task_losses=loss_terms)

  step = tf.function(step) if traced else step
  names = [f"{l.name}/{w.name.split('/')[-1].split(':')[0]}"
           for l in model.layers for w in l.trainable_weights]
  runs = [dict(zip(names, [np.asarray(g) for g in step(tf.constant(x))]))
          for _ in range(steps)]
  return runs, (weights, x, labels), plan


def _assert_equal_runs(got, want, where):
  assert len(got) == len(want)
  for i, (g, w) in enumerate(zip(got, want)):
    assert sorted(g) == sorted(w), where
    for name in w:
      np.testing.assert_allclose(g[name], w[name], rtol=RTOL, atol=ATOL,
                                 err_msg=f"{where} step {i} {name}")


RUNS = [("keras3", False), ("keras3", True), ("tf_keras", False)]


@pytest.mark.parametrize("name", sorted(METHODS))
@pytest.mark.parametrize("flavour,traced", RUNS,
                         ids=["keras3-eager", "keras3-function",
                              "tf_keras-eager"])
def test_every_method_is_equal_on_both_plans(name, flavour, traced):
  K = keras if flavour == "keras3" else tf.keras
  got, (weights, x, labels), _ = _tf2(K, METHODS[name](), traced)
  want = _tf1(weights, x, labels, METHODS[name]())
  _assert_equal_runs(got, want, name)
  # The method changes the trunk's gradient (against the plain sum), or is
  # the plain sum.
  plain = _tf1(weights, x, labels, gg.mtl.sum(), steps=1)[0]
  changed = not np.allclose(want[0]["base/kernel"], plain["base/kernel"])
  assert changed == (name != "sum"), name


@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_method_in_parameter_space_is_equal_on_both_plans(name):
  got, (weights, x, labels), _ = _tf2(keras, METHODS[name](), False,
                                      layers=None, at="parameters")
  want = _tf1(weights, x, labels, METHODS[name](), layers=None,
              at="parameters")
  _assert_equal_runs(got, want, name)
  output = _tf1(weights, x, labels, METHODS[name](), steps=1)[0]
  plain = _tf1(weights, x, labels, gg.mtl.sum(), steps=1)[0]
  for key in want[0]:  # the heads' gradients change too, except for sum
    if key.startswith("head"):
      assert np.allclose(want[0][key], plain[key]) == (name == "sum"), key
  # Linear weights (sum, mean) give the same below the output level; and
  # the mean of these tasks conflicts with neither, so DualProj keeps it.
  # The others weigh the tasks by their parameter gradients instead.
  same = name in ("sum", "mean", "dualproj")
  assert np.allclose(want[0]["base/kernel"], output["base/kernel"],
                     rtol=1e-5, atol=1e-6) == same, name


@pytest.mark.parametrize("flavour,traced", RUNS[1:],
                         ids=["keras3-function", "tf_keras-eager"])
def test_pcgrad_over_two_layers_is_equal_on_both_plans(flavour, traced):
  K = keras if flavour == "keras3" else tf.keras
  kw = dict(layers=["base", "features"], at="parameters")
  got, (weights, x, labels), _ = _tf2(K, gg.mtl.pcgrad(), traced, **kw)
  want = _tf1(weights, x, labels, gg.mtl.pcgrad(), **kw)
  _assert_equal_runs(got, want, "pcgrad")


@pytest.mark.parametrize("name", ["upgrad", "pcgrad", "gradvac"])
def test_an_upstream_transform_acts_after_the_combination_on_both(name):
  got, (weights, x, labels), _ = _tf2(keras, METHODS[name](), True,
                                      upstream=True)
  want = _tf1(weights, x, labels, METHODS[name](), upstream=True)
  _assert_equal_runs(got, want, name)
  # The documented order: the layer's own parameters see the combination,
  # the layers below see the transform of it (GradientPlan's order is
  # checked against tf.gradients in tests/methods/test_mtl_plan.py).
  alone = _tf1(weights, x, labels, METHODS[name]())
  np.testing.assert_allclose(want[0]["features/kernel"],
                             alone[0]["features/kernel"], rtol=1e-6)
  assert not np.allclose(want[0]["base/kernel"], alone[0]["base/kernel"])


def test_one_method_value_on_two_layers_and_two_plans_has_separate_state():
  method = gg.mtl.gradvac()
  got, (weights, x, labels), plan = _tf2(
      keras, method, False, layers=("base", "features"))
  want = _tf1(weights, x, labels, method, layers=("base", "features"))
  _assert_equal_runs(got, want, "two layers")
  states = plan.method_variables.states
  assert sorted(states) == ["combine_tasks/base", "combine_tasks/features"]
  base, feats = states["combine_tasks/base"], states["combine_tasks/features"]
  assert base.phi is not feats.phi
  assert not np.allclose(base.phi.numpy(), feats.phi.numpy())
  other = _tf2(keras, method, False)[2]
  state = other.method_variables.states["combine_tasks/features"]
  assert state.phi is not feats.phi
  np.testing.assert_allclose(state.phi.numpy(), feats.phi.numpy(), rtol=1e-5)


def test_checkpoint_saves_the_state(tmp_path):
  _, _, plan = _tf2(keras, gg.mtl.nash_mtl(), False)
  state = plan.method_variables.states["combine_tasks/features"]
  saved = state.alpha.numpy()
  assert int(state.step.numpy()) == 2 and not np.allclose(saved, 1.0)
  path = tf.train.Checkpoint(plan=plan).save(str(tmp_path / "ckpt"))
  names = [n for n, _ in tf.train.list_variables(path)]
  assert any("states" in n and "alpha" in n for n in names), names
  state.alpha.assign(tf.ones_like(state.alpha))
  state.step.assign(0)
  tf.train.Checkpoint(plan=plan).restore(path).assert_existing_objects_matched()
  np.testing.assert_array_equal(state.alpha.numpy(), saved)
  assert int(state.step.numpy()) == 2


def test_keras_parameter_level_arguments_and_task_losses():
  model = keras_cases.keras_model(CASE, keras)
  x, labels = keras_cases.batch(CASE)
  plan = gg.KerasPlan(model)
  with pytest.raises(gg.GraphGradError,
                     match=r"^combine_tasks: `at` must be one of 'output', "
                           r"'parameters'; got 'param'"):
    plan.combine_tasks("features", gg.mtl.pcgrad(), at="param")
  with pytest.raises(gg.GraphGradError,
                     match=r"with at='output' `layers` must be one layer"):
    plan.combine_tasks(None, gg.mtl.pcgrad())
  model.get_layer("base").trainable = False
  with pytest.raises(gg.GraphGradError,
                     match=r"layer\(s\) 'base' hold no trainable variable"):
    plan.combine_tasks(["base", "features"], gg.mtl.pcgrad(),
                       at="parameters")
  model.get_layer("base").trainable = True
  plan.combine_tasks(["base", "features"], gg.mtl.pcgrad(), at="parameters")
  with pytest.raises(gg.GraphGradError, match=r"already combines task "
                                              r"gradients in parameter space"):
    plan.combine_tasks(None, gg.mtl.mgda(), at="parameters")

  def grads(task_losses):
    with plan.tape() as tape:
      terms = _tasks(model(tf.constant(x)), labels)
      loss = tf.add_n(terms)
    return tape.gradient(loss, task_losses=task_losses(terms))
  with pytest.raises(gg.GraphGradError,
                     match=r"task losses for the combination "
                           r"at='parameters' \(dict key 'parameters'\); got "
                           r"None"):
    grads(lambda terms: {"features": terms})
  by_key = grads(lambda terms: {"parameters": terms})
  as_list = grads(lambda terms: terms)
  for a, b in zip(by_key, as_list):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
