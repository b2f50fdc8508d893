"""GradientPlan.privatize with ``reduce_fn``: one noise draw per global batch.

Two towers in one tf.Graph, each on its own CPU device with its own copy of
the variables (the same initial values) and its own plan, reduce with TF's
collective all-reduce, a sum or a mean, as Horovod's ``allreduce`` does
across processes. The reference is one device with the global batch: one
``tf.gradients`` call per example, clipped, summed and divided in numpy.
"""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.ops import collective_ops  # pylint: disable=g-direct-tensorflow-import

import graphgrad as gg
from tests.helpers import dense

tf1 = tf.compat.v1
SIZES = (3, 5)  # unequal local batch sizes; the global batch is 8
REPLICAS = len(SIZES)


class Collective:
  """One tower's ``reduce_fn``: a collective all-reduce over the towers.

  The towers build the same plan, so their n-th all-reduce calls match by
  the instance key ``n``.
  """

  def __init__(self, device: str, replicas: int, final: str):
    self.device, self.replicas, self.final = device, replicas, final
    self.calls = 0
    self.pairs = []

  def __call__(self, gv):
    out = []
    with tf.device(self.device):
      for g, v in gv:
        self.calls += 1
        self.pairs.append((g, v))
        out.append(collective_ops.all_reduce(
            g, self.replicas, 1, self.calls, "Add", self.final))
    return out


def inputs(seed=0):
  rng = np.random.default_rng(seed)
  n = sum(SIZES)
  return (rng.normal(size=(n, 6)).astype(np.float32),
          rng.normal(size=(n, 2)).astype(np.float32))


def model(x, y, width):
  h = dense(x, width, "l1", tf.nn.tanh)
  out = dense(h, 2, "l2")
  return tf.reduce_sum(tf.square(out - y), axis=1)


def reference(clip, width, divisor=None):
  """(1/B) sum_i clip_C(grad l_i) on one device with the global batch (or
  over ``divisor``)."""
  x, y = inputs()
  with tf.Graph().as_default():
    loss = model(tf.constant(x), tf.constant(y), width)
    variables = tf1.trainable_variables()
    per = [tf1.gradients(loss[i], variables) for i in range(len(x))]
    with tf1.Session() as s:
      s.run(tf1.global_variables_initializer())
      values = s.run(per)
  grads = [[g.astype(np.float64) for g in gs] for gs in values]
  norms = np.array([np.sqrt(sum(np.sum(g * g) for g in gs)) for gs in grads])
  c = np.minimum(1.0, clip / norms)
  total = [sum(ci * gs[j] for ci, gs in zip(c, grads))
           for j in range(len(variables))]
  return [t / (divisor or len(x)) for t in total], norms


def towers(clip, noise, final="Id", seed=None, width=8, steps=1,
           replicas=REPLICAS, expected_batch_size=None, drift=0):
  """Each tower's private gradients, ``[step][tower][variable]``; the last
  tower's noise step counter starts ``drift`` steps ahead."""
  x, y = inputs()
  starts = np.cumsum((0,) + SIZES)
  gradients, reducers = [], []
  with tf.Graph().as_default():
    for k in range(len(SIZES)):
      device = f"/device:CPU:{k}"
      with tf.device(device), tf1.variable_scope(f"tower{k}"):
        part = slice(starts[k], starts[k + 1])
        loss = model(tf.constant(x[part]), tf.constant(y[part]), width)
        reducers.append(Collective(device, len(SIZES), final))
        plan = gg.GradientPlan(
            loss, var_list=tf1.trainable_variables(f"tower{k}/"),
            reduce_fn=reducers[-1], replicas=replicas)
        gv = plan.privatize(clip, noise, seed=seed,
                            expected_batch_size=expected_batch_size
                            ).compute_gradients()
        gradients.append([g for g, _ in gv])
    config = tf1.ConfigProto(device_count={"CPU": len(SIZES)})
    with tf1.Session(config=config) as s:
      s.run(tf1.global_variables_initializer())
      counter, = [v for v in tf1.global_variables()
                  if v.name.startswith(f"tower{len(SIZES) - 1}/")
                  and "dp_noise_step" in v.name]
      s.run(counter.assign_add(drift))
      return [s.run(gradients) for _ in range(steps)], reducers


