"""KerasPlan.recompute(keep): the gradients of the plan without recompute.

References: the same plan without recompute, a plain ``tf.GradientTape``,
and, for dropout, the gradient computed by hand from the forward's own mask.
Each comparison restores the weights and state between the two runs and
runs the same step function, eagerly or traced.
"""

import logging

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from graphgrad.keras import _tape_recompute
from keras_cases import normal_rows

MODES = ["eager", "function"]


def _mlp(K, depth=6, bn_at=2, width=8):
  init = K.initializers.RandomNormal(stddev=0.5, seed=1)
  inp = K.Input((width,))
  h = inp
  for i in range(depth):
    h = K.layers.Dense(width, activation="tanh", name=f"d{i}",
                       kernel_initializer=init)(h)
    if i == bn_at:
      h = K.layers.BatchNormalization(name="bn", momentum=0.5)(h)
  return K.Model(inp, K.layers.Dense(2, name="out", kernel_initializer=init)(h))


def _unit(K, x, name, width):
  """A bottleneck unit: three convolutions with batch norm, plus the skip."""
  h = x
  for j, (f, k) in enumerate(((width // 2, 1), (width // 2, 3), (width, 1))):
    h = K.layers.Conv2D(f, k, padding="same", name=f"{name}_c{j}")(h)
    h = K.layers.BatchNormalization(name=f"{name}_bn{j}")(h)
    if j < 2:
      h = K.layers.Activation("relu", name=f"{name}_r{j}")(h)
  return K.layers.Activation("relu", name=f"{name}_out")(
      K.layers.Add(name=f"{name}_add")([x, h]))


def _resnet(K, units=3, width=8):
  inp = K.Input((6, 6, 3))
  h = K.layers.Conv2D(width, 3, padding="same", name="stem")(inp)
  for u in range(units):
    h = _unit(K, h, f"u{u}", width)
  h = K.layers.GlobalAveragePooling2D(name="pool")(h)
  return K.Model(inp, K.layers.Dense(2, name="head")(h))


def _step(plan, model, x, mode):
  def step():
    with plan.tape() as tape:
      loss = tf.reduce_sum(tf.square(model(x, training=True)))
    return tape.gradient(loss)
  return step() if mode == "eager" else tf.function(step)()


def _run_both(model, x, mode, declare=lambda p: p, keep=None):
  """Gradients and variables after one step, without and with recompute."""
  start = [v.numpy() for v in model.variables]
  out = []
  for recompute in (False, True):
    for v, s in zip(model.variables, start):
      v.assign(s)
    plan = declare(gg.KerasPlan(model))
    if recompute:
      plan = plan.recompute(keep)
    grads = [g.numpy() for g in _step(plan, model, x, mode)]
    out.append((grads, [v.numpy() for v in model.variables]))
  return out


def _assert_equal_grads(want, got):
  scale = max(float(np.abs(g).max()) for g in want)
  for a, b in zip(want, got):
    np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6 * scale)


@pytest.mark.parametrize("mode", MODES)
def test_mlp_with_batch_norm_equals_the_plan_without_recompute(K, mode):
  model = _mlp(K)
  x = normal_rows(0, (16, 8))
  (g0, v0), (g1, v1) = _run_both(model, x, mode)
  _assert_equal_grads(g0, g1)
  # batch norm's statistics moved once, as without recompute
  for a, b in zip(v0, v1):
    np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)
  moving = [v.numpy() for v in model.get_layer("bn").non_trainable_variables]
  assert not np.allclose(moving[0], 0.0)


@pytest.mark.parametrize("mode", MODES)
def test_resnet_units_equal_a_plain_gradient_tape(K, mode):
  model = _resnet(K)
  x = normal_rows(1, (4, 6, 6, 3))
  start = [v.numpy() for v in model.variables]
  (g0, v0), (g1, v1) = _run_both(model, x, mode,
                                 keep=["u0_out", "u1_out"])
  _assert_equal_grads(g0, g1)
  for v, s in zip(model.variables, start):
    v.assign(s)

  def plain():
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(tf.square(model(x, training=True)))
    return tape.gradient(loss, model.trainable_variables)

  want = plain() if mode == "eager" else tf.function(plain)()
  _assert_equal_grads([g.numpy() for g in want], g1)
  moved = [v.numpy() for v in model.variables]
  for a, b in zip(moved, v1):  # the plain tape's batch-norm statistics
    np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)


def test_composes_with_a_declaration_on_another_layer(K):
  model = _mlp(K)
  x = normal_rows(2, (16, 8))
  clip = gg.transforms.clip_by_norm(0.1)
  (g0, _), (g1, _) = _run_both(
      model, x, "function",
      declare=lambda p: p.transform_upstream("d4", clip))
  _assert_equal_grads(g0, g1)


