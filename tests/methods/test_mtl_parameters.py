"""Task combination in parameter space: ``combine_tasks(..., at="parameters")``.

The reference for PCGrad is the PCGrad authors' TensorFlow optimizer
(``PCGrad_tf.py``), written here again from the paper's Algorithm 1: each
task's gradient of every variable, flattened into one vector; for each task
``i`` and every other task ``j`` in list order, ``g_i -= (g_i . g_j) /
||g_j||^2 g_j`` when ``g_i . g_j < 0`` (with the original ``g_j``); the sum.
The per-task gradients come from ``tf.gradients``, the projection and MGDA's
weights from numpy, and Adam applies the fed result.
"""

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from helpers import dense, evaluate

tf1 = tf.compat.v1
STYLES = ["scoped", "tf_variable", "get_variable"]
X = np.random.default_rng(7).normal(size=(8, 4)).astype(np.float32)
T = np.random.default_rng(8).normal(size=(8,)).astype(np.float32)


def np_pcgrad(gs):
  """Yu et al. (2020), Algorithm 1, the other tasks in list order."""
  out = []
  for i, g in enumerate(gs):
    g = g.copy()
    for j, other in enumerate(gs):
      if j == i:
        continue
      d = float(g @ other)
      if d < 0:
        g = g - d / float(other @ other) * other
    out.append(g)
  return np.sum(out, axis=0)


def np_mgda2(ga, gb):
  """Sener & Koltun's min-norm point of two gradients (closed form)."""
  w = np.clip((gb - ga) @ gb / ((ga - gb) @ (ga - gb)), 0.0, 1.0)
  return w * ga + (1 - w) * gb


class _Params:
  """Variables without scopes, from fixed numpy values."""

  def __init__(self, style):
    self.style, self.count = style, 0
    self.rng = np.random.default_rng(3)

  def __call__(self, *shape):
    value = (self.rng.normal(size=shape) / np.sqrt(shape[0])).astype(
        np.float32)
    self.count += 1
    if self.style == "tf_variable":
      return tf1.Variable(value)
    return tf1.get_variable(f"v{self.count}", initializer=value)


def _model(style):
  """x -> l0 (relu) -> l1 (relu) -> out (3 units); three task losses.

  The tasks pull the first output in opposite directions, so their
  gradients conflict.
  """
  x = tf.constant(X)
  if style == "scoped":
    h = dense(x, 6, "l0", tf.nn.relu)
    h = dense(h, 6, "l1", tf.nn.relu)
    y = dense(h, 3, "out")
  else:
    p = _Params(style)
    h = tf.nn.relu(tf.matmul(x, p(4, 6)) + p(6))
    h = tf.nn.relu(tf.matmul(h, p(6, 6)) + p(6))
    y = tf.matmul(h, p(6, 3)) + p(3)
  t = tf.constant(T)
  return [tf.reduce_mean(tf.square(y[:, 0] - t)),
          0.5 * tf.reduce_mean(tf.square(y[:, 0] + t + y[:, 1])),
          tf.reduce_mean(tf.square(y[:, 2] - y[:, 0]))]


def _flat(arrays):
  return np.concatenate([np.reshape(a, [-1]) for a in arrays])


def _split(flat, like):
  out, start = [], 0
  for a in like:
    out.append(flat[start:start + a.size].reshape(a.shape))
    start += a.size
  return out


class _Authors:
  """PCGrad_tf.py's optimizer, re-implemented: numpy projection, TF Adam."""

  def __init__(self, build, lr):
    self.graph = tf.Graph()
    with self.graph.as_default():
      losses = build()
      self.variables = tf1.trainable_variables()
      self.per_task = [
          [g if g is not None else tf.zeros_like(v)
           for g, v in zip(tf1.gradients(l, self.variables), self.variables)]
          for l in losses]
      self.fed = [tf1.placeholder(tf.float32, v.shape)
                  for v in self.variables]
      self.train = tf1.train.AdamOptimizer(lr).apply_gradients(
          list(zip(self.fed, self.variables)))
      self.sess = tf1.Session()
      self.sess.run(tf1.global_variables_initializer())

  def gradients(self):
    per_task = self.sess.run(self.per_task)
    flat = [_flat(gs) for gs in per_task]
    return _split(np_pcgrad(flat), per_task[0]), flat

  def step(self):
    grads, _ = self.gradients()
    self.sess.run(self.train, dict(zip(self.fed, grads)))

  def values(self):
    return self.sess.run(self.variables)


