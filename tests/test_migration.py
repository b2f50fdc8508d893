"""The migration guide (docs/migration.md): each idiom against its declaration.

Every test builds the original idiom and the graphgrad declaration from the
same weights and compares the gradients (or the updated weights). tf-slim is
in the test extra and runs for real. tensorpack 0.11 is not: where it is
installed its gradprocs run for real; its ``CheckGradient`` calls
``tf.check_numerics``, which TensorFlow 2.21 no longer has, so that row is
compared with a faithful hand-written copy of it. Sonnet's ``scale_gradient``
and PyTorch's backward pre-hook are hand-written in TensorFlow with
``tf.custom_gradient``.
"""

import functools
import importlib.util
import pathlib
import sys

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from helpers import (
  assert_grads_close,
  bert_like,
  dense,
  evaluate,
  grads_of,
  trainable,
)

tf1 = tf.compat.v1
HAS_TENSORPACK = importlib.util.find_spec("tensorpack") is not None
BAD = np.array([[1.0, np.nan, 0.0, 2.0]], np.float32)  # every gradient NaN


def _chain():
  """x -> l1 (relu) -> l2 (relu) -> l3 -> loss; returns loss and outputs."""
  x = tf.constant(np.random.default_rng(0).normal(size=(6, 4)), tf.float32)
  a1 = dense(x, 5, "l1")
  a2 = dense(tf.nn.relu(a1), 5, "l2")
  a3 = dense(tf.nn.relu(a2), 2, "l3")
  return tf.reduce_sum(tf.square(a3)), (a1, a2, a3)


# -- the seed's hand recipe -------------------------------------------------

def test_hand_recipe_is_a_plan():
  f = gg.transforms.scale(0.3)
  with tf.Graph().as_default():
    x = tf.constant(np.random.default_rng(1).normal(size=(8, 10)), tf.float32)
    l1 = dense(x, 20, "l1_dense", tf.nn.relu)
    l2 = dense(l1, 2, "l2_dense")
    loss = tf.reduce_mean(tf.square(l2))
    # The seed's recipe: l2's own gradients, then f(g) pushed through l2.
    g = tf.gradients(loss, l2)[0]
    hand = (tf.gradients(l2, trainable("l1_dense"), grad_ys=f(g))
            + tf.gradients(loss, trainable("l2_dense")))
    plan = gg.GradientPlan(loss).transform_upstream("l2_dense", f)
    assert_grads_close(*evaluate([grads_of(plan), hand]))


# -- gradient_override_map on an activation ---------------------------------

@tf.RegisterGradient("GraphgradMigrationGuidedRelu")
def _guided_relu(op, grad):
  return tf.where(grad > 0, grad, tf.zeros_like(grad)) * tf.cast(
      op.outputs[0] > 0, grad.dtype)


def test_gradient_override_map_is_an_edge_transform():
  with tf.Graph().as_default() as graph:
    loss_plain, (a1, _, _) = _chain()
    # Guided backprop through the ReLU between l1 and l2.
    x = tf.constant(np.random.default_rng(0).normal(size=(6, 4)), tf.float32)
    with tf1.variable_scope("guided"):
      b1 = dense(x, 5, "l1")
      override = {"Relu": "GraphgradMigrationGuidedRelu"}
      with graph.gradient_override_map(override):
        h = tf.nn.relu(b1)
      b2 = dense(h, 5, "l2")
      b3 = dense(tf.nn.relu(b2), 2, "l3")
    guided = tf.gradients(tf.reduce_sum(tf.square(b3)), trainable("guided/l1"))
    # The gradient at l1's output is relu'(a1) * dy; guided keeps it where
    # dy > 0, which is relu() of it.
    plan = gg.GradientPlan(loss_plain).transform_edge("l1", "l2", tf.nn.relu)
    ours = [g for g, v in plan.compute_gradients()
            if v.op.name.startswith("l1/")]
    assert_grads_close(*evaluate([ours, guided]))
    del a1


# -- tf.custom_gradient gradient reversal -----------------------------------

def _grl(lam):
  @tf.custom_gradient
  def reverse(x):
    return tf.identity(x), lambda dy: -lam * dy
  return reverse