_ON_RECOMPUTED = {
    "upstream": lambda p: p.transform_upstream(
        "d4", gg.transforms.clip_by_norm(0.1)),
    "linear_upstream": lambda p: p.transform_upstream(
        "d1", gg.transforms.scale(0.5)),
    "feedback_alignment": lambda p: p.transform_upstream(
        "d3", lambda g: 3.0 * g - 0.05 * tf.sign(g)).replace_backward(
            "d3", gg.backward.feedback_alignment(seed=3)),
    "override": lambda p: p.override_gradient(
        "d2", lambda call, g: 0.5 * g),
}


@pytest.mark.parametrize("decl", sorted(_ON_RECOMPUTED))
@pytest.mark.parametrize("mode", MODES)
def test_a_rewritten_layer_is_recomputed_with_its_declaration(
    K, mode, decl, monkeypatch):
  model = _mlp(K)
  x = normal_rows(6, (16, 8))
  replayed = []
  replay = _tape_recompute.Recomputer._replay

  def spy(self, block, dys):
    replayed.extend(c.path for c in self.calls if c.block == block)
    return replay(self, block, dys)

  monkeypatch.setattr(_tape_recompute.Recomputer, "_replay", spy)
  (g0, v0), (g1, v1) = _run_both(model, x, mode,
                                 declare=_ON_RECOMPUTED[decl], keep=["d1"])
  _assert_equal_grads(g0, g1)
  for a, b in zip(v0, v1):
    np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)
  plain = _run_both(model, x, mode, keep=["d1"])[0][0]
  assert any(not np.allclose(a, b) for a, b in zip(g0, plain))
  if mode == "function":  # replayed, its declaration applied to the replay
    layer = {"upstream": "d4", "linear_upstream": "d1",
             "feedback_alignment": "d3", "override": "d2"}[decl]
    assert layer in replayed, replayed


def test_call_that_gathers_from_a_variable_is_replayed(K):
  """A variable gather (ResourceGather) reads, as ReadVariableOp does: the
  call holding one is replayed, not kept whole."""
  table = tf.Variable(normal_rows(9, (4, 8)), trainable=False)

  class Gathered(K.layers.Layer):
    def call(self, x):
      return x * tf.raw_ops.ResourceGather(
          resource=table.handle, indices=[0, 2, 0, 1], dtype=tf.float32)[2]

  init = K.initializers.RandomNormal(stddev=0.5, seed=2)
  inp = K.Input((8,))
  h = K.layers.Dense(8, activation="tanh", name="d0",
                     kernel_initializer=init)(inp)
  h = Gathered(name="gathered")(h)
  h = K.layers.Dense(8, activation="tanh", name="d1",
                     kernel_initializer=init)(h)
  model = K.Model(inp, K.layers.Dense(1, name="out",
                                      kernel_initializer=init)(h))
  plan = gg.KerasPlan(model).recompute(keep=["d1"])
  x = normal_rows(3, (4, 8))
  step = tf.function(lambda: _step(plan, model, x, "eager"))
  grads = step()
  with tf.GradientTape() as tape:
    loss = tf.reduce_sum(tf.square(model(x, training=True)))
  _assert_equal_grads(
      [g.numpy() for g in tape.gradient(loss, model.trainable_variables)],
      [g.numpy() for g in grads])
  gathers = [op.name for op in step.get_concrete_function().graph
             .get_operations() if op.type == "ResourceGather"]
  assert any("/recompute" in n for n in gathers), gathers


@pytest.mark.parametrize("mode", MODES)
def test_dropout_mask_is_the_forwards(K, mode):
  init = K.initializers.RandomNormal(stddev=0.5, seed=4)
  inp = K.Input((8,))
  h = K.layers.Dense(8, activation="tanh", name="d0",
                     kernel_initializer=init)(inp)
  dropped = K.layers.Dropout(0.5, name="drop", seed=7)(h)
  h2 = K.layers.Dense(8, activation="tanh", name="d1",
                      kernel_initializer=init)(dropped)
  out = K.layers.Dense(1, name="out", kernel_initializer=init)(h2)
  model = K.Model(inp, [h, dropped, out])
  plan = gg.KerasPlan(model).recompute(keep=["d1"])
  x = normal_rows(3, (32, 8))

  def step():
    with plan.tape() as tape:
      pre, post, y = model(x, training=True)
      loss = tf.reduce_sum(tf.square(y))
    return pre, post, tape.gradient(loss)

  pre, post, grads = step() if mode == "eager" else tf.function(step)()
  keep = (post.numpy() != 0).astype(np.float32)
  assert 0 < keep.mean() < 1
  # The reference: the same network with the forward's mask as a constant.
  layers = [model.get_layer(n) for n in ("d0", "d1", "out")]
  with tf.GradientTape() as tape:
    a = layers[0](x)
    b = layers[1](a * keep / 0.5)
    loss = tf.reduce_sum(tf.square(layers[2](b)))
  want = tape.gradient(loss, model.trainable_variables)
  _assert_equal_grads([w.numpy() for w in want], [g.numpy() for g in grads])