@pytest.mark.parametrize("every", ["none", "names"])
@pytest.mark.parametrize("style", STYLES)
def test_pcgrad_over_every_layer_is_the_authors_optimizer(style, every):
  ref = _Authors(lambda: _model(style), lr=0.05)
  _, flat = ref.gradients()
  dots = [flat[i] @ flat[j] for i in range(3) for j in range(i + 1, 3)]
  assert min(dots) < 0  # the tasks conflict, so PCGrad projects
  with tf.Graph().as_default():
    losses = _model(style)
    plan = gg.GradientPlan(tf.add_n(losses))
    layers = None if every == "none" else list(plan.net.names)
    assert every == "none" or len(layers) == 3
    plan.combine_tasks(layers, losses, gg.mtl.pcgrad(shuffle=False),
                       at="parameters")
    grads = [g for g, _ in plan.compute_gradients()]
    variables = [v for _, v in plan.compute_gradients()]
    assert [v.op.name for v in variables] == [
        v.op.name for v in ref.variables]
    train = plan.apply_gradients(tf1.train.AdamOptimizer(0.05))
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      for step in range(3):
        want, _ = ref.gradients()
        got = sess.run(grads)
        for g, w, v in zip(got, want, variables):
          np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5,
                                     err_msg=f"step {step} {v.op.name}")
        sess.run(train)
        ref.step()
        for g, w, v in zip(sess.run(variables), ref.values(), variables):
          np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5,
                                     err_msg=f"step {step} {v.op.name}")
      plain = sess.run(tf1.gradients(tf.add_n(losses), variables))
  # PCGrad moved the gradient away from plain backpropagation.
  assert np.abs(_flat(plain) - _flat(want)).max() > 1e-2


def _two_tasks(weights=(0.5, 2.0)):
  """l0 -> l1 -> {head_a, head_b}, conflicting tasks, a regulariser on l0."""
  x = tf.constant(X)
  h = dense(dense(x, 6, "l0", tf.nn.relu), 5, "l1", tf.nn.relu)
  ya, yb = dense(h, 1, "head_a")[:, 0], dense(h, 1, "head_b")[:, 0]
  la = tf.reduce_mean(tf.square(ya - T))
  lb = tf.reduce_mean(tf.square(yb + 2.0 * ya + T))
  reg = 0.01 * tf.add_n([tf.reduce_sum(tf.square(v))
                         for v in tf1.trainable_variables("l0/")])
  return weights[0] * la + weights[1] * lb + reg, [la, lb]


@pytest.mark.parametrize("name, np_combine", [
    ("pcgrad", lambda a, b: np_pcgrad([a, b])), ("mgda", np_mgda2)])
def test_the_combination_replaces_the_task_shares_of_the_layers(
    graph, name, np_combine):
  loss, (la, lb) = _two_tasks()
  method = getattr(gg.mtl, name)()
  plan = gg.GradientPlan(loss).combine_tasks(["l0", "l1"], [la, lb], method,
                                             at="parameters")
  gv = plan.compute_gradients()
  variables = [v for _, v in gv]
  trunk = [v for v in variables if v.op.name.startswith(("l0/", "l1/"))]
  assert len(trunk) == 4
  got, plain, ga, gb = evaluate([
      [g for g, _ in gv], tf1.gradients(loss, variables),
      tf1.gradients(0.5 * la, trunk), tf1.gradients(2.0 * lb, trunk)])
  a, b = _flat(ga), _flat(gb)
  assert a @ b < 0
  combined = _split(np_combine(a, b), ga)
  by_name = dict(zip([v.op.name for v in variables], got))
  for v, g_plain in zip(variables, plain):
    if v in trunk:
      k = trunk.index(v)
      # The regulariser and the weights pass; the tasks' shares are combined.
      want = g_plain - ga[k] - gb[k] + combined[k]
      assert not np.allclose(want, g_plain, atol=1e-4)
    else:  # the heads keep the plain gradient
      want = g_plain
    np.testing.assert_allclose(by_name[v.op.name], want, rtol=1e-5,
                               atol=1e-6, err_msg=v.op.name)


