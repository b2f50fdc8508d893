"""Which optimizers GradientPlan.apply_gradients accepts, and what they do."""

import bert_optimization
import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from graphgrad.plan import _optimizer
from helpers import dense

# tf-keras and Keras 3 side by side: TensorFlow 2.16+ (2.15 bundles Keras 2).
tf_keras = pytest.importorskip("tf_keras")
keras = pytest.importorskip("keras")

tf1 = tf.compat.v1
LR = 0.125


def _net():
  x = tf.constant(np.random.default_rng(3).normal(size=(5, 4)), tf.float32)
  h = dense(x, 3, "l1", tf.nn.tanh)
  loss = tf.reduce_sum(tf.square(dense(h, 2, "l2")))
  return h, loss


def _plan_and_reference():
  """A plan halving l2's upstream, and the same gradients by tf.gradients."""
  h, loss = _net()
  variables = tf1.trainable_variables()
  l1, l2 = variables[:2], variables[2:]
  plan = gg.GradientPlan(loss).transform_upstream(
      "l2", gg.transforms.scale(0.5))
  g_h, = tf.gradients(loss, [h])
  ref = tf.gradients(h, l1, grad_ys=0.5 * g_h) + tf.gradients(loss, l2)
  return plan, variables, ref


def _step(train, variables, ref, step=None):
  with tf1.Session() as sess:
    sess.run(tf1.global_variables_initializer())
    w0, g = sess.run([variables, ref])
    sess.run(train)
    w1 = sess.run(variables)
    return w0, g, w1, (sess.run(step) if step is not None else None)


def _assert_sgd_step(w0, g, w1):
  for a, b, grad in zip(w0, w1, g):
    # LR is a power of two: lr * g is exact, so w0 - lr * g rounds once, in
    # TensorFlow as in numpy.
    np.testing.assert_array_equal(b, a - np.float32(LR) * grad)
    assert not np.array_equal(a, b)


@pytest.mark.parametrize("make", [
    lambda net: tf1.train.GradientDescentOptimizer(LR),
    lambda net: tf_keras.optimizers.legacy.SGD(LR),
    lambda net: tf_keras.optimizers.SGD(LR),
    lambda net: keras.optimizers.SGD(LR),
    lambda net: gg.AfterAggregation(tf_keras.optimizers.legacy.SGD(LR), net),
    lambda net: gg.AfterAggregation(keras.optimizers.SGD(LR), net),
], ids=["v1", "tf_keras_legacy", "tf_keras", "keras3",
        "after_aggregation_of_legacy", "after_aggregation_of_keras3"])
def test_accepted_optimizer_takes_the_sgd_step(graph, make):
  plan, variables, ref = _plan_and_reference()
  opt = make(plan.net)
  step = tf1.train.get_or_create_global_step()
  train = plan.apply_gradients(opt, global_step=step)
  assert isinstance(train, tf.Operation), type(train)
  w0, g, w1, n = _step(train, variables, ref, step)
  _assert_sgd_step(w0, g, w1)
  assert n == 1


@pytest.mark.parametrize("make", [
    lambda: tf_keras.optimizers.legacy.SGD(LR),
    lambda: tf_keras.optimizers.SGD(LR),
    lambda: keras.optimizers.SGD(LR),
], ids=["tf_keras_legacy", "tf_keras", "keras3"])
def test_keras_optimizer_without_global_step_returns_a_named_op(graph, make):
  plan, variables, ref = _plan_and_reference()
  train = plan.apply_gradients(make(), name="train")
  assert isinstance(train, tf.Operation)
  assert train.name.startswith("train"), train.name
  w0, g, w1, _ = _step(train, variables, ref)
  _assert_sgd_step(w0, g, w1)


@pytest.mark.parametrize("module", [tf_keras, keras],
                         ids=["tf_keras", "keras3"])
def test_keras_adam_takes_the_adam_step_once_per_run(graph, module):
  plan, variables, ref = _plan_and_reference()
  opt = module.optimizers.Adam(0.01)
  train = plan.apply_gradients(opt)
  with tf1.Session() as sess:
    sess.run(tf1.global_variables_initializer())
    w0, g = sess.run([variables, ref])
    sess.run(train)
    w1 = sess.run(variables)
    step = opt.iterations
    if not isinstance(step, tf.Variable):  # a Keras 3 variable
      step = step.value
    assert int(sess.run(step)) == 1
  # Keras Adam, step 1 (Kingma & Ba, with Keras' epsilon placement).
  b1, b2, eps = opt.beta_1, opt.beta_2, opt.epsilon
  for a, b, grad in zip(w0, w1, g):
    m, v = (1 - b1) * grad, (1 - b2) * np.square(grad.astype(np.float64))
    alpha = 0.01 * np.sqrt(1 - b2) / (1 - b1)
    np.testing.assert_allclose(b, a - alpha * m / (np.sqrt(v) + eps),
                               rtol=1e-5, atol=1e-6)


