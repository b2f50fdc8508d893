"""GradientPlan.apply_gradients with TF1's MixedPrecisionLossScaleOptimizer.

The model keeps float32 variables and computes in float16, as TF1's mixed
precision graph rewrite makes it on a GPU. Its loss is small, so that
unscaled float16 gradients underflow. References: minimize() with the same
optimizer, and the scaled backward pass built by hand with grad_ys.
"""

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg

tf1 = tf.compat.v1
MPLSO = tf1.mixed_precision.MixedPrecisionLossScaleOptimizer

LR = 1e5
SMALL = 1e-6      # the loss's factor: float16 gradients of ~1e-7
CLIP = 1e-7       # below float16's smallest subnormal times 2: 0 in float16
BATCH = 8


def _half_dense(x16, units, name, act=None):
  rng = np.random.default_rng(len(name) + units)
  fan_in = int(x16.shape[-1])
  with tf1.variable_scope(name):
    w = tf1.get_variable("kernel", initializer=(rng.normal(
        size=(fan_in, units)) / np.sqrt(fan_in)).astype(np.float32))
    b = tf1.get_variable("bias", initializer=np.full(units, 0.1, np.float32))
    out = tf.matmul(x16, tf.cast(w, tf.float16)) + tf.cast(b, tf.float16)
    return act(out) if act else out


def _model():
  x = tf1.placeholder(tf.float32, [None, 4])
  y = tf1.placeholder(tf.float32, [None, 3])
  h = _half_dense(tf.cast(x, tf.float16), 6, "l1", tf.tanh)
  out = _half_dense(h, 3, "l2")
  loss = SMALL * tf.reduce_mean(tf.square(tf.cast(out, tf.float32) - y))
  return x, y, out, loss


def _feeds(steps, bad_step=None):
  rng = np.random.default_rng(5)
  feeds = []
  for i in range(steps):
    y = rng.normal(size=(BATCH, 3)).astype(np.float32)
    if i == bad_step:  # the scaled float16 gradient overflows to inf
      y = np.full_like(y, 1e9)
    feeds.append((rng.normal(size=(BATCH, 4)).astype(np.float32), y))
  return feeds


def _train(loss_scale, use_plan, feeds, seen=None):
  """Per step: the variables and the loss-scale optimizer's own variables.

  ``use_plan``: "upstream" cuts the backward pass at l2's outputs (a float16
  boundary) with a transform that changes nothing; "gradients" transforms
  l1's parameter gradients alike (one tf.gradients call, as minimize()).
  """
  with tf.Graph().as_default():
    x, y, _, loss = _model()
    opt = MPLSO(tf1.train.GradientDescentOptimizer(LR), loss_scale)
    if use_plan:
      def look(g):
        seen.append(g.dtype)
        return g
      plan = gg.GradientPlan(loss)
      if use_plan == "upstream":
        plan.transform_upstream("l2", look)
      else:
        plan.transform_gradients("l1", look)
      step = plan.apply_gradients(opt)
    else:
      step = opt.minimize(loss)
    variables = tf1.trainable_variables()
    scale_vars = [v for v in opt.variables() if v not in variables]
    out = []
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      for xv, yv in feeds:
        sess.run(step, {x: xv, y: yv})
        out.append(sess.run([variables, scale_vars]))
  return out


@pytest.mark.parametrize("declared", ["upstream", "gradients"])
@pytest.mark.parametrize("loss_scale,bad_step", [(2.0 ** 15, None),
                                                 ("dynamic", 2)])
def test_plan_steps_as_minimize_does(loss_scale, bad_step, declared):
  feeds = _feeds(4, bad_step)
  seen = []
  got = _train(loss_scale, declared, feeds, seen)
  want = _train(loss_scale, None, feeds)
  assert seen and all(d == tf.float32 for d in seen)  # float16 upstream
  for (gv, gs), (wv, ws) in zip(got, want):
    for a, b in zip(gv, wv):
      np.testing.assert_allclose(a, b, rtol=1e-6)
    assert [np.asarray(s).tolist() for s in gs] == [
        np.asarray(s).tolist() for s in ws]
  first, last = want[0][0], want[-1][0]
  assert all(np.all(np.isfinite(v)) for v in last)
  assert max(np.max(np.abs(a - b)) for a, b in zip(first, last)) > 1e-3
  if bad_step is not None:
    # The forced step changed no variable and halved the scale.
    before, after = want[bad_step - 1], want[bad_step]
    for a, b in zip(before[0], after[0]):
      np.testing.assert_array_equal(a, b)
    assert float(after[1][0]) == float(before[1][0]) / 2


def _clip_step(use_loss_scale):
  """One planned GD step with a clip on l2's float16 upstream gradient."""
  x, y, out, loss = _model()
  plan = gg.GradientPlan(loss).transform_upstream(
      "l2", gg.transforms.clip_by_norm(CLIP))
  inner = tf1.train.GradientDescentOptimizer(LR)
  opt = MPLSO(inner, 2.0 ** 15) if use_loss_scale else inner
  return x, y, out, loss, plan.apply_gradients(opt)


