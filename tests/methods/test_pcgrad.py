"""PCGrad (project_conflicts) against numpy, on constructed conflicts."""

import itertools

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from graphgrad.core._task_combination import combine_flat
from graphgrad.methods import _pcgrad
from helpers import dense, evaluate

tf1 = tf.compat.v1


def np_pcgrad(gs, orders=None):
  """Yu et al.'s Algorithm 1; orders[i] lists the other tasks in order."""
  out = []
  for i, g in enumerate(gs):
    g = g.copy()
    for j in (orders[i] if orders else [j for j in range(len(gs)) if j != i]):
      d = (g * gs[j]).sum()
      if d < 0:
        g = g - d / (gs[j]**2).sum() * gs[j]
    out.append(g)
  return sum(out)


def _conflict(rng, shape=(4, 3)):
  """Two task gradients with a negative dot product."""
  a = rng.normal(size=shape)
  b = -0.7 * a + 0.5 * rng.normal(size=shape)
  assert (a * b).sum() < 0
  return a.astype(np.float32), b.astype(np.float32)


def test_two_task_projection_formula_and_defining_property(graph, rng):
  a, b = _conflict(rng)
  like = [tf.zeros_like(a)]
  out = evaluate(_pcgrad.project([[tf.constant(a)], [tf.constant(b)]], like))[0]
  pa = a - (a * b).sum() / (b * b).sum() * b
  pb = b - (a * b).sum() / (a * a).sum() * a
  np.testing.assert_allclose(out, pa + pb, rtol=1e-5, atol=1e-6)
  assert (out * a).sum() >= 0 and (out * b).sum() >= 0
  assert ((a + b) * a).sum() < 0 or ((a + b) * b).sum() < 0  # the plain sum
  # No conflict: plain sum.
  out = evaluate(_pcgrad.project([[tf.constant(a)], [tf.constant(a + 1)]],
                                 like))[0]
  np.testing.assert_allclose(out, 2 * a + 1, rtol=1e-6)


def test_three_tasks_use_a_fresh_random_order(graph, rng):
  gs = [rng.normal(size=5).astype(np.float32) for _ in range(3)]
  gs[1] = -gs[0] + 0.3 * gs[1]
  gs[2] = -gs[0] - 0.5 * gs[1] + 0.3 * gs[2]
  like = [tf.zeros([5])]
  per = [[tf.constant(g)] for g in gs]
  shuffled = _pcgrad.project(per, like, shuffle=True)[0]
  fixed = _pcgrad.project(per, like, shuffle=False)[0]
  combos = {}
  for orders in itertools.product(*[itertools.permutations(
      [j for j in range(3) if j != i]) for i in range(3)]):
    combos[orders] = np_pcgrad(gs, orders)
  distinct = {tuple(np.round(v, 4)) for v in combos.values()}
  assert len(distinct) > 1  # the order matters for these gradients
  with tf1.Session() as sess:
    np.testing.assert_allclose(sess.run(fixed), np_pcgrad(gs), rtol=1e-5)
    seen = set()
    for _ in range(40):
      value = sess.run(shuffled)
      match = [o for o, v in combos.items() if np.allclose(v, value,
                                                           atol=1e-5)]
      assert match, value  # always one of the orders
      seen.add(tuple(np.round(value, 4)))
  assert len(seen) > 1  # the shuffle is used, not discarded


def _two_task_net(rng, weights=(1.0, 1.0), extra=0.0, third=False):
  """base -> trunk -> {loss_a, loss_b} with conflicting gradients at h."""
  x = tf.constant(rng.normal(size=(4, 3)), tf.float32)
  base = tf.nn.relu(dense(x, 5, "base"))
  h = dense(base, 3, "trunk")
  ca, cb = _conflict(rng)
  loss_a = tf.reduce_sum(h * ca, name="loss_a")
  loss_b = tf.reduce_sum(h * cb + 0.0 * h * h, name="loss_b")
  loss = weights[0] * loss_a + weights[1] * loss_b
  if extra:
    loss += extra * tf.reduce_sum(h)
  reg = 0.01 * tf.add_n([tf.reduce_sum(v**2)
                         for v in tf1.trainable_variables("base/")])
  loss += reg
  losses = [loss_a, loss_b]
  if third:  # a task loss that does not reach the trunk
    loss_c = tf.reduce_sum(tf.square(base), name="loss_c")
    loss += loss_c
    losses.append(loss_c)
  return loss, losses, h, (weights[0] * ca, weights[1] * cb), base