def test_an_object_with_apply_gradients_is_still_accepted(graph):
  class Wrapper:
    def __init__(self):
      self.inner = tf1.train.GradientDescentOptimizer(LR)

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
      return self.inner.apply_gradients(grads_and_vars, global_step, name)

  plan, variables, ref = _plan_and_reference()
  w0, g, w1, _ = _step(plan.apply_gradients(Wrapper()), variables, ref)
  _assert_sgd_step(w0, g, w1)


def test_the_silent_no_op_of_newer_keras_optimizers_exists():
  """Why they run in a tf.function: called directly, no weight changes."""
  with tf.Graph().as_default():
    w = tf1.get_variable("w", initializer=[1.0, 2.0])
    opt = tf_keras.optimizers.SGD(LR)
    op = opt.apply_gradients([(tf.constant([1.0, 1.0]), w)])
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      sess.run(op)
      np.testing.assert_array_equal(sess.run(w), [1.0, 2.0])


def test_an_optimizer_class_is_refused(graph):
  _, loss = _net()
  plan = gg.GradientPlan(loss)
  with pytest.raises(gg.GraphGradError,
                     match=r"`optimizer` must be an optimizer instance; got "
                     r"the class AdamOptimizer\. Create one: "
                     r"AdamOptimizer\(learning_rate=\.\.\.\)"):
    plan.apply_gradients(tf1.train.AdamOptimizer)
  for cls in (keras.optimizers.SGD, tf_keras.optimizers.legacy.SGD):
    with pytest.raises(gg.GraphGradError,
                       match=r"got the class SGD\. Create one: "
                       r"SGD\(learning_rate=\.\.\.\)"):
      plan.apply_gradients(cls)
  with pytest.raises(gg.GraphGradError, match=r"got the class SGD"):
    gg.AfterAggregation(keras.optimizers.SGD, gg.analyze(loss))


def test_plan_and_after_aggregation_share_one_check(graph):
  _, loss = _net()
  pattern = (r"`optimizer` must have an apply_gradients\(grads_and_vars, "
             r"global_step, name\) method.*got object\. Pass an optimizer "
             r"instance")
  with pytest.raises(gg.GraphGradError, match=pattern):
    gg.GradientPlan(loss).apply_gradients(object())
  with pytest.raises(gg.GraphGradError, match=pattern):
    gg.AfterAggregation(object(), gg.analyze(loss))
  assert _optimizer.check_optimizer(
      tf1.train.SyncReplicasOptimizer(tf1.train.AdamOptimizer(0.1), 2)) == "v1"
  assert _optimizer.check_optimizer(
      tf_keras.optimizers.legacy.Adam(0.1)) == "keras_v2"
  assert _optimizer.check_optimizer(keras.optimizers.Adam(0.1)) == "keras"


@pytest.mark.parametrize("module", [tf_keras, keras],
                         ids=["tf_keras", "keras3"])
def test_a_keras_optimizer_made_outside_the_graph_is_refused(module):
  opt = module.optimizers.SGD(LR)  # eagerly: its variables are eager
  with tf.Graph().as_default():
    _, loss = _net()
    with pytest.raises(gg.GraphGradError,
                       match=r"`optimizer` .*SGD could not update the "
                       r"variables in the tf.Graph of the gradients.*create "
                       r"the optimizer inside `with loss.graph.as_default"):
      gg.GradientPlan(loss).apply_gradients(opt)


@pytest.mark.parametrize("module", [tf_keras, keras],
                         ids=["tf_keras", "keras3"])