def _two_heads(grl=None):
  x = tf.constant(np.random.default_rng(2).normal(size=(6, 4)), tf.float32)
  f = dense(x, 5, "features", tf.nn.relu)
  label = dense(f, 3, "label_head")
  domain = dense(grl(f) if grl else f, 2, "domain_head")
  return tf.reduce_sum(tf.square(label)) + tf.reduce_sum(tf.square(domain))


def test_custom_gradient_reversal_is_an_edge_reverse():
  with tf.Graph().as_default():
    hand = tf.gradients(_two_heads(_grl(0.3)), tf1.trainable_variables())
    hand = evaluate(hand)
  with tf.Graph().as_default():
    plan = gg.GradientPlan(_two_heads()).transform_edge(
        "features", "domain_head", gg.transforms.reverse(0.3))
    assert_grads_close(evaluate(grads_of(plan)), hand)


# -- tensorpack gradprocs ----------------------------------------------------

def _tensorpack_equivalents(gv):
  """Hand-written copies of tensorpack 0.11's gradprocs."""
  scale = [(g * 0.1 if v.op.name.startswith("l1/") else g, v) for g, v in gv]
  mapped = [(2.0 * g if v.op.name.startswith("l2/") else g, v) for g, v in gv]
  clipped, _ = tf.clip_by_global_norm([g for g, _ in gv], 1.0)
  return scale, mapped, list(zip(clipped, [v for _, v in gv]))


def _tensorpack(gv):
  from tensorpack.tfutils import gradproc  # pylint: disable=g-import-not-at-top
  return (gradproc.ScaleGradient([("l1/.*", 0.1)], verbose=False).process(gv),
          gradproc.MapGradient(lambda g: 2.0 * g, "l2/.*").process(gv),
          gradproc.GlobalNormClip(1.0).process(gv))


@pytest.mark.parametrize("source", [
    "hand-written",
    pytest.param("tensorpack", marks=pytest.mark.skipif(
        not HAS_TENSORPACK, reason="tensorpack is not installed"))])
def test_tensorpack_gradprocs(source):
  with tf.Graph().as_default():
    loss, _ = _chain()
    gv = tf1.train.GradientDescentOptimizer(0.1).compute_gradients(loss)
    refs = (_tensorpack if source == "tensorpack" else
            _tensorpack_equivalents)(gv)
    net = gg.analyze(loss)
    scale = gg.GradientPlan(loss, net).transform_gradients(
        "l1", gg.transforms.scale(0.1))
    mapped = gg.GradientPlan(loss, net).transform_gradients(
        "l2", lambda g: 2.0 * g)
    # GlobalNormClip clips over every variable: one group declaration.
    plan = gg.GradientPlan(loss, net)
    clipped = plan.transform_gradients(
        plan.layer_names, gg.transforms.clip_by_global_norm(1.0))
    ours = [grads_of(scale), grads_of(mapped), grads_of(clipped)]
    got, want = evaluate([ours, [[g for g, _ in r] for r in refs]])
  for a, b in zip(got, want):
    assert_grads_close(a, b)


def _check_gradient(gv):
  """tensorpack 0.11's CheckGradient, calling tf.debugging.check_numerics."""
  return [(tf.debugging.check_numerics(g, "CheckGradient/" + v.op.name), v)
          for g, v in gv]


def test_check_gradient_is_check_numerics():
  with tf.Graph().as_default():
    x = tf1.placeholder(tf.float32, [None, 4])
    h = dense(x, 3, "l1")
    loss = tf.reduce_sum(tf.square(dense(h, 1, "l2")))
    theirs = _check_gradient(tf1.train.GradientDescentOptimizer(
        0.1).compute_gradients(loss))
    plan = gg.GradientPlan(loss)
    for name in ("l1", "l2"):
      plan.transform_gradients(name, gg.transforms.check_numerics())
    ours = grads_of(plan)
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      good = {x: np.full((2, 4), 0.3, np.float32)}
      assert_grads_close(sess.run(ours, good),
                         sess.run([g for g, _ in theirs], good))
      with pytest.raises(tf.errors.InvalidArgumentError,
                         match="non-finite gradient at layer l.*variable l"):
        sess.run(ours, {x: BAD})
      with pytest.raises(tf.errors.InvalidArgumentError,
                         match="CheckGradient/l"):
        sess.run([g for g, _ in theirs], {x: BAD})