METHODS = {
    "pcgrad": gg.mtl.pcgrad, "mgda": gg.mtl.mgda, "cagrad": gg.mtl.cagrad,
    "imtl_g": gg.mtl.imtl_g, "aligned_mtl": gg.mtl.aligned_mtl,
    "upgrad": gg.mtl.upgrad, "dualproj": gg.mtl.dualproj,
    "nash_mtl": gg.mtl.nash_mtl, "gradvac": gg.mtl.gradvac,
    "graddrop": lambda: gg.mtl.graddrop(seed=1), "config": gg.mtl.config,
    "mean": gg.mtl.mean, "sum": gg.mtl.sum,
}


def test_every_mtl_method_is_listed():
  assert sorted(METHODS) == sorted(
      n for n in gg.mtl.__all__ if n not in ("MethodState", "TaskMethod"))


@pytest.mark.parametrize("at", ["output", "parameters"])
@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_method_works_at_both_levels(graph, name, at):
  loss, losses = _two_tasks()
  layers = "l1" if at == "output" else None
  plan = gg.GradientPlan(loss).combine_tasks(layers, losses, METHODS[name](),
                                             at=at)
  gv = plan.compute_gradients()
  got, plain = evaluate([[g for g, _ in gv],
                         tf1.gradients(loss, [v for _, v in gv])])
  for g, p in zip(got, plain):
    assert g.shape == p.shape and np.isfinite(g).all(), name
  # Every method but the plain sum changes the trunk's gradient.
  changed = not np.allclose(got[0], plain[0], rtol=1e-5, atol=1e-6)
  assert changed == (name != "sum"), name


def test_parameter_transforms_act_after_the_combination(graph):
  loss, losses = _two_tasks()
  alone = gg.GradientPlan(loss).combine_tasks(None, losses, gg.mtl.pcgrad(),
                                              at="parameters")
  both = gg.GradientPlan(loss).combine_tasks(
      None, losses, gg.mtl.pcgrad(), at="parameters").transform_gradients(
          "l1", gg.transforms.scale(0.5))
  names = [v.op.name for _, v in alone.compute_gradients()]
  a, b = evaluate([[g for g, _ in alone.compute_gradients()],
                   [g for g, _ in both.compute_gradients()]])
  for name, ga, gb in zip(names, a, b):
    factor = 0.5 if name.startswith("l1/") else 1.0
    np.testing.assert_allclose(gb, factor * ga, rtol=1e-6, err_msg=name)


def test_reduce_fn_reduces_each_task_before_the_combination(graph):
  loss, losses = _two_tasks()
  # A linear reduction: the sum over two replicas that saw the same batch.
  plan = gg.GradientPlan(loss, reduce_fn=lambda gv: [2.0 * g for g, _ in gv])
  plan.combine_tasks(None, losses, gg.mtl.mgda(), at="parameters")
  local = gg.GradientPlan(loss).combine_tasks(None, losses, gg.mtl.mgda(),
                                              at="parameters")
  got, want = evaluate([[g for g, _ in plan.compute_gradients()],
                        [g for g, _ in local.compute_gradients()]])
  # MGDA's weights do not change when every gradient doubles.
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, 2.0 * w, rtol=1e-5, atol=1e-6)


