"""KerasPlan's training methods: their variables, state, contract and errors."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
import keras_cases
from helpers import HalfThroughKernel

RTOL, ATOL = 1e-5, 1e-6



def _chain(K):
  return keras_cases.keras_model(keras_cases.Chain, K)


def _x(rows=16, cols=6, seed=0):
  return tf.constant(np.random.default_rng(seed).normal(size=(rows, cols)),
                     tf.float32)


def _loss(model, x):
  out = model(x)
  return tf.reduce_sum(tf.sin(out[0] if isinstance(out, list) else out))


def _grads(plan, model, x, **tape_kw):
  with plan.tape(**tape_kw) as tape:
    loss = _loss(model, x)
  return tape.grads_and_vars(loss)


# -- variables: once per plan, tracked by the plan -----------------------------


def test_method_variables_are_made_once_per_plan(K):
  model = _chain(K)
  shared = gg.backward.synthetic(hidden=(4,), seed=1)
  plan = (gg.KerasPlan(model).replace_backward("l2", shared)
          .replace_backward("l3", shared)
          .replace_backward("l1", gg.backward.feedback_alignment(seed=0)))
  first = _grads(plan, model, _x())
  made = dict(plan.method_variables.by_key)
  second = _grads(plan, model, _x(seed=1))
  assert plan.method_variables.by_key == made  # the same variables
  assert [v for _, v in first] == [v for _, v in second]
  # One synthetic() value on two layers: a module for each.
  assert {k.rsplit("/", 2)[0] for k in made if k.startswith("synthetic/")} == {
      "synthetic/l2", "synthetic/l3"}
  assert list(plan.feedback_matrices) == ["feedback_alignment/l1"]
  # A second plan with the same value gets its own modules.
  other = gg.KerasPlan(model).replace_backward("l3", shared)
  _grads(other, model, _x())
  mine = plan.method_variables.by_key["synthetic/l3/0/kernel_0"]
  theirs = other.method_variables.by_key["synthetic/l3/0/kernel_0"]
  assert mine is not theirs
  assert len(plan.trainable_variables) == len(model.trainable_variables) + 8


@pytest.mark.parametrize("traced", [False, True])
def test_checkpoint_round_trip(K, tmp_path, traced):
  def planned(model):  # seed=None: random matrices, equal only if restored
    return (gg.KerasPlan(model)
            .replace_backward("l2", gg.backward.feedback_alignment())
            .replace_backward("l3", gg.backward.synthetic(hidden=(3,))))

  def step(plan, model):
    def run(x):
      return [g for g, _ in _grads(plan, model, x)]
    return tf.function(run) if traced else run

  model = _chain(K)
  plan = planned(model)
  step(plan, model)(_x())
  rng = np.random.default_rng(0)
  for key, v in plan.method_variables.by_key.items():
    if key.startswith("synthetic/"):  # away from their zero start
      v.assign(rng.normal(size=v.shape).astype(np.float32))
  path = tf.train.Checkpoint(plan=plan).write(str(tmp_path / "ckpt"))

  model2 = _chain(K)
  plan2 = planned(model2)
  tf.train.Checkpoint(plan=plan2).read(path).assert_existing_objects_matched()
  got = step(plan2, model2)(_x(seed=2))  # variables made, then restored
  want = step(plan, model)(_x(seed=2))
  assert sorted(plan2.method_variables.by_key) == sorted(
      plan.method_variables.by_key)
  for key, v in plan.method_variables.by_key.items():
    np.testing.assert_array_equal(plan2.method_variables.by_key[key], v)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


# -- stateful transforms: annealed noise steps with the optimizer --------------


@pytest.mark.parametrize("step_kind", ["iterations", "variable"])
def test_annealed_noise_steps_with_the_global_step(K, step_kind):
  inp = K.Input((50,))
  model = K.Model(inp, K.layers.Dense(400, name="wide")(inp))
  optimizer = K.optimizers.SGD(0.1)
  step = (optimizer.iterations if step_kind == "iterations"
          else tf.Variable(0, dtype=tf.int64))
  eta, gamma = 0.5, 0.55
  plan = gg.KerasPlan(model, global_step=step).transform_gradients(
      "wide", gg.transforms.add_noise(eta=eta, gamma=gamma, seed=3))
  x = _x(8, 50)

  @tf.function
  def noise(x):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(model(x))
    clean = tape.gradient(loss, model.trainable_variables)[0]
    with plan.tape() as tape:
      loss = tf.reduce_sum(model(x))
    return tape.gradient(loss)[0] - clean

  for t in (0, 99):  # one trace; the step is read at each call
    step.assign(t)
    got = float(np.std(noise(x)))
    np.testing.assert_allclose(got, np.sqrt(eta / (1 + t) ** gamma),
                               rtol=0.03)


# -- the replacement contract --------------------------------------------------


def test_user_replacement_gets_the_keras_context(K):
  model = _chain(K)
  x = _x()
  seen = []

  def doubled(ctx):  # twice the chain rule, below l2 only
    seen.append((ctx.name, type(ctx.layer).__name__, len(ctx.inputs)))
    return [2.0 * g for g in ctx.chain_rule()]

  plan = gg.KerasPlan(model).replace_backward("l2", doubled)
  got = [g for g, _ in _grads(plan, model, x)]
  ref = gg.KerasPlan(model).transform_upstream("l2", gg.transforms.scale(2.0))
  want = [g for g, _ in _grads(ref, model, x)]
  assert seen == [("l2", "Dense", 1)]
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)
  plain = gg.KerasPlan(model).transform_upstream("l2", gg.transforms.scale(1.0))
  assert not np.allclose(got[0], _grads(plain, model, x)[0][0])


def test_a_replacement_differentiates_through_the_context_vjp(K):
  inp = K.Input((6,))
  l1 = K.layers.Dense(5, activation="relu", name="l1")
  l2 = K.layers.Dense(3, activation="tanh", name="l2")
  model = K.Model(inp, l2(l1(inp)))
  x = _x()
  plan = gg.KerasPlan(model).replace_backward("l2", HalfThroughKernel())
  got = [g for g, _ in _grads(plan, model, x)]
  # By hand: l1 trains on 0.5 * delta W^T, delta the gradient at x @ W.
  with tf.GradientTape(persistent=True) as tape:
    h = l1(x)
    z = tf.matmul(h, l2.kernel)
    loss = tf.reduce_sum(tf.sin(tf.tanh(z + l2.bias)))
  delta = tape.gradient(loss, z)
  d_h = 0.5 * tf.matmul(delta, l2.kernel, transpose_b=True)
  want = (tape.gradient(h, [l1.kernel, l1.bias], output_gradients=d_h)
          + tape.gradient(loss, [l2.kernel, l2.bias]))
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


def test_the_context_vjp_stops_only_where_the_tape_recorded_nothing(K):
  model = _chain(K)
  plan = gg.KerasPlan(model).replace_backward(
      "l2", lambda ctx: ctx.vjp(ctx.outputs, ctx.inputs, ctx.upstream,
                                stop=ctx.outputs))
  with pytest.raises(gg.GraphGradError,
                     match=r"replace_backward\('l2'\): context.vjp\(stop="
                           r"\.\.\.\) got .*it can stop only at the "
                           r"context's inputs and at context.dense\(\).pre"):
    _grads(plan, model, _x())


@pytest.mark.parametrize("bad, match", [
    (lambda ctx: [], r"returned 0 gradients for 1 input tensors"),
    (lambda ctx: [tf.zeros([2])], r"returned a gradient of shape \(2,\)"),
    (lambda ctx: ctx.upstream_of("l1"),
     r"gradient at layer 'l1'.*needed before it is complete"),
])
def test_replacement_that_breaks_the_contract(bad, match):
  model = _chain(keras)
  plan = gg.KerasPlan(model).replace_backward("l2", bad)
  with pytest.raises(gg.GraphGradError, match=match):
    _grads(plan, model, _x())


# -- errors --------------------------------------------------------------------


def test_synthetic_labels_go_to_the_tape(K):
  with pytest.raises(gg.GraphGradError,
                     match=r"synthetic\(labels=...\) only exist inside.*"
                           r"plan.tape\(labels=y_onehot\)"):
    gg.KerasPlan(_chain(K)).replace_backward(
        "l2", gg.backward.synthetic(labels=tf.zeros([4, 3])))


def test_feedback_alignment_needs_a_dense_layer(K):
  inp = K.Input((4, 4, 1))
  conv = K.layers.Conv2D(2, 3, name="conv")
  model = K.Model(inp, K.layers.Dense(2)(K.layers.Flatten()(conv(inp))))
  with pytest.raises(gg.UnsupportedGraphError,
                     match=r"'conv' \(Conv2D\) must be a built Dense layer"):
    gg.KerasPlan(model).replace_backward(
        "conv", gg.backward.feedback_alignment(seed=0))


def test_feedback_alignment_needs_a_flat_input(K):
  inp = K.Input((3, 6))
  model = K.Model(inp, K.layers.Dense(2, name="d")(
      K.layers.Dense(6, name="below")(inp)))
  plan = gg.KerasPlan(model).replace_backward(
      "d", gg.backward.feedback_alignment(seed=0))
  with pytest.raises(gg.UnsupportedGraphError,
                     match=r"needs a \[batch, features\] input"):
    _grads(plan, model, tf.zeros([2, 3, 6]))


def test_dfa_needs_known_feature_sizes(K):
  model = _chain(K)
  plan = gg.KerasPlan(model).replace_backward(  # l1's input: [None, None]
      "l1", gg.backward.direct_feedback_alignment(seed=0))
  step = tf.function(lambda x: _grads(plan, model, x)[0][0],
                     input_signature=[tf.TensorSpec([None, None])])
  with pytest.raises(gg.UnsupportedGraphError,
                     match=r"needs a batch dimension followed by known"):
    step(_x())


def test_dfa_on_two_outputs_needs_the_error_layer(K):
  model = keras_cases.keras_model(keras_cases.TwoHeads, K)
  with pytest.raises(gg.GraphGradError,
                     match=r"`error_layer` is needed, because the model has 2"):
    gg.KerasPlan(model).replace_backward(
        "features", gg.backward.direct_feedback_alignment(seed=0))


def test_dfa_on_an_unbuilt_model_needs_the_error_layer(K):
  model = K.Sequential([K.layers.Dense(3, name="a"),
                        K.layers.Dense(2, name="b")])
  with pytest.raises(gg.GraphGradError,
                     match=r"`error_layer` is needed, because the model's "
                           r"layers hold no variables yet"):
    gg.KerasPlan(model).replace_backward(
        "a", gg.backward.direct_feedback_alignment(seed=0))
  gg.KerasPlan(model).replace_backward(  # named: fine before building
      "a", gg.backward.direct_feedback_alignment(seed=0, error_layer="b"))


def test_dfa_error_layer_with_two_outputs():
  class Pair(keras.layers.Layer):
    def call(self, x):
      return [x, 2.0 * x]

  inp = keras.Input((6,))
  h = keras.layers.Dense(4, name="h")(inp)
  a, b = Pair(name="pair")(keras.layers.Dense(3, name="top")(h))
  model = keras.Model(inp, keras.layers.Add()([a, b]))
  plan = gg.KerasPlan(model).replace_backward(
      "top", gg.backward.direct_feedback_alignment(seed=0, error_layer="pair"))
  with pytest.raises(gg.GraphGradError,
                     match=r"error layer 'pair' must have one floating-point"):
    _grads(plan, model, _x())


def test_task_losses_only_in_the_tape(K):
  with pytest.raises(gg.GraphGradError,
                     match=r"`losses` must be None here.*task_losses="):
    gg.KerasPlan(_chain(K)).project_conflicts("l2", [tf.ones([]), tf.ones([])])


def test_combine_tasks_needs_a_combine_method(K):
  with pytest.raises(gg.GraphGradError, match=r"with a combine\(grads\)"):
    gg.KerasPlan(_chain(K)).combine_tasks("l2", object())


def _task_step(plan, model, task_losses):
  with plan.tape() as tape:
    out = model(_x())
    la, lb = tf.reduce_sum(out), tf.reduce_sum(tf.square(out))
    loss = la + lb
  tl = task_losses(la, lb) if callable(task_losses) else task_losses
  return tape.gradient(loss, task_losses=tl)


@pytest.mark.parametrize("declare, task_losses, match", [
    (True, None, r"combines task gradients at 'l2'.*task_losses=\[loss_a"),
    (False, lambda a, b: [a, b], r"declares no task combination"),
    (True, lambda a, b: [a], r"at least two scalar task losses for layer 'l2'"),
    (True, lambda a, b: {"l3": [a, b]}, r"for layer 'l2'; got None"),
    (True, lambda a, b: [a, tf.reduce_sum(tf.ones([2]))],
     r"does not depend on `task_losses\[1\]`"),
])
def test_task_losses_errors(K, declare, task_losses, match):
  model = _chain(K)
  plan = gg.KerasPlan(model)
  if declare:
    plan.project_conflicts("l2", shuffle=False)
  with pytest.raises(gg.GraphGradError, match=match):
    _task_step(plan, model, task_losses)


@pytest.mark.parametrize("outside", ["loss", "task losses"])
@pytest.mark.parametrize("at", ["output", "parameters"])
def test_task_losses_computed_outside_the_tape(K, outside, at):
  # docs/multi-task.md's first draft summed the task losses after the tape.
  model = _chain(K)
  plan = gg.KerasPlan(model).combine_tasks(
      "l2" if at == "output" else None, gg.mtl.upgrad(), at=at)
  with plan.tape() as tape:
    out = model(_x())
    if outside == "loss":
      la, lb = tf.reduce_sum(out), tf.reduce_sum(tf.square(out))
  if outside == "task losses":
    la, lb = tf.reduce_sum(out), tf.reduce_sum(tf.square(out))
  got = [la, lb] if at == "output" else {"parameters": [la, lb]}
  with pytest.raises(gg.GraphGradError, match=(
      r"depends on none of `task_losses` as this tape recorded them; got 2 "
      r"task losses \(float32 \(\), float32 \(\)\)\. The loss, or the task "
      r"losses, were computed outside the tape: compute the task losses, "
      r"and the loss from them, inside `with plan.tape\(\) as tape:`")):
    tape.gradient(la + lb, task_losses=got)


def test_combine_tasks_with_a_user_method(K):
  # combine = the first task only: what lies below l2 sees g - g_b.
  class FirstTask:
    def combine(self, grads):
      return grads[0]

  model = _chain(K)
  plan = gg.KerasPlan(model).combine_tasks("l2", FirstTask())
  got = _task_step(plan, model, lambda a, b: [a, b])
  with tf.GradientTape() as tape:
    la = tf.reduce_sum(model(_x()))
  want = tape.gradient(la, model.trainable_variables)
  for a, b in zip(got[:4], want[:4]):  # l1, l2: only task a's gradient
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)
  assert not np.allclose(got[4], want[4])  # l3 sees both tasks


def test_plan_name_must_be_an_identifier(K):
  with pytest.raises(gg.GraphGradError, match=r"`name` must be a Python "
                                              r"identifier.*got 'my plan'"):
    gg.KerasPlan(_chain(K), name="my plan")


def test_optimizer_trains_the_modules_in_a_traced_step(K):
  # The optimizer sees the modules' variables on its first apply_gradients,
  # as it sees the model's; each module's zero output layer starts to move.
  model = _chain(K)
  plan = gg.KerasPlan(model).replace_backward(
      "l3", gg.backward.synthetic(hidden=(4,), seed=0))
  optimizer = K.optimizers.SGD(0.1)

  @tf.function
  def step(x):
    with plan.tape() as tape:
      loss = _loss(model, x)
    optimizer.apply_gradients(tape.grads_and_vars(loss))

  for seed in range(3):
    step(_x(seed=seed))
  last = plan.method_variables.by_key["synthetic/l3/0/kernel_1"]
  assert float(tf.reduce_max(tf.abs(last))) > 0
  assert int(optimizer.iterations) == 3


def test_tape_gradient_gives_the_modules_their_gradients(K):
  # tape.gradient(loss, plan.trainable_variables) covers the synthetic
  # module's variables (made on the first step): their gradient is the one
  # of loss_weight * ||M(h1) - dL/dh1||^2, here with M linear and zero.
  x = _x(rows=8, cols=6)
  model = K.Sequential([
      K.Input((6,)), K.layers.Dense(5, activation="tanh", name="l1"),
      K.layers.Dense(3, name="l2")])
  plan = gg.KerasPlan(model).replace_backward(
      "l2", gg.backward.synthetic(loss_weight=0.5, seed=0))
  _grads(plan, model, x)  # makes the module
  variables = list(plan.trainable_variables)
  with plan.tape() as tape:
    loss = _loss(model, x)
  got = dict(zip([v.name for v in variables],
                 tape.gradient(loss, variables)))
  kernel = plan.method_variables.by_key["synthetic/l2/0/kernel_0"]
  bias = plan.method_variables.by_key["synthetic/l2/0/bias_0"]
  assert len(variables) == len(model.trainable_variables) + 2
  with tf.GradientTape() as ref:
    h1 = model.get_layer("l1")(x)
    ref.watch(h1)
    loss = tf.reduce_sum(tf.sin(model.get_layer("l2")(h1)))
  target = ref.gradient(loss, h1).numpy()
  h1 = h1.numpy()
  # d/dK of 0.5 * ||h1 K + b - target||^2 at K = 0, b = 0.
  np.testing.assert_allclose(got[kernel.name], -h1.T @ target,
                             rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(got[bias.name], -target.sum(0),
                             rtol=RTOL, atol=ATOL)
  assert np.abs(target).max() > 0
