"""privatize under SyncReplicasOptimizer, with workers simulated in-process.

Each worker is a tower of one tf.Graph with its own batch, plan and
SyncReplicasOptimizer; the towers share the variables and, by their shared
names, the gradient accumulators and the token queue, as the workers of a
cluster share them on the ps. A step sets each tower's local step to the
global step (as a worker does when it starts), puts one token per tower in
the queue, runs every tower's train op (its push, then it takes a token),
then the first tower's chief update. The reference is one device with the
global batch: one tf.gradients per example, clipped in numpy, summed and
divided by the global batch size.
"""

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from helpers import dense

tf1 = tf.compat.v1
LR = 1.0  # gradient descent: the applied update is the gradient


def _normal(*shape, seed=0):
  return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def _loss(x):
  with tf1.variable_scope("", reuse=tf1.AUTO_REUSE):
    h = dense(x, 64, "l1", tf.tanh)
    out = dense(h, 32, "l2")
  return tf.reduce_sum(tf.square(out), axis=1)


def _clipped_sum(losses, variables, feed, clip):
  """sum_i clip_C(grad l_i) over every example of every tower, and the
  examples' gradient norms."""
  per = [tf1.gradients(loss[i], variables)
         for loss, b in losses for i in range(b)]
  with tf1.Session() as s:
    s.run(tf1.global_variables_initializer())
    values = s.run(per, feed)
  norms = np.array([np.sqrt(sum(np.sum(g.astype(np.float64) ** 2)
                                for g in grads)) for grads in values])
  total = [np.zeros(v.shape, np.float64) for v in variables]
  for grads, norm in zip(values, norms):
    c = min(1.0, clip / norm)
    total = [t + c * g for t, g in zip(total, grads)]
  return total, norms


class Towers:
  """R workers of one SyncReplicasOptimizer, in one tf.Graph."""

  def __init__(self, batches, clip, noise, replicas, total=None,
               expected=None, static=True):
    self.feed, self.losses, self.syncs, self.trains = {}, [], [], []
    self.step = tf1.train.get_or_create_global_step()
    for k, b in enumerate(batches):
      x = tf1.placeholder(tf.float32, [b if static else None, 16])
      self.feed[x] = _normal(b, 16, seed=k)
      loss = _loss(x)
      self.losses.append((loss, b))
      plan = gg.GradientPlan(loss, name=f"worker{k}").privatize(
          clip, noise, seed=7, expected_batch_size=expected)
      inner = gg.AfterAggregation(tf1.train.GradientDescentOptimizer(LR),
                                  plan.net)
      sync = tf1.train.SyncReplicasOptimizer(
          inner, replicas_to_aggregate=replicas, total_num_replicas=total)
      self.trains.append(plan.apply_gradients(sync, global_step=self.step))
      self.syncs.append(sync)
    self.variables = tf1.trainable_variables()
    self.counters = [v for v in tf1.global_variables()
                     if "dp_noise_step" in v.op.name]
    self.tokens = self.syncs[0].get_init_tokens_op(len(batches))

  def run(self, steps=1):
    """The update of each step (``w_before - w_after``), and the noise
    counters."""
    chief = self.syncs[0].get_chief_queue_runner().enqueue_ops[0]
    moves = []
    with tf1.Session() as s:
      s.run([tf1.global_variables_initializer(),
             tf1.local_variables_initializer()])
      s.run(self.syncs[0].chief_init_op)
      for _ in range(steps):
        s.run([sync.local_step_init_op for sync in self.syncs])
        s.run(self.tokens)
        before = s.run(self.variables)
        for train in self.trains:  # each worker pushes its clipped sum
          s.run(train, self.feed)
        s.run(chief)  # the chief applies the aggregated, noised mean
        after = s.run(self.variables)
        moves.append([(a.astype(np.float64) - b) / LR
                      for a, b in zip(before, after)])
      return moves, s.run(self.counters)