@pytest.mark.parametrize("weights, extra, third", [
    ((1.0, 1.0), 0.0, False),
    ((0.5, 2.0), 0.3, False),   # weighted tasks, an unlisted term at h
    ((1.0, 1.0), 0.0, True),    # a listed loss with None gradient at h
])
def test_plan_projects_at_the_shared_layer(graph, rng, weights, extra, third):
  loss, losses, h, (ga, gb), base = _two_task_net(rng, weights, extra, third)
  plan = gg.GradientPlan(loss).project_conflicts("trunk", losses)
  gv = plan.compute_gradients()
  pc = ga - (ga * gb).sum() / (gb * gb).sum() * gb
  pc += gb - (ga * gb).sum() / (ga * ga).sum() * ga
  at_h = pc + extra
  assert (pc * ga).sum() >= 0 and (pc * gb).sum() >= 0
  trunk = tf1.trainable_variables("trunk/")
  base_vars = tf1.trainable_variables("base/")
  ref_trunk = tf1.gradients(h, trunk, grad_ys=tf.constant(at_h))
  # base: through the trunk with the projected gradient, plus what bypasses
  # it (the regulariser, and loss_c when listed).
  ref_base = tf1.gradients(h, base_vars, grad_ys=tf.constant(at_h))
  bypass = tf1.gradients(loss, base_vars, stop_gradients=[h])
  got, rt, rb, bp = evaluate([[g for g, _ in gv], ref_trunk, ref_base, bypass])
  names = [v.op.name for _, v in gv]
  for i, v in enumerate(names):
    if v.startswith("trunk/"):
      want = rt[[t.op.name for t in trunk].index(v)]
      np.testing.assert_allclose(got[i], want, rtol=1e-4, atol=1e-5)
    else:
      k = [b.op.name for b in base_vars].index(v)
      np.testing.assert_allclose(got[i], rb[k] + bp[k], rtol=1e-4, atol=1e-5)


def test_a_loss_that_reaches_one_of_two_outputs(graph, rng):
  x = tf.constant(rng.normal(size=(2, 3)), tf.float32)
  with tf1.variable_scope("trunk"):
    w = tf1.get_variable("w", initializer=tf.ones([3, 2]))
    h1, h2 = tf.matmul(x, w), tf.matmul(x, 2 * w)
  c1, c2 = _conflict(rng, (2, 2))
  d = rng.normal(size=(2, 2)).astype(np.float32)
  loss_a = tf.reduce_sum(h1 * c1)              # reaches h1 only
  loss_b = tf.reduce_sum(h1 * c2 + h2 * d)
  gv = gg.GradientPlan(loss_a + loss_b).project_conflicts(
      "trunk", [loss_a, loss_b]).compute_gradients()
  ga = np.concatenate([c1, np.zeros_like(d)], 1)
  gb = np.concatenate([c2, d], 1)
  pc = np_pcgrad([ga, gb]) if (ga * gb).sum() < 0 else ga + gb
  ref = tf1.gradients([h1, h2], [w], grad_ys=[tf.constant(pc[:, :2]),
                                              tf.constant(pc[:, 2:])])
  got, ref = evaluate([gv[0][0], ref[0]])
  np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)