def _by_hand(loss, out, scale):
  """The plan's gradients built by hand: loss * S, clip unscaled, / S."""
  l1 = tf1.trainable_variables("l1/")
  l2 = tf1.trainable_variables("l2/")
  g_out = tf.gradients(loss * scale, out)[0]  # float16, scaled
  clipped = tf.cast(tf.clip_by_norm(tf.cast(g_out, tf.float32) / scale, CLIP)
                    * scale, tf.float16)
  grads = (tf.gradients(out, l1, grad_ys=clipped)
           + tf.gradients(out, l2, grad_ys=g_out))
  return [g / scale for g in grads], l1 + l2


def _moves(sess, step, variables, feed, at_start=()):
  """(w0 - w1) / LR of one step, and ``at_start`` evaluated at w0."""
  sess.run(tf1.global_variables_initializer())
  before, start = sess.run([variables, list(at_start)], feed)
  sess.run(step, feed)
  return [(b - a) / LR for b, a in zip(before, sess.run(variables))], start


def test_clip_on_float16_boundary_sees_unscaled_float32(graph):
  x, y, out, loss, step = _clip_step(True)
  grads, variables = _by_hand(loss, out, 2.0 ** 15)
  xv, yv = _feeds(1)[0]
  feed = {x: xv, y: yv}
  plain = tf.gradients(loss * 2.0 ** 15, variables[0])[0] / 2.0 ** 15
  with tf1.Session() as sess:
    moved, (want, unclipped) = _moves(sess, step, variables, feed,
                                      [grads, plain])
  for m, w in zip(moved, want):
    assert np.all(np.isfinite(m))
    # (w0 - w1) / LR loses digits: w is about 1, the step about 1e-3.
    np.testing.assert_allclose(m, w, rtol=1e-3, atol=1e-11)
  assert all(np.max(np.abs(m)) > 0 for m in moved)  # l1 trains
  # The clip is active: l1's kernel moved less than without it.
  assert np.linalg.norm(moved[0]) < 0.9 * np.linalg.norm(unclipped)


def test_without_loss_scale_float16_gradients_underflow(graph):
  # What the loss-scale optimizer is for: applied with the inner optimizer,
  # l1's float16 gradients are lost (zero or NaN), with it they are not.
  x, y, _, _, step = _clip_step(False)
  xv, yv = _feeds(1)[0]
  with tf1.Session() as sess:
    moved, _ = _moves(sess, step, tf1.trainable_variables("l1/"),
                      {x: xv, y: yv})
  assert all(not np.any(np.isfinite(m) & (m != 0)) for m in moved)


def test_refuses_declarations_loss_scaling_would_change(graph):
  # Nash-MTL's result does not grow with the task gradients (degree 0):
  # it is not homogeneous, so a loss scale is refused.
  x, y, out, loss = _model()
  la = tf.reduce_mean(tf.cast(out[:, 0], tf.float32))
  lb = tf.reduce_mean(tf.cast(out[:, 1], tf.float32))
  plan = gg.GradientPlan(la + lb).combine_tasks(
      "l1", [la, lb], gg.mtl.nash_mtl())
  opt = MPLSO(tf1.train.GradientDescentOptimizer(LR), "dynamic")
  with pytest.raises(gg.GraphGradError,
                     match=r"loss_scale: .* combine_tasks\('l1', .*nash_mtl"
                           r".*\(not homogeneous\)"):
    plan.apply_gradients(opt)


def _two_tasks():
  rng = np.random.default_rng(3)
  x = tf.constant(rng.normal(size=(BATCH, 4)).astype(np.float32))
  h = x
  for name, units in (("l1", 6), ("l2", 2)):
    with tf1.variable_scope(name):
      w = tf1.get_variable("kernel", initializer=rng.normal(
          size=(int(h.shape[-1]), units)).astype(np.float32))
      h = tf.tanh(h @ w)
  # The tasks conflict at l1: -0.7 of the first task's gradient.
  la = tf.reduce_mean(h[:, 0])
  lb = -0.7 * tf.reduce_mean(h[:, 0]) + tf.reduce_mean(h[:, 1])
  return la, lb


@pytest.mark.parametrize("at", ["output", "parameters"])
def test_a_homogeneous_task_combination_sees_the_scaled_task_gradients(
    graph, at):
  # pcgrad(S g_1, S g_2) = S pcgrad(g_1, g_2): under a loss scale the task
  # gradients are scaled as the loss's is, and the unscaled result equals
  # the plan's without a loss scale.
  la, lb = _two_tasks()
  got = []
  for scale in (None, 1024.0):
    opt = (None if scale is None
           else MPLSO(tf1.train.GradientDescentOptimizer(LR), scale))
    plan = gg.GradientPlan(la + lb, loss_scale=opt)
    plan.combine_tasks("l1" if at == "output" else ["l1", "l2"], [la, lb],
                       gg.mtl.pcgrad(shuffle=False), at=at)
    got.append([g for g, _ in plan.compute_gradients()])
  plain = tf.gradients(la + lb, tf1.trainable_variables())
  with tf1.Session() as s:
    s.run(tf1.global_variables_initializer())
    unscaled, scaled, plain = s.run([got[0], got[1], plain])
  assert any(not np.allclose(a, p) for a, p in zip(unscaled, plain))
  for a, b in zip(scaled, unscaled):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_a_loss_scale_tensorflow_does_not_list_is_refused(graph, monkeypatch):
  # The scale is read through the public tf.train.TrackableView: a
  # TensorFlow whose optimizer no longer tracks it there is refused by name.
  monkeypatch.setattr(tf.train.TrackableView, "children",
                      lambda self, obj, **kw: {})
  x, y, out, loss = _model()
  plan = gg.GradientPlan(loss)
  opt = MPLSO(tf1.train.GradientDescentOptimizer(LR), 2.0**15)
  with pytest.raises(gg.GraphGradError,
                     match=r"tracks no callable `loss_scale` dependency "
                           r"\(got None\).*Apply the plan with the optimizer "
                           r"it wraps"):
    plan.apply_gradients(opt)