def _median_clip(batches):
  """The median gradient norm of the examples: half of them are clipped."""
  with tf.Graph().as_default():
    feed, losses = {}, []
    for k, b in enumerate(batches):
      x = tf1.placeholder(tf.float32, [b, 16])
      feed[x] = _normal(b, 16, seed=k)
      losses.append((_loss(x), b))
    _, norms = _clipped_sum(losses, tf1.trainable_variables(), feed, 1.0)
  return float(np.median(norms))


def test_without_noise_one_update_equals_one_device_with_the_global_batch(
    graph):
  batches, r = [4, 4, 4], 3
  clip = _median_clip(batches)
  towers = Towers(batches, clip, 0.0, r)
  total, norms = _clipped_sum(towers.losses, towers.variables, towers.feed,
                              clip)
  assert (norms > clip).any() and (norms < clip).any()
  (moved,), counters = towers.run()
  for m, t in zip(moved, total):
    np.testing.assert_allclose(m, t / sum(batches), rtol=1e-6, atol=1e-6)
  assert not any(counters)  # no noise: no draw


def test_the_noise_is_drawn_once_per_step_on_the_chief(graph):
  batches, r, sigma = [4, 4, 4, 4], 4, 1.5
  clip = _median_clip(batches)
  towers = Towers(batches, clip, sigma, r)
  total, _ = _clipped_sum(towers.losses, towers.variables, towers.feed, clip)
  (moved, _), counters = towers.run(steps=2)
  noise = np.concatenate([(m - t / 16).ravel() for m, t in zip(moved, total)])
  # One draw of N(0, sigma^2 C^2) divided by B = 16. R draws averaged
  # would give half of it; R draws summed, twice.
  assert noise.size > 3000
  np.testing.assert_allclose(np.std(noise), sigma * clip / 16, rtol=0.05)
  assert abs(np.mean(noise)) < 4 * sigma * clip / 16 / np.sqrt(noise.size)
  # Two applied steps, two draws, all by one counter: the chief's.
  assert sorted(counters) == [0] * (len(counters) - 1) + [2]


def test_expected_batch_size_divides_workers_of_any_batch_size(graph):
  towers = Towers([3, 5], 0.5, 0.0, 2, expected=10.0, static=False)
  total, _ = _clipped_sum(towers.losses, towers.variables, towers.feed, 0.5)
  (moved,), _ = towers.run()
  for m, t in zip(moved, total):
    np.testing.assert_allclose(m, t / 10.0, rtol=1e-6, atol=1e-6)


def test_a_backup_worker_push_is_averaged_in_not_added(graph):
  """total_num_replicas > replicas_to_aggregate: when k > R fresh pushes
  are accumulated before the chief takes them, the accumulator averages all
  k, and the update is R / k times their clipped sum over B = R * b, so one
  example still moves it by at most C / B: the noise still covers it."""
  batches = [4, 4, 4]
  towers = Towers(batches, 0.5, 0.0, 2, total=3)
  total, _ = _clipped_sum(towers.losses, towers.variables, towers.feed, 0.5)
  (moved,), _ = towers.run()
  for m, t in zip(moved, total):
    np.testing.assert_allclose(m, (2 / 3) * t / 8, rtol=1e-6, atol=1e-6)


def _sync(plan, replicas=2, inner=None):
  inner = inner or gg.AfterAggregation(
      tf1.train.GradientDescentOptimizer(LR), plan.net)
  return tf1.train.SyncReplicasOptimizer(inner, replicas_to_aggregate=replicas)


def test_the_noise_counter_is_a_global_variable_on_the_ps(graph):
  setter = tf1.train.replica_device_setter(
      ps_tasks=1, worker_device="/job:worker/task:0")
  with tf1.device(setter):
    step = tf1.train.get_or_create_global_step()
    plan = gg.GradientPlan(_loss(tf.constant(_normal(4, 16)))).privatize(
        1.0, 1.0)
    plan.apply_gradients(_sync(plan), global_step=step)
  counters = [v for v in tf1.global_variables()
              if "dp_noise_step" in v.op.name]
  chief = [v for v in counters if "AfterAggregation" in v.op.name]
  assert len(chief) == 1 and chief[0].device == "/job:ps/task:0"
  assert chief[0] not in tf1.trainable_variables()
  noise = [op for op in tf1.get_default_graph().get_operations()
           if op.type == "PartitionedCall"
           and "_box_muller" in op.get_attr("f").name]  # the noise's kernel
  # One draw for the four small variables together, on the chief's update,
  # none per push.
  assert len(noise) == 1 and all(op.device == "/job:ps/task:0"
                                 for op in noise)