def test_project_conflicts_errors(graph, rng):
  loss, losses, _, _, _ = _two_task_net(rng)
  plan = gg.GradientPlan(loss)
  with pytest.raises(gg.GraphGradError, match=r"`losses` must be a list"):
    plan.project_conflicts("trunk", losses[0])
  with pytest.raises(gg.GraphGradError, match=r"at least two losses"):
    plan.project_conflicts("trunk", losses[:1])
  with pytest.raises(gg.GraphGradError,
                     match=r"`losses\[1\]` must be a floating-point scalar"):
    plan.project_conflicts("trunk", [losses[0], tf.ones([2])])
  other = tf.constant(1.0) * 3.0
  with pytest.raises(gg.NotConnectedError,
                     match=r"does not depend on `losses\[1\]`"):
    plan.project_conflicts("trunk", [losses[0], other])
  with pytest.raises(gg.GraphGradError, match=r"lists a tensor twice"):
    plan.project_conflicts("trunk", [losses[0], losses[0]])
  with pytest.raises(gg.GraphGradError,
                     match=r"depends on loss_a:0.*not partial sums"):
    plan.project_conflicts("trunk", [losses[0], loss])
  plan.project_conflicts("trunk", losses)
  with pytest.raises(
      gg.GraphGradError, match=r"already combines task gradients"):
    plan.project_conflicts("trunk", losses)


class _Mean:
  """A task-combination method of one's own: the mean of the gradients."""

  def combine(self, grads):
    return tf.add_n(grads) / len(grads)


def test_combine_tasks_rewrites_g_minus_the_shares_plus_the_combination(
    graph, rng):
  loss, losses, h, (ga, gb), base = _two_task_net(rng, (0.5, 2.0), 0.3)
  gv = gg.GradientPlan(loss).combine_tasks("trunk", losses, _Mean())
  gv = gv.compute_gradients()
  at_h = (ga + gb) / 2 + 0.3  # the unlisted term passes unchanged
  trunk = tf1.trainable_variables("trunk/")
  ref = tf1.gradients(h, trunk, grad_ys=tf.constant(at_h))
  got, ref = evaluate([[g for g, v in gv if v.op.name.startswith("trunk/")],
                       ref])
  for a, r in zip(got, ref):
    np.testing.assert_allclose(a, r, rtol=1e-4, atol=1e-5)


def test_project_conflicts_is_combine_tasks_with_pcgrad(graph, rng):
  loss, losses, _, _, _ = _two_task_net(rng, third=True)
  a = gg.GradientPlan(loss).project_conflicts("trunk", losses, shuffle=False)
  b = gg.GradientPlan(loss).combine_tasks(
      "trunk", losses, _pcgrad.pcgrad(shuffle=False))
  assert repr(a.declarations.tasks["trunk"].method) == (
      "pcgrad(shuffle=False, seed=None)")
  ga, gb = evaluate([[g for g, _ in p.compute_gradients()] for p in (a, b)])
  for x, y in zip(ga, gb):
    np.testing.assert_array_equal(x, y)


def test_several_tensors_are_combined_as_one_concatenated_vector(graph, rng):
  # combine_flat: dot products over every tensor; zeros where a task does
  # not reach one; None where no task does.
  c1, c2 = _conflict(rng)
  d = rng.normal(size=(2, 2)).astype(np.float32)
  per = [[tf.constant(c1), None, None], [tf.constant(c2), tf.constant(d), None]]
  like = [tf.zeros(c1.shape), tf.zeros(d.shape), tf.zeros([5])]
  combined = combine_flat(_pcgrad.pcgrad(shuffle=False), per, like)
  assert combined[2] is None
  flat = [np.concatenate([c1.ravel(), np.zeros(4, np.float32)]),
          np.concatenate([c2.ravel(), d.ravel()])]
  want = np_pcgrad(flat)
  got = evaluate(combined[:2])
  np.testing.assert_allclose(got[0], want[:12].reshape(c1.shape), rtol=1e-5)
  np.testing.assert_allclose(got[1], want[12:].reshape(d.shape), rtol=1e-5)
  ref = evaluate(_pcgrad.project(per, like, shuffle=False)[:2])
  for x, y in zip(got, ref):
    np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)


