"""GradientPlan.combine_tasks with gg.mtl methods, against tf.gradients."""

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from helpers import dense, evaluate

tf1 = tf.compat.v1


def _net(rng, weights=(1.0, 1.0), extra=0.0):
  """base -> trunk -> {head_a, head_b} -> {loss_a, loss_b}, plus extras."""
  x = tf.constant(rng.normal(size=(8, 4)), tf.float32)
  ya = tf.constant(rng.normal(size=(8, 2)), tf.float32)
  base = tf.nn.relu(dense(x, 6, "base"))
  h = dense(base, 5, "trunk", activation=tf.nn.tanh)
  loss_a = tf.reduce_mean(tf.square(dense(h, 2, "head_a") - ya), name="la")
  loss_b = tf.reduce_mean(tf.square(dense(h, 2, "head_b") + ya), name="lb")
  loss = weights[0] * loss_a + weights[1] * loss_b + extra * tf.reduce_sum(h)
  loss += 0.01 * tf.add_n([tf.reduce_sum(v**2)
                           for v in tf1.trainable_variables("base/")])
  return loss, [loss_a, loss_b], h


def _reference(loss, losses, h, method, weights, extra):
  """The rewrite by hand: task gradients at h, combined, backpropagated."""
  shares = [w * tf1.gradients(l, h)[0] for l, w in zip(losses, weights)]
  state = method.create_state(2, name="reference_state")
  at_h = method.combine(shares, state=state) + extra
  below = tf1.trainable_variables("base/") + tf1.trainable_variables("trunk/")
  through = tf1.gradients(h, below, grad_ys=at_h)
  bypass = tf1.gradients(loss, below, stop_gradients=[h])
  ref = {v.op.name: a + b if b is not None else a
         for v, a, b in zip(below, through, bypass)}
  heads = tf1.trainable_variables("head_")
  ref.update({v.op.name: g for v, g in zip(heads, tf1.gradients(loss, heads))})
  return ref


@pytest.mark.parametrize("method", [
    gg.mtl.upgrad(), gg.mtl.mgda(), gg.mtl.cagrad(0.4), gg.mtl.imtl_g(),
    gg.mtl.mean(), gg.mtl.gradvac(), gg.mtl.nash_mtl(), gg.mtl.config()],
    ids=lambda m: m.name)
@pytest.mark.parametrize("weights,extra", [((1.0, 1.0), 0.0),
                                           ((0.5, 2.0), 0.1)])
def test_combine_tasks_matches_the_rewrite_by_hand(graph, rng, method,
                                                   weights, extra):
  loss, losses, h = _net(rng, weights, extra)
  plan = gg.GradientPlan(loss).combine_tasks("trunk", losses, method)
  gv = plan.compute_gradients()
  ref = _reference(loss, losses, h, method, weights, extra)
  got, want = evaluate([[g for g, _ in gv], [ref[v.op.name] for _, v in gv]])
  for (_, v), a, b in zip(gv, got, want):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=v.name)


def test_pcgrad_is_project_conflicts(rng):
  out = []
  for declare in ("project", "combine"):
    with tf.Graph().as_default():
      loss, losses, _ = _net(np.random.default_rng(5))
      plan = gg.GradientPlan(loss)
      if declare == "project":
        plan.project_conflicts("trunk", losses)
      else:
        plan.combine_tasks("trunk", losses, gg.mtl.pcgrad())
      out.append(evaluate([g for g, _ in plan.compute_gradients()]))
  for a, b in zip(*out):
    np.testing.assert_array_equal(a, b)


def test_task_backward_passes_stop_at_the_layer(graph, rng):
  loss, losses, _ = _net(rng)
  plan = gg.GradientPlan(loss, name="plan").combine_tasks(
      "trunk", losses, gg.mtl.upgrad())
  plan.compute_gradients()
  ops = [op.name for op in graph.get_operations()
         if op.name.startswith("plan/combine_tasks_trunk/")]
  grads = [n for n in ops if "/gradients" in n]
  assert any("head_a" in n for n in grads) and any("head_b" in n for n in grads)
  below = [n for n in grads if "trunk/" in n.split("/gradients", 1)[1]
           or "base/" in n.split("/gradients", 1)[1]]
  assert not below, below[:5]