def test_check_numerics_on_an_upstream_names_the_tensor():
  with tf.Graph().as_default():
    x = tf1.placeholder(tf.float32, [None, 4])
    h = dense(x, 3, "l1")
    loss = tf.reduce_sum(tf.square(dense(h, 1, "l2")))
    plan = gg.GradientPlan(loss).transform_upstream(
        "l2", gg.transforms.check_numerics("after the head"))
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      with pytest.raises(tf.errors.InvalidArgumentError,
                         match=r"layer l2, upstream, tensor l2/BiasAdd:0 "
                               r"\(after the head\)"):
        sess.run(grads_of(plan), {x: BAD})
  with pytest.raises(gg.GraphGradError, match="`message` must be a string"):
    gg.transforms.check_numerics(3)


# -- optax apply_if_finite ---------------------------------------------------

def test_apply_if_finite_skips_the_whole_update():
  with tf.Graph().as_default():
    x = tf1.placeholder(tf.float32, [None, 4])
    loss = tf.reduce_sum(tf.square(dense(dense(x, 3, "l1"), 1, "l2")))
    step = tf1.train.get_or_create_global_step()
    inner = tf1.train.AdamOptimizer(0.1)
    train = gg.GradientPlan(loss).apply_gradients(
        gg.transforms.apply_if_finite(inner), global_step=step)
    # The reference: Adam's update on the same gradients, run by hand.
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      everything = tf1.global_variables()
      before = sess.run(everything)
      sess.run(train, {x: BAD})   # NaN
      for a, b in zip(sess.run(everything), before):
        np.testing.assert_array_equal(a, b)                       # untouched
      good = {x: np.full((2, 4), 0.3, np.float32)}
      grads = sess.run(tf.gradients(loss, tf1.trainable_variables()), good)
      sess.run(train, good)
      assert sess.run(step) == 1
      # Adam's first step moves each weight by lr * sign(g) (to ~1e-7).
      for v, w0, g in zip(tf1.trainable_variables(), before, grads):
        np.testing.assert_allclose(sess.run(v), w0 - 0.1 * np.sign(g),
                                   atol=1e-5)
  with pytest.raises(gg.GraphGradError, match="must have an apply_gradients"):
    gg.transforms.apply_if_finite("adam")


# -- tf-slim create_train_op -------------------------------------------------

def _one_step(make_train_op):
  with tf.Graph().as_default():
    loss, _ = _chain()
    train = make_train_op(loss, tf1.train.GradientDescentOptimizer(0.1))
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      sess.run(train)
      return sess.run(tf1.trainable_variables())


def test_tf_slim_create_train_op(monkeypatch):
  # The test extra installs tf-slim; tools/test_oldest_tf.sh does not.
  learning = pytest.importorskip("tf_slim.learning")

  # tf-slim 1.1.0 reads ops.Tensor and ops.IndexedSlices, which TensorFlow
  # 2.21 moved; give them back for this test so that slim's own code runs.
  monkeypatch.setattr(learning.ops, "Tensor", tf.Tensor, raising=False)
  monkeypatch.setattr(learning.ops, "IndexedSlices", tf.IndexedSlices,
                      raising=False)
  create_train_op = learning.create_train_op

  def slim(loss, opt):
    return create_train_op(
        loss, opt, clip_gradient_norm=1.0,
        gradient_multipliers={v: 0.5 for v in trainable("l1")})

  def plan(loss, opt):
    p = gg.GradientPlan(loss).transform_gradients(
        "l1", gg.transforms.scale(0.5))
    for name in ("l1", "l2", "l3"):
      p.transform_gradients(name, gg.transforms.clip_by_norm(1.0))
    return p.apply_gradients(opt)

  assert_grads_close(_one_step(plan), _one_step(slim))


# -- Sonnet scale_gradient ---------------------------------------------------

def _scale_gradient(x, scale):
  """Sonnet v1's scale_gradient: identity forward, ``scale * dy`` backward."""
  @tf.custom_gradient
  def op(t):
    return tf.identity(t), lambda dy: scale * dy
  return op(x)