def test_gg_mtl_pcgrad_is_the_plans_pcgrad():
  assert gg.mtl.pcgrad is _pcgrad.pcgrad
  assert isinstance(gg.mtl.pcgrad(), gg.mtl.TaskMethod)
  assert repr(gg.mtl.pcgrad(False, 3)) == "pcgrad(shuffle=False, seed=3)"


def test_pcgrad_takes_the_tasks_in_list_order_by_default(graph, rng):
  # As the authors' PCGrad_tf.py, whose tf.random.shuffle result is unused.
  assert repr(gg.mtl.pcgrad()) == "pcgrad(shuffle=False, seed=None)"
  loss, losses, _, _, _ = _two_task_net(rng)
  plan = gg.GradientPlan(loss).project_conflicts("trunk", losses)
  assert repr(plan.declarations.tasks["trunk"].method) == (
      "pcgrad(shuffle=False, seed=None)")
  gs = [rng.normal(size=5).astype(np.float32) for _ in range(3)]
  gs[1] = -gs[0] + 0.3 * gs[1]
  gs[2] = -gs[0] - 0.5 * gs[1] + 0.3 * gs[2]
  out = gg.mtl.pcgrad().combine([tf.constant(g) for g in gs])
  with tf1.Session() as sess:
    for _ in range(5):  # the same order at every run
      np.testing.assert_allclose(sess.run(out), np_pcgrad(gs), rtol=1e-5)


def test_combine_tasks_errors(graph, rng):
  loss, losses, _, _, _ = _two_task_net(rng)
  plan = gg.GradientPlan(loss)
  with pytest.raises(gg.GraphGradError,
                     match=r"`method` must be a task-combination method"):
    plan.combine_tasks("trunk", losses, lambda grads: grads[0])
  with pytest.raises(gg.GraphGradError, match=r"^combine_tasks: `losses\[1\]`"):
    plan.combine_tasks("trunk", [losses[0], tf.ones([2])], _Mean())
  assert not plan.declarations.tasks  # refused declarations leave nothing

  class _Short:
    def combine(self, grads):
      return grads[0][:1]
  plan.combine_tasks("trunk", losses, _Short())
  with pytest.raises(gg.IncompatibleGradientError,
                     match=r"combine returned a tensor of shape \(1, 3\) "
                           r"float32 for task gradients of shape \(4, 3\)"):
    plan.compute_gradients()


class _Momentum:
  """A stateful method of one's own: the mean, smoothed across steps."""

  def __init__(self):
    self.made = []

  def create_state(self, k, name=None):
    self.made.append(k)
    return tf.Module(name=name)

  def combine(self, grads, state=None):
    assert isinstance(state, tf.Module)
    if not hasattr(state, "avg"):
      state.avg = tf1.Variable(tf.zeros_like(grads[0]), trainable=False)
    mean = tf.add_n(grads) / len(grads)
    return state.avg.assign(0.5 * state.avg + 0.5 * mean)


def test_a_stateful_method_of_ones_own_gets_its_state_once(graph, rng):
  loss, losses, h, (ga, gb), base = _two_task_net(rng, (0.5, 2.0), 0.3)
  method = _Momentum()
  gv = gg.GradientPlan(loss).combine_tasks(
      "trunk", losses, method).compute_gradients()
  assert method.made == [2]
  trunk = tf1.trainable_variables("trunk/")
  # Step 1: avg = mean / 2; the unlisted term 0.3 passes unchanged.
  ref = tf1.gradients(h, trunk, grad_ys=tf.constant((ga + gb) / 4 + 0.3))
  got, ref = evaluate([[g for g, v in gv if v.op.name.startswith("trunk/")],
                       ref])
  for a, r in zip(got, ref):
    np.testing.assert_allclose(a, r, rtol=1e-4, atol=1e-5)