def test_state_once_per_plan_and_layer(rng):
  method = gg.mtl.gradvac()
  with tf.Graph().as_default():
    loss, losses, _ = _net(rng)
    for name in ("p1", "p2"):
      gg.GradientPlan(loss, name=name).combine_tasks(
          "trunk", losses, method).compute_gradients()
    state = [v for v in tf1.global_variables() if "combine_tasks" in v.name]
    assert len(state) == 2 and len({v.name for v in state}) == 2
    assert not [v for v in tf1.trainable_variables() if v in state]
    train = gg.GradientPlan(loss, name="p3").combine_tasks(
        "trunk", losses, method).apply_gradients(
            tf1.train.GradientDescentOptimizer(0.1))
    phi = [v for v in tf1.global_variables() if v.name.startswith("p3/")
           and "combine_tasks" in v.name][0]
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      sess.run(train)
      first = sess.run(phi)
      sess.run(train)
      assert np.abs(first).max() > 0 and not np.allclose(sess.run(phi), first)


def test_combine_tasks_errors(graph, rng):
  loss, losses, _ = _net(rng)
  plan = gg.GradientPlan(loss)
  with pytest.raises(gg.GraphGradError,
                     match=r"combine_tasks: `method` must be a task-comb"):
    plan.combine_tasks("trunk", losses, "upgrad")
  with pytest.raises(gg.GraphGradError,
                     match=r"combine_tasks: `losses` must hold at least two"):
    plan.combine_tasks("trunk", losses[:1], gg.mtl.mean())
  plan.combine_tasks("trunk", losses, gg.mtl.mean())
  with pytest.raises(gg.GraphGradError,
                     match=r"already combines task gradients with mean\(\)"):
    plan.combine_tasks("trunk", losses, gg.mtl.upgrad())
  with pytest.raises(gg.GraphGradError, match=r"already combines task"):
    plan.project_conflicts("trunk", losses)


def test_upstream_transform_acts_after_the_combination(graph, rng):
  loss, losses, h = _net(rng)
  method = gg.mtl.upgrad()
  plan = (gg.GradientPlan(loss).combine_tasks("trunk", losses, method)
          .transform_upstream("trunk", gg.transforms.scale(0.5)))
  gv = plan.compute_gradients()
  shares = [tf1.gradients(l, h)[0] for l in losses]
  at_h = method.combine(shares)
  trunk, base = tf1.trainable_variables("trunk/"), tf1.trainable_variables(
      "base/")
  # The trunk's own parameters see the combined gradient; below, the
  # transform's result flows through the trunk.
  ref_trunk = tf1.gradients(h, trunk, grad_ys=at_h)
  ref_base = [a + b for a, b in zip(
      tf1.gradients(h, base, grad_ys=0.5 * at_h),
      tf1.gradients(loss, base, stop_gradients=[h]))]
  ref = dict(zip([v.op.name for v in trunk + base], ref_trunk + ref_base))
  names = [v.op.name for _, v in gv if v.op.name in ref]
  got, want = evaluate([[g for g, v in gv if v.op.name in ref],
                        [ref[n] for n in names]])
  for n, a, b in zip(names, got, want):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=n)


def test_state_lands_on_the_parameter_server(graph, rng):
  loss, losses, _ = _net(rng)
  with tf1.device(tf1.train.replica_device_setter(ps_tasks=1)):
    gg.GradientPlan(loss).combine_tasks(
        "trunk", losses, gg.mtl.nash_mtl()).compute_gradients()
  state = [v for v in tf1.global_variables() if "combine_tasks" in v.name]
  assert len(state) == 2
  assert all(v.device.startswith("/job:ps") for v in state), [
      v.device for v in state]


def test_state_once_per_layer_in_the_plans_resources(graph, rng):
  loss, losses, _ = _net(rng)
  method = gg.mtl.gradvac()
  plan = (gg.GradientPlan(loss).combine_tasks("trunk", losses, method)
          .combine_tasks("base", losses, method))
  plan.compute_gradients()
  assert sorted(k for k in plan.resources.keys()
                if k[1] == "combine_tasks/state") == [
                    ("base", "combine_tasks/state"),
                    ("trunk", "combine_tasks/state")]
  trunk = plan.resources.get("trunk", "combine_tasks/state")
  base = plan.resources.get("base", "combine_tasks/state")
  assert trunk.phi is not base.phi and trunk.tasks == base.tasks == 2