def _spy(opt, applied):
  """Records the pairs ``opt.apply_gradients`` receives."""
  real = opt.apply_gradients

  def apply_gradients(grads_and_vars, *args, **kwargs):
    applied.extend(grads_and_vars)
    return real(grads_and_vars, *args, **kwargs)
  opt.apply_gradients = apply_gradients


@pytest.mark.parametrize("declared", ["option", "first_apply"])
def test_compute_gradients_returns_what_apply_gradients_trains(graph,
                                                               declared):
  x, y, _, loss = _model()
  opt = MPLSO(tf1.train.GradientDescentOptimizer(LR), 2.0 ** 15)
  applied = []
  _spy(opt, applied)
  plan = gg.GradientPlan(loss, loss_scale=opt if declared == "option"
                         else None).transform_upstream(
                             "l2", gg.transforms.clip_by_norm(1.0))
  if declared == "option":
    before = plan.compute_gradients()
  plan.apply_gradients(opt)
  gv = plan.compute_gradients()
  if declared == "option":
    assert all(a is b for a, b in zip(gv, before))
  assert [(g, v) for g, v in applied] == gv  # the very tensors
  n = len(graph.get_operations())
  plan.summaries()
  added = [op.name for op in graph.get_operations()[n:]]
  assert added and not [a for a in added if "gradients" in a]  # no rebuild
  # The unscaled gradients: those of the optimizer's own compute_gradients.
  want = [g for g, _ in opt.compute_gradients(loss, [v for _, v in gv])]
  xv, yv = _feeds(1)[0]
  with tf1.Session() as sess:
    sess.run(tf1.global_variables_initializer())
    got, ref = sess.run([[g for g, _ in gv], want], {x: xv, y: yv})
  for a, b in zip(got, ref):
    assert np.all(np.isfinite(a)) and np.max(np.abs(a)) > 0
    np.testing.assert_allclose(a, b, rtol=1e-6)


def test_a_loss_scale_must_match_the_build(graph):
  x, y, _, loss = _model()
  inner = tf1.train.GradientDescentOptimizer(LR)
  opt = MPLSO(inner, 2.0 ** 15)
  with pytest.raises(gg.GraphGradError,
                     match=r"gg.GradientPlan: `loss_scale` must be a "
                           r"tf.compat.v1.mixed_precision.MixedPrecision"
                           r"LossScaleOptimizer; got GradientDescentOptimizer"):
    gg.GradientPlan(loss, loss_scale=inner)
  plan = gg.GradientPlan(loss)
  plan.compute_gradients()
  with pytest.raises(gg.GraphGradError,
                     match=r"compute_gradients\(\) already built this plan "
                           r"without a loss scale. Make the plan with "
                           r"gg.GradientPlan\(\.\.\., loss_scale=optimizer\)"):
    plan.apply_gradients(opt)
  scaled = gg.GradientPlan(loss, loss_scale=opt)
  with pytest.raises(gg.GraphGradError,
                     match=r"backpropagates the loss scaled by the "
                           r"MixedPrecisionLossScaleOptimizer it was made "
                           r"with .* but `optimizer` is "
                           r"GradientDescentOptimizer"):
    scaled.apply_gradients(inner)


class _Mean:
  """A task-combination method of one's own, without gg.mtl's attributes."""

  def combine(self, grads):
    return tf.add_n(grads) / len(grads)


def test_a_method_of_ones_own_is_refused_under_a_loss_scale_by_name(graph):
  # Nothing says its combine scales with S: the policy refuses it, by the
  # same message as Nash-MTL's, not with an AttributeError.
  x, y, out, loss = _model()
  la = tf.reduce_mean(tf.cast(out[:, 0], tf.float32))
  lb = tf.reduce_mean(tf.cast(out[:, 1], tf.float32))
  plan = gg.GradientPlan(la + lb).combine_tasks("l1", [la, lb], _Mean())
  opt = MPLSO(tf1.train.GradientDescentOptimizer(LR), "dynamic")
  with pytest.raises(gg.GraphGradError,
                     match=r"loss_scale: .* combine_tasks\('l1', .*_Mean"
                           r".*\(not homogeneous\)"):
    plan.apply_gradients(opt)