@pytest.mark.parametrize("expected_batch_size", [None, 10.0],
                         ids=["realized", "expected"])
@pytest.mark.parametrize("final", ["Id", "Div"], ids=["sum", "mean"])
def test_every_replica_equals_one_device_with_the_global_batch(
    final, expected_batch_size):
  _, norms = reference(1.0, 8)
  clip = float(np.median(norms))  # half the examples clipped
  expected, norms = reference(clip, 8, expected_batch_size)
  assert (norms > clip).any() and (norms < clip).any()
  (step,), reducers = towers(clip, 0.0, final,
                             expected_batch_size=expected_batch_size)
  for tower in step:
    for g, e in zip(tower, expected):
      np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-7)
  # One reduce_fn call per tower: the clipped sums and the statistics, the
  # last paired with a variable of its own shape.
  stats, tag = reducers[0].pairs[-1]
  assert len(reducers[0].pairs) == 5
  assert tag.shape == stats.shape == (2,) and tag.dtype == tf.float32


@pytest.mark.parametrize("seed", [None, 11], ids=["os-key", "seeded"])
@pytest.mark.parametrize("final", ["Id", "Div"], ids=["sum", "mean"])
def test_every_replica_adds_the_same_single_noise_draw(final, seed):
  clip, sigma, width = 0.5, 2.0, 256
  expected, _ = reference(clip, width)
  steps, _ = towers(clip, sigma, final, seed=seed, width=width, steps=2)
  noises = []
  for step in steps:
    first, second = step
    for a, b in zip(first, second):  # the same update on both replicas
      np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    noises.append(np.concatenate(
        [(g - e).ravel() for g, e in zip(first, expected)]))
  assert noises[0].size > 2000
  std = sigma * clip / sum(SIZES)  # one draw, divided by the global batch
  for n in noises:
    assert abs(np.std(n) / std - 1) < 0.05, (np.std(n), std)
  # A new draw each step.
  assert np.corrcoef(noises[0], noises[1])[0, 1] < 0.1


def test_a_reducer_neither_sum_nor_mean_is_refused_when_run():
  # Two towers summing, declared as three replicas: 1.0 reduces to 2.
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match=r"reduce_fn is neither a sum nor a mean over "
                           r"replicas=3: it reduced 1.0 to\] \[2\]"):
    towers(1.0, 0.0, "Id", replicas=3)


def test_privatize_with_reduce_fn_needs_replicas(graph):
  loss = tf.reduce_sum(dense(tf.ones([4, 3]), 2, "l1"), axis=1)
  plan = gg.GradientPlan(loss, reduce_fn=lambda gv: [g for g, _ in gv])
  with pytest.raises(gg.GraphGradError,
                     match=r"GradientPlan.privatize: with `reduce_fn` the "
                           r"plan needs `replicas`.*got replicas=None.*"
                           r"replicas=hvd.size\(\)"):
    plan.privatize(1.0, 1.0)


@pytest.mark.parametrize("bad", [0, -2, 2.0, True, "2"])
def test_replicas_must_be_a_positive_int(graph, bad):
  loss = tf.reduce_sum(dense(tf.ones([4, 3]), 2, "l1"), axis=1)
  with pytest.raises(gg.GraphGradError,
                     match=r"`replicas` must be a positive int.*; got "
                           rf"{type(bad).__name__} {bad!r}"):
    gg.GradientPlan(loss, reduce_fn=lambda gv: [g for g, _ in gv],
                    replicas=bad)


def test_replicas_without_reduce_fn_is_refused(graph):
  loss = tf.reduce_sum(dense(tf.ones([4, 3]), 2, "l1"), axis=1)
  with pytest.raises(gg.GraphGradError,
                     match=r"got replicas=2 without a reduce_fn. Pass the "
                           r"reduction too"):
    gg.GradientPlan(loss, replicas=2)


def test_the_noise_does_not_hang_on_the_replicas_step_counters():
  # Without a seed the noise's seed pair is reduced, so a replica whose
  # counter differs (restored from another checkpoint) draws the same noise.
  (step,), _ = towers(0.5, 2.0, "Div", width=32, drift=7)
  first, second = step
  for a, b in zip(first, second):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  assert max(np.max(np.abs(a - b)) for a, b in zip(
      first, towers(0.5, 2.0, "Div", width=32)[0][0][0])) > 1e-3