def test_keep_none_keeps_calls_no_skip_connection_jumps_over(K, monkeypatch):
  model = _resnet(K, units=4)
  plan = gg.KerasPlan(model).recompute()
  seen = {}
  choose = _tape_recompute.choose_kept

  def spy(calls):
    kept = choose(calls)
    seen["paths"] = [calls[i].path for i in sorted(kept)]
    seen["calls"] = [c.path for c in calls]
    return kept

  monkeypatch.setattr(_tape_recompute, "choose_kept", spy)
  _step(plan, model, normal_rows(4, (2, 6, 6, 3)), "function")
  assert seen["paths"]
  # Only the end of a unit (its sum or its output) or the stem: a cut
  # inside a unit would keep the skip connection's input as well.
  assert all(p == "stem" or p.endswith(("_add", "_out"))
             for p in seen["paths"]), seen["paths"]
  assert len(seen["paths"]) < len(seen["calls"]) // 2


@pytest.mark.parametrize("widths,want", [
    ([64, 64, 32, 32, 16, 16, 8, 8, 4, 4, 2], [[4, 64], [4, 32]]),
    ([2, 4, 8, 16, 32, 64, 128, 256, 512], [[4, 256]]),
], ids=["narrowing", "widening"])
def test_keep_none_choice(K, widths, want):
  inp = K.Input((widths[0],))
  h = inp
  for i, w in enumerate(widths[1:]):
    h = K.layers.Dense(w, activation="tanh", name=f"d{i}")(h)
  model = K.Model(inp, h)
  plan = gg.KerasPlan(model).recompute()
  _step(plan, model, normal_rows(4, (4, widths[0])), "function")
  assert [t.shape.as_list() for t in plan.kept_tensors()] == want


def test_eager_step_logs_that_it_keeps_activations(K, caplog):
  model = _mlp(K, depth=2)
  plan = gg.KerasPlan(model).recompute()
  with caplog.at_level(logging.INFO, logger="graphgrad"):
    _step(plan, model, normal_rows(5, (4, 8)), "eager")
    _step(plan, model, normal_rows(5, (4, 8)), "eager")
  assert caplog.text.count("recompute saves memory only in a traced step") == 1


def test_bad_keep_is_refused(K):
  model = _resnet(K, units=1)
  plan = gg.KerasPlan(model)
  with pytest.raises(gg.GraphGradError,
                     match=r"`keep` must be a list of layers .* got str"):
    plan.recompute("u0_out")
  with pytest.raises(gg.LayerNotFoundError, match="no layer named 'nope'"):
    plan.recompute(["nope"])
  with pytest.raises(gg.GraphGradError, match="a tape of this plan was"):
    with plan.tape():
      pass
    plan.recompute()


def test_nested_layer_in_keep_is_refused(K):
  inner = K.Sequential([K.layers.Dense(3, name="inner_dense")], name="block")
  inp = K.Input((3,))
  model = K.Model(inp, K.layers.Dense(1, name="top")(inner(inp)))
  with pytest.raises(gg.GraphGradError,
                     match=r"must name top-level layers .* block/inner_dense"):
    gg.KerasPlan(model).recompute(["inner_dense"])


@pytest.mark.parametrize("jit", [False, True], ids=["default", "jit"])
def test_fit_with_recompute_equals_fit_without(K, jit):
  """attach() + fit: weights and moving statistics of the same plan."""
  x = normal_rows(6, (32, 8)).numpy()
  y = normal_rows(7, (32, 2)).numpy()
  weights = []
  for recompute in (False, True):
    model = _mlp(K)
    plan = gg.KerasPlan(model).transform_upstream(
        "d4", gg.transforms.clip_by_norm(0.5))
    if recompute:
      plan.recompute(keep=["d1", "bn"])
    plan.attach()
    model.compile(K.optimizers.SGD(0.05), loss="mse", jit_compile=jit)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    weights.append(model.get_weights())
  for a, b in zip(*weights):
    np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6)
  start = _mlp(K).get_weights()
  assert max(float(np.abs(a - b).max())
             for a, b in zip(weights[1], start)) > 1e-3