def test_keras_optimizer_keeps_sparse_gradients_correct(graph, module):
  with tf1.variable_scope("emb"):
    table = tf1.get_variable(
        "table", initializer=np.arange(8.0, dtype=np.float32).reshape(4, 2))
  loss = tf.reduce_sum(tf.nn.embedding_lookup(table, [0, 2, 2]))
  plan = gg.GradientPlan(loss).transform_gradients(
      "emb", gg.transforms.scale(0.5))
  assert isinstance(plan.compute_gradients()[0][0], tf.IndexedSlices)
  train = plan.apply_gradients(module.optimizers.SGD(LR))
  with tf1.Session() as sess:
    sess.run(tf1.global_variables_initializer())
    before = sess.run(table)
    sess.run(train)
    after = sess.run(table)
  grad = np.zeros((4, 2), np.float32)
  grad[0], grad[2] = 0.5, 1.0  # row 2 is looked up twice
  np.testing.assert_array_equal(after, before - np.float32(LR) * grad)


# -- wrappers that act in compute_gradients ---------------------------------

class _HorovodLike:
  """As horovod.tensorflow.DistributedOptimizer: a subclass of the wrapped
  optimizer's class, made at run time, whose compute_gradients all-reduces."""

  def __init__(self, optimizer):
    self._optimizer = optimizer

  def compute_gradients(self, *args, **kwargs):
    gv = self._optimizer.compute_gradients(*args, **kwargs)
    return [(g / 2.0 + g / 2.0, v) for g, v in gv]  # a two-replica mean

  def apply_gradients(self, *args, **kwargs):
    return self._optimizer.apply_gradients(*args, **kwargs)


def _horovod_like(optimizer):
  cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
             {k: v for k, v in vars(_HorovodLike).items()
              if k in ("compute_gradients", "apply_gradients")})
  wrapped = cls.__new__(cls)
  wrapped.__dict__.update(optimizer.__dict__)
  wrapped._optimizer = optimizer
  return wrapped


class PCGradLike(tf1.train.Optimizer):
  """As PCGrad_tf.py: projects the task gradients in compute_gradients."""

  def __init__(self, optimizer):
    super().__init__(use_locking=False, name="PCGrad")
    self._optimizer = optimizer

  def compute_gradients(self, loss, var_list=None, **kwargs):
    losses = loss if isinstance(loss, list) else [loss]
    per_task = [self._optimizer.compute_gradients(l, var_list)
                for l in losses]
    return per_task[0]

  def apply_gradients(self, grads_and_vars, global_step=None, name=None):
    return self._optimizer.apply_gradients(grads_and_vars, global_step, name)


class DPGradientDescentLike(tf1.train.GradientDescentOptimizer):
  """As tensorflow_privacy's DP optimizers: clip and noise in
  compute_gradients, plain apply_gradients."""

  def compute_gradients(self, loss, var_list=None, **kwargs):
    gv = super().compute_gradients(loss, var_list, **kwargs)
    return [(tf.clip_by_norm(g, 1.0) + tf.random.normal(tf.shape(g)), v)
            for g, v in gv]


class DuckWithComputeGradients:
  def compute_gradients(self, loss, var_list=None):
    return []

  def apply_gradients(self, grads_and_vars, global_step=None, name=None):
    return tf.no_op()


@pytest.mark.parametrize("make, cls, owner", [
    (lambda: _horovod_like(tf1.train.GradientDescentOptimizer(LR)),
     "GradientDescentOptimizer", "GradientDescentOptimizer"),
    (lambda: PCGradLike(tf1.train.AdamOptimizer(1e-3)), "PCGradLike",
     "PCGradLike"),
    (lambda: DPGradientDescentLike(LR), "DPGradientDescentLike",
     "DPGradientDescentLike"),
    (DuckWithComputeGradients, "DuckWithComputeGradients",
     "DuckWithComputeGradients"),
], ids=["horovod", "pcgrad", "dp", "duck"])
def test_a_wrapper_acting_in_compute_gradients_is_refused(graph, make, cls,
                                                          owner):
  _, loss = _net()
  plan = gg.GradientPlan(loss)
  with pytest.raises(
      gg.GraphGradError,
      match=rf"`optimizer` \S*\.{cls} overrides compute_gradients \(in "
      rf"{owner}\), which a plan never calls.*for an all-reduce \(Horovod's "
      r"DistributedOptimizer\), gg.GradientPlan\(loss, reduce_fn=\.\.\.\); "
      r"for a differential-privacy optimizer, plan\.privatize\(l2_norm_clip, "
      r"noise_multiplier\); for PCGrad, plan\.combine_tasks\(layers, losses, "
      r"gg\.mtl\.pcgrad\(\), at=\"parameters\"\)"):
    plan.apply_gradients(make())
  # Nothing was added to the tf.Graph's train ops: the refusal is up front.
  with pytest.raises(gg.GraphGradError, match="overrides compute_gradients"):
    gg.AfterAggregation(make(), plan.net)