def test_combine_tasks_refuses_bad_arguments(graph):
  loss, losses = _two_tasks()
  plan = gg.GradientPlan(loss)
  pc = gg.mtl.pcgrad()
  with pytest.raises(gg.GraphGradError,
                     match=r"^combine_tasks: `at` must be one of 'output', "
                           r"'parameters'; got 'params'\. Pass at='output'"):
    plan.combine_tasks("l1", losses, pc, at="params")
  with pytest.raises(gg.GraphGradError,
                     match=r"with at='output' `layers` must be one layer.*"
                           r"got \['l0', 'l1'\]\..*at='parameters'"):
    plan.combine_tasks(["l0", "l1"], losses, pc)
  with pytest.raises(gg.GraphGradError,
                     match=r"`layers` must name at least one layer; got an "
                           r"empty list"):
    plan.combine_tasks([], losses, pc, at="parameters")
  with pytest.raises(gg.GraphGradError,
                     match=r"`layers` names 'l1' more than once"):
    plan.combine_tasks(["l1", "l1"], losses, pc, at="parameters")
  with pytest.raises(gg.LayerNotFoundError, match=r"nope"):
    plan.combine_tasks(["l1", "nope"], losses, pc, at="parameters")
  with pytest.raises(gg.GraphGradError, match=r"`method` must be a task-"):
    plan.combine_tasks(None, losses, lambda g: g[0], at="parameters")
  assert plan.declarations.parameter_tasks is None  # nothing left behind
  plan.combine_tasks("l1", losses, pc, at="parameters")
  with pytest.raises(gg.GraphGradError,
                     match=r"already combines task gradients in parameter "
                           r"space, over \['l1'\] with pcgrad\(.*\); declare "
                           r"it once, with every layer"):
    plan.combine_tasks("l0", losses, gg.mtl.mgda(), at="parameters")
  # A layer none of whose variables the plan differentiates.
  only_l1 = gg.GradientPlan(loss, var_list=tf1.trainable_variables("l1/"))
  with pytest.raises(gg.GraphGradError,
                     match=r"layer\(s\) 'l0' hold no variable this plan "
                           r"differentiates \(its var_list\)"):
    only_l1.combine_tasks(["l0", "l1"], losses, pc, at="parameters")


def test_a_loss_scale_optimizer_refuses_a_non_homogeneous_parameter_level(
    graph):
  loss, losses = _two_tasks()
  plan = gg.GradientPlan(loss).combine_tasks(
      None, losses, gg.mtl.nash_mtl(), at="parameters")
  opt = tf1.mixed_precision.MixedPrecisionLossScaleOptimizer(
      tf1.train.GradientDescentOptimizer(0.1), loss_scale=8.0)
  with pytest.raises(gg.GraphGradError,
                     match=r"combine_tasks\(at='parameters', nash_mtl.*\) "
                           r"compute\(s\) gradients whose result does not "
                           r"scale"):
    plan.apply_gradients(opt)


def test_backward_rewrites_act_on_the_plans_gradient_only(graph):
  # The task gradients are plain backpropagation; an upstream rewrite above
  # the combined layer acts on the plan's gradient G, as at the outputs.
  loss, (la, lb) = _two_tasks(weights=(1.0, 1.0))
  reg = loss - la - lb
  plan = gg.GradientPlan(loss).transform_upstream(
      "l1", gg.transforms.scale(0.5)).combine_tasks(
          "l0", [la, lb], gg.mtl.pcgrad(), at="parameters")
  gv = plan.compute_gradients()
  l0 = tf1.trainable_variables("l0/")
  got, through, by_reg, ga, gb = evaluate([
      [g for g, v in gv if v in l0], tf1.gradients(la + lb, l0),
      tf1.gradients(reg, l0), tf1.gradients(la, l0), tf1.gradients(lb, l0)])
  combined = _split(np_pcgrad([_flat(ga), _flat(gb)]), ga)
  assert _flat(ga) @ _flat(gb) < 0
  for k in range(len(l0)):
    big_g = 0.5 * through[k] + by_reg[k]
    np.testing.assert_allclose(got[k], big_g - ga[k] - gb[k] + combined[k],
                               rtol=1e-5, atol=1e-6)