def test_refusals(graph):
  step = tf1.train.get_or_create_global_step()
  x = tf1.placeholder(tf.float32, [None, 16])
  plan = gg.GradientPlan(_loss(x)).privatize(1.0, 1.0)
  with pytest.raises(
      gg.GraphGradError,
      match=r"privatize: under SyncReplicasOptimizer the global batch size "
      r"divides the aggregated sum, but the loss \S+ has shape \(None,\).*"
      r"expected_batch_size=\.\.\.\)"):
    plan.apply_gradients(_sync(plan), global_step=step)
  plan = gg.GradientPlan(_loss(tf.constant(_normal(4, 16))), name="built")
  plan.privatize(1.0, 1.0).compute_gradients()
  with pytest.raises(gg.GraphGradError,
                     match=r"compute_gradients\(\) \(or summaries\(\), a "
                     r"report\) already built this private plan"):
    plan.apply_gradients(_sync(plan), global_step=step)
  plan = gg.GradientPlan(_loss(tf.constant(_normal(4, 16))), name="clip")
  plan.privatize(1.0, 1.0).transform_gradients(
      "l1", gg.transforms.clip_by_norm(1.0))
  with pytest.raises(gg.GraphGradError,
                     match=r"the plan's transform_gradients would act on "
                     r"each worker's clipped sum.*gg\.AfterAggregation"):
    plan.apply_gradients(_sync(plan), global_step=step)
  plan = gg.GradientPlan(_loss(tf.constant(_normal(4, 16))), name="reduce",
                         reduce_fn=lambda gv: [g for g, _ in gv], replicas=2)
  plan.privatize(1.0, 1.0)
  with pytest.raises(gg.GraphGradError,
                     match=r"the plan has a `reduce_fn` and `optimizer` is a "
                     r"SyncReplicasOptimizer: the gradients would be "
                     r"aggregated twice"):
    plan.apply_gradients(_sync(plan), global_step=step)


def test_a_plan_built_for_sync_refuses_another_optimizer(graph):
  step = tf1.train.get_or_create_global_step()
  plan = gg.GradientPlan(_loss(tf.constant(_normal(4, 16)))).privatize(
      1.0, 1.0)
  plan.apply_gradients(_sync(plan), global_step=step)
  plan.apply_gradients(_sync(plan), global_step=step)  # the same build
  with pytest.raises(gg.GraphGradError,
                     match=r"this private plan was built for a "
                     r"SyncReplicasOptimizer.*`optimizer` is "
                     r"GradientDescentOptimizer"):
    plan.apply_gradients(tf1.train.GradientDescentOptimizer(LR))


class Doubling(tf1.train.Optimizer):
  """Doubles the aggregated gradients before the optimizer it wraps."""

  def __init__(self, inner):
    super().__init__(use_locking=False, name="Doubling")
    self.inner = inner

  def apply_gradients(self, grads_and_vars, global_step=None, name=None):
    return self.inner.apply_gradients(
        [(2.0 * g, v) for g, v in grads_and_vars], global_step, name)


def test_after_aggregation_must_get_the_accumulated_gradients(graph):
  step = tf1.train.get_or_create_global_step()
  plan = gg.GradientPlan(_loss(tf.constant(_normal(4, 16)))).privatize(
      1.0, 1.0)
  inner = Doubling(gg.AfterAggregation(
      tf1.train.GradientDescentOptimizer(LR), plan.net))
  with pytest.raises(gg.GraphGradError,
                     match=r"the gradient of l1/kernel:0 reached "
                     r"gg.AfterAggregation from the Mul op \S+, not from a "
                     r"SyncReplicasOptimizer accumulator"):
    plan.apply_gradients(_sync(plan, inner=inner), global_step=step)