def test_pass_through_wrappers_take_the_sgd_step(graph):
  """SyncReplicasOptimizer and AfterAggregation override compute_gradients
  too, but only hand the inner optimizer's gradients on."""
  plan, variables, ref = _plan_and_reference()
  inner = gg.AfterAggregation(tf1.train.GradientDescentOptimizer(LR),
                              plan.net)
  train = plan.apply_gradients(inner)
  w0, g, w1, _ = _step(train, variables, ref)
  _assert_sgd_step(w0, g, w1)
  step = tf1.train.get_or_create_global_step()
  sync = tf1.train.SyncReplicasOptimizer(
      tf1.train.GradientDescentOptimizer(LR), replicas_to_aggregate=1)
  plan.apply_gradients(sync, global_step=step)  # not refused


# -- the global step ----------------------------------------------------------

@pytest.mark.parametrize("make", [
    lambda: tf1.train.GradientDescentOptimizer(LR),
    lambda: tf1.train.AdamOptimizer(LR),
    lambda: bert_optimization.AdamWeightDecayOptimizer(LR),
    lambda: tf_keras.optimizers.legacy.SGD(LR),
    lambda: keras.optimizers.SGD(LR),
], ids=["v1", "adam", "bert", "tf_keras_legacy", "keras3"])
def test_global_step_advances_exactly_once_per_run(graph, make):
  plan, _, _ = _plan_and_reference()
  step = tf1.train.get_or_create_global_step()
  train = plan.apply_gradients(make(), global_step=step)
  with tf1.Session() as sess:
    sess.run(tf1.global_variables_initializer())
    counts = []
    for _ in range(3):
      sess.run(train)
      counts.append(int(sess.run(step)))
  assert counts == [1, 2, 3]


def test_bert_warmup_learning_rate_leaves_zero_and_weights_move(graph):
  """With BERT's warmup the first rate is 0: only an advancing step makes
  the second run move anything."""
  plan, variables, _ = _plan_and_reference()
  step = tf1.train.get_or_create_global_step()
  lr = bert_optimization.learning_rate(step, 0.1, num_train_steps=10,
                                       num_warmup_steps=2)
  train = plan.apply_gradients(
      bert_optimization.AdamWeightDecayOptimizer(lr), global_step=step)
  with tf1.Session() as sess:
    sess.run(tf1.global_variables_initializer())
    w0 = sess.run(variables)
    sess.run(train)  # step 0: lr 0
    w1 = sess.run(variables)
    sess.run(train)  # step 1: lr 0.05
    w2 = sess.run(variables)
  for a, b, c in zip(w0, w1, w2):
    np.testing.assert_array_equal(a, b)
    assert np.abs(c - b).max() > 1e-3


def test_writes_variable_reads_the_graph_not_a_run(graph):
  step = tf1.train.get_or_create_global_step()
  ref_step = tf1.Variable(0, use_resource=False, name="ref_step")
  g = tf1.get_default_graph()
  n = len(g.get_operations())
  tf1.assign_add(ref_step, 1)
  tf1.assign(step, step + 1)
  ops = g.get_operations()[n:]
  assert _optimizer.writes_variable(ops, step)
  assert _optimizer.writes_variable(ops, ref_step)
  assert not _optimizer.writes_variable(ops[:1], step)


@pytest.mark.parametrize("module", [tf_keras, keras],
                         ids=["tf_keras", "keras3"])
def test_keras_optimizer_from_another_graph_is_refused(module):
  """Made in the global graph after disable_eager_execution, or in any
  other tf.Graph: refused at apply_gradients, not by the session later."""
  with tf.Graph().as_default():
    opt = module.optimizers.SGD(LR)
  with tf.Graph().as_default() as graph:
    plan, _, _ = _plan_and_reference()
    before = len(graph.get_operations())
    with pytest.raises(gg.GraphGradError,
                       match=r"`optimizer` \S+\.SGD was created in another "
                       r"tf\.Graph than the loss's: its step counter \S+ "
                       r"lives there.*Create the optimizer inside `with "
                       r"loss\.graph\.as_default\(\):`"):
      plan.apply_gradients(opt)
    assert not [op for op in graph.get_operations()[before:]
                if op.type in ("PartitionedCall", "StatefulPartitionedCall")]