def _heads():
  """docs/multi-task.md's two task losses on a shared trunk, no scopes."""
  x = tf.constant(X)
  h = tf.nn.relu(tf.matmul(x, tf1.get_variable(
      "w", initializer=np.random.default_rng(5).normal(
          size=(4, 6)).astype(np.float32))))
  ya = tf.matmul(h, tf1.get_variable("wa", initializer=np.ones(
      (6, 1), np.float32)))[:, 0]
  yb = tf.matmul(h, tf1.get_variable("wb", initializer=np.full(
      (6, 1), 0.5, np.float32)))[:, 0]
  return [tf.reduce_mean(tf.square(ya - T)),
          tf.reduce_mean(tf.square(yb)) - 2.0 * tf.reduce_mean(ya)]


def test_the_migration_from_pcgrad_tf_py():
  ref = _Authors(_heads, lr=0.05)
  with tf.Graph().as_default():
    loss_a, loss_b = _heads()
    var_list = tf1.trainable_variables()
    # docs/multi-task.md, "From PCGrad_tf.py" (learning rate 0.05 here):
    plan = gg.GradientPlan(loss_a + loss_b, var_list=var_list)
    plan.combine_tasks(None, [loss_a, loss_b], gg.mtl.pcgrad(),
                       at="parameters")
    train_op = plan.apply_gradients(tf1.train.AdamOptimizer(0.05))
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      _, (a, b) = ref.gradients()
      assert a @ b < 0
      for step in range(3):
        sess.run(train_op)
        ref.step()
        for got, want, v in zip(sess.run(var_list), ref.values(), var_list):
          np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6,
                                     err_msg=f"step {step} {v.op.name}")
      plain = sess.run(tf1.gradients(loss_a + loss_b, var_list))
  assert np.abs(_flat(plain) - _flat(ref.gradients()[0])).max() > 1e-2


def test_sparse_task_gradients_are_combined_densely(graph):
  table = tf1.get_variable("emb", initializer=np.arange(
      12, dtype=np.float32).reshape(6, 2))
  rows = tf.nn.embedding_lookup(table, tf.constant([0, 2, 2]))
  la = tf.reduce_sum(rows[:, 0])
  lb = -0.5 * tf.reduce_sum(rows)
  plan = gg.GradientPlan(la + lb).combine_tasks(None, [la, lb],
                                                gg.mtl.pcgrad(),
                                                at="parameters")
  (g, _), = plan.compute_gradients()
  assert isinstance(g, tf.Tensor)  # IndexedSlices made dense
  ga, gb = evaluate([tf.convert_to_tensor(tf1.gradients(la, table)[0]),
                     tf.convert_to_tensor(tf1.gradients(lb, table)[0])])
  assert (ga * gb).sum() < 0
  want = np_pcgrad([ga.ravel(), gb.ravel()]).reshape(6, 2)
  np.testing.assert_allclose(evaluate(g), want, rtol=1e-6)


def _matmuls_added(build):
  """MatMul ops ``build(la, lb)`` adds to _two_tasks' tf.Graph."""
  with tf.Graph().as_default() as g:
    loss, (la, lb) = _two_tasks(weights=(1.0, 1.0))
    before = len(g.get_operations())
    build(loss, la, lb)
    return sum(op.type == "MatMul" for op in g.get_operations()[before:])


def test_without_other_rewrites_it_backpropagates_as_the_authors_do():
  # k task passes to every variable and a pass over the regulariser only:
  # no pass of the summed loss through the layers on top.
  def authors(loss, la, lb):
    for l in (la, lb):
      tf1.gradients(l, tf1.trainable_variables())

  def plan(loss, la, lb):
    gg.GradientPlan(loss).combine_tasks(
        None, [la, lb], gg.mtl.pcgrad(), at="parameters").compute_gradients()

  def with_rewrite(loss, la, lb):
    gg.GradientPlan(loss).transform_upstream(
        "l1", gg.transforms.clip_by_value(-1.0, 1.0)).combine_tasks(
            None, [la, lb], gg.mtl.pcgrad(),
            at="parameters").compute_gradients()

  def summed(loss, la, lb):
    tf1.gradients(loss, tf1.trainable_variables())
  assert _matmuls_added(plan) == _matmuls_added(authors)
  # With a backward rewrite the plan's own pass comes on top.
  assert _matmuls_added(with_rewrite) > _matmuls_added(authors) + (
      _matmuls_added(summed) // 2)