def test_sonnet_scale_gradient_is_an_edge_scale():
  with tf.Graph().as_default():
    x = tf.constant(np.random.default_rng(3).normal(size=(6, 4)), tf.float32)
    h = dense(x, 5, "l1", tf.nn.relu)
    loss = tf.reduce_sum(tf.square(dense(_scale_gradient(h, 0.25), 2, "l2")))
    hand = evaluate(tf.gradients(loss, tf1.trainable_variables()))
  with tf.Graph().as_default():
    x = tf.constant(np.random.default_rng(3).normal(size=(6, 4)), tf.float32)
    h = dense(x, 5, "l1", tf.nn.relu)
    loss = tf.reduce_sum(tf.square(dense(h, 2, "l2")))
    plan = gg.GradientPlan(loss).transform_edge("l1", "l2",
                                                gg.transforms.scale(0.25))
    assert_grads_close(evaluate(grads_of(plan)), hand)


# -- Keras clipnorm, and PyTorch's backward pre-hook (TF2) -------------------

def _keras_model(hook=None):
  keras = tf.keras
  inputs = keras.Input((4,))
  h = keras.layers.Dense(5, activation="relu", name="d1",
                         kernel_initializer=keras.initializers.GlorotUniform(1))(inputs)
  h = keras.layers.Dense(5, activation="relu", name="d2",
                         kernel_initializer=keras.initializers.GlorotUniform(2))(h)
  if hook is not None:
    h = keras.layers.Lambda(hook, name="hook")(h)
  out = keras.layers.Dense(2, name="d3",
                           kernel_initializer=keras.initializers.GlorotUniform(3))(h)
  return keras.Model(inputs, out)


def _data():
  rng = np.random.default_rng(4)
  return (tf.constant(rng.normal(size=(8, 4)), tf.float32),
          tf.constant(rng.normal(size=(8, 2)), tf.float32))


def test_keras_clipnorm_is_clip_by_norm_on_every_layer():
  x, y = _data()
  clipped = _keras_model()
  opt = tf.keras.optimizers.SGD(0.5, clipnorm=0.05)
  with tf.GradientTape() as tape:
    loss = tf.reduce_sum(tf.square(clipped(x) - y))
  opt.apply_gradients(zip(tape.gradient(loss, clipped.trainable_variables),
                          clipped.trainable_variables))
  model = _keras_model()
  plan = gg.KerasPlan(model)
  for name in ("d1", "d2", "d3"):
    plan.transform_gradients(name, gg.transforms.clip_by_norm(0.05))
  with plan.tape() as tape:
    loss = tf.reduce_sum(tf.square(model(x) - y))
  tf.keras.optimizers.SGD(0.5).apply_gradients(
      zip(tape.gradient(loss), model.trainable_variables))
  assert_grads_close([v.numpy() for v in model.trainable_variables],
                     [v.numpy() for v in clipped.trainable_variables])


def _pre_hook(fn):
  """What register_full_backward_pre_hook(lambda m, g: (fn(g),)) does on d2."""
  @tf.custom_gradient
  def hooked(t):
    return tf.identity(t), fn
  return hooked


def test_pytorch_backward_pre_hook_is_an_edge_transform():
  x, y = _data()
  clip = gg.transforms.clip_by_norm(0.1)
  # The hook rewrites the gradient at d2's output before d2's own backward:
  # d2's parameters and everything below see fn(g). The Lambda sits after
  # d2's activation, so the activation runs inside "d2" in both models.
  hooked = _keras_model(hook=_pre_hook(lambda g: clip(g)))
  with tf.GradientTape() as tape:
    loss = tf.reduce_sum(tf.square(hooked(x) - y))
  want = tape.gradient(loss, hooked.trainable_variables)
  model = _keras_model()
  plan = gg.KerasPlan(model).transform_edge("d2", "d3", clip)
  with plan.tape() as tape:
    loss = tf.reduce_sum(tf.square(model(x) - y))
  assert_grads_close([g.numpy() for g in tape.gradient(loss)],
                     [g.numpy() for g in want])


# -- the worked example: gradient_override_map flip_gradient -> a plan --------

@functools.lru_cache(maxsize=None)  # it registers FlipGradient0 once
def _example():
  path = pathlib.Path(__file__).resolve().parent.parent / "examples" / (
      "gradient_reversal_migration.py")
  spec = importlib.util.spec_from_file_location("grl_migration", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_worked_example_trains_step_for_step_like_flip_gradient():
  example = _example()
  history = example.train_side_by_side(steps=5)
  assert len(history) == 5
  for diff, original, migrated in history:
    assert diff < 1e-6
    np.testing.assert_allclose(migrated, original, rtol=1e-6)
  assert history[-1][1] != history[0][1]  # it trained
  # The guide shows the example's own code.
  guide = (pathlib.Path(__file__).resolve().parent.parent / "docs" /
           "migration.md").read_text()
  for part in ("flip_gradient", "model", "original", "migrated"):
    assert f'--8<-- "examples/gradient_reversal_migration.py:{part}"' in guide


# -- BERT's optimization.py ---------------------------------------------------

def _migration_example(heading):
  """The first python code block after ``heading`` in docs/migration.md."""
  text = pathlib.Path(__file__).parents[1].joinpath(
      "docs", "migration.md").read_text()
  section = text[text.index(heading):]
  start = section.index("```python\n") + len("```python\n")
  return section[start:section.index("```", start)]


def test_bert_create_optimizer_with_layerwise_decay(monkeypatch):
  """The guide's BERT example, run as written, against BERT's own
  create_optimizer with the layer-wise scales written in by hand: three
  steps, weights and global step."""
  import bert_optimization
  monkeypatch.setitem(sys.modules, "optimization", bert_optimization)
  num_layers, init_lr, num_train_steps, steps = 2, 0.05, 10, 3
  with tf.Graph().as_default():
    loss = bert_like(num_layers)
    scope = {"tf": tf, "loss": loss, "init_lr": init_lr,
             "num_train_steps": num_train_steps, "num_layers": num_layers}
    exec(_migration_example("## From BERT's optimization.py"), scope)
    ours = _train(scope["train_op"], scope["global_step"], steps)
    assert [n for n in scope["plan"].layer_names if "encoder" in n] == [
        "bert/encoder/layer_0/attention/output/dense",
        "bert/encoder/layer_0/output/dense",
        "bert/encoder/layer_1/attention/output/dense",
        "bert/encoder/layer_1/output/dense"]
  with tf.Graph().as_default():
    loss = bert_like(num_layers)
    global_step = tf1.train.get_or_create_global_step()
    lr = tf1.train.polynomial_decay(init_lr, global_step, num_train_steps,
                                    end_learning_rate=0.0, power=1.0)
    optimizer = bert_optimization.AdamWeightDecayOptimizer(
        learning_rate=lr, weight_decay_rate=0.01, beta_1=0.9, beta_2=0.999,
        epsilon=1e-6, exclude_from_weight_decay=["LayerNorm", "layer_norm",
                                                 "bias"])
    tvars = tf1.trainable_variables()
    grads = tf.gradients(loss, tvars)
    factors = [0.9 ** (num_layers - 1 - int(v.name.split("/")[2][6:]))
               if v.name.startswith("bert/encoder/") else 1.0 for v in tvars]
    grads = [g if f == 1.0 else f * g for f, g in zip(factors, grads)]
    assert sorted(set(factors)) == [0.9, 1.0]
    (grads, _) = tf.clip_by_global_norm(grads, clip_norm=1.0)
    train_op = optimizer.apply_gradients(zip(grads, tvars),
                                         global_step=global_step)
    train_op = tf.group(train_op, [global_step.assign(global_step + 1)])
    theirs = _train(train_op, global_step, steps)
  assert ours[0] == theirs[0] == steps
  for name, w in theirs[1].items():
    np.testing.assert_allclose(ours[1][name], w, rtol=1e-5, atol=1e-7,
                               err_msg=name)


def _train(train_op, global_step, steps):
  with tf1.Session() as sess:
    sess.run(tf1.global_variables_initializer())
    w0 = sess.run(tf1.trainable_variables())
    for _ in range(steps):
      sess.run(train_op)
    w = sess.run({v.op.name: v for v in tf1.trainable_variables()})
    step = int(sess.run(global_step))
  # Every weight moved: the step advanced, so the learning rate did too.
  assert all(np.abs(a - b).max() > 0 for a, b in zip(w0, w.values()))
  return step, w
