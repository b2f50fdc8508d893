"""A KerasPlan under tf.distribute, against the same plan on one device.

Run by tests/distributed/test_strategies.py in a fresh process, because the
logical devices and the cluster must be set before TensorFlow runs an op:

  strategy_worker.py mirrored OUT CASES [OUT CASES ...]
                                           2 logical CPUs, MirroredStrategy;
                                           CASES: "transforms" (parameter
                                           clips, model.fit) or "rewrites"
                                           (linear and upstream rewrites,
                                           plan.recompute with batch norm)
                                           or "private" (privatize: the
                                           summed gradients and the noise,
                                           in a loop and in model.fit) or
                                           "summaries" (plan.summaries() in
                                           a step of two replicas, against
                                           one device);
                                           each pair runs in turn in this one
                                           process and writes its own OUT
  strategy_worker.py multiworker OUT TASK WORKERS
                                           one process per worker; WORKERS:
                                           a JSON list of host:port, which
                                           becomes TF_CONFIG

Each case trains one model for STEPS SGD steps with the strategy, one
identical model with the same plan on one device with the global batch, and
one with the transforms applied to each replica's gradient before the sum
(what a plan did before it summed first), and writes, as JSON to OUT, the
largest weight difference of the first two and of the last two.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

STEPS = 3
GLOBAL_BATCH = 16
LR = 0.05
UPSTREAM = 0.5    # transform_upstream("l2", scale(UPSTREAM))
CLIP = 0.02       # transform_gradients("l2", clip...(CLIP))


def data():
  rng = np.random.default_rng(7)
  x = rng.normal(size=(STEPS, GLOBAL_BATCH, 4)).astype(np.float32)
  y = rng.normal(size=(STEPS, GLOBAL_BATCH, 3)).astype(np.float32)
  return x, y


def initial_weights():
  rng = np.random.default_rng(3)
  shapes = [(4, 8), (8,), (8, 8), (8,), (8, 3), (3,)]
  return [rng.normal(scale=0.7, size=s).astype(np.float32) for s in shapes]


def make_model(K):
  model = K.Sequential([
      K.Input((4,)),
      K.layers.Dense(8, activation="tanh", name="l1"),
      K.layers.Dense(8, activation="tanh", name="l2"),
      K.layers.Dense(3, name="l3")])
  model.set_weights(initial_weights())
  return model


def make_optimizer(K, kind):
  if kind == "legacy":
    return K.optimizers.legacy.SGD(LR)
  return K.optimizers.SGD(LR)


def make_plan(gg, model, group):
  """The plan of case ``group``.

  "clip", "global": upstream scale, then a nonlinear parameter transform
  (on the sum over replicas); "scale": linear transforms only; "value": an
  element-wise upstream clip; "norm": an upstream clip of the whole tensor,
  which sees each replica's own examples.
  """
  t = gg.transforms
  plan = gg.KerasPlan(model)
  if group in ("clip", "global", "scale"):
    plan.transform_upstream("l2", t.scale(UPSTREAM))
    plan.transform_gradients("l2", {"clip": t.clip_by_norm(CLIP),
                                    "global": t.clip_by_global_norm(CLIP),
                                    "scale": t.scale(0.5)}[group])
  elif group == "value":
    plan.transform_upstream("l2", t.clip_by_value(-CLIP, CLIP))
  else:
    plan.transform_upstream("l2", t.clip_by_norm(CLIP))
  return plan


def loss_of(model, x, y):
  per_example = tf.reduce_sum(tf.square(model(x) - y), axis=-1)
  return tf.nn.compute_average_loss(per_example,
                                    global_batch_size=GLOBAL_BATCH)


def planned_step(plan, model, opt):
  def step(x, y):
    with plan.tape() as tape:
      loss = loss_of(model, x, y)
    grads = tape.gradient(loss)
    opt.apply_gradients(zip(grads, model.trainable_variables))
  return step


def one_device(gg, K, kind, group, split):
  """The same plan on one device; ``split`` > 1: transforms per part."""
  model = make_model(K)
  plan = make_plan(gg, model, group)
  opt = make_optimizer(K, kind)
  if split == 1:
    step = tf.function(planned_step(plan, model, opt))
  else:
    @tf.function
    def step(x, y):
      total = None
      for xs, ys in zip(tf.split(x, split), tf.split(y, split)):
        with plan.tape() as tape:
          loss = loss_of(model, xs, ys)
        g = tape.gradient(loss)
        total = g if total is None else [a + b for a, b in zip(total, g)]
      opt.apply_gradients(zip(total, model.trainable_variables))
  xs, ys = data()
  for i in range(STEPS):
    step(tf.constant(xs[i]), tf.constant(ys[i]))
  return [np.asarray(w) for w in model.get_weights()]


def distributed(gg, K, kind, group, strategy, local):
  """Trains under ``strategy``; ``local(step_x)`` is this worker's input."""
  with strategy.scope():
    model = make_model(K)
    plan = make_plan(gg, model, group)
    opt = make_optimizer(K, kind)
  step = planned_step(plan, model, opt)

  @tf.function
  def train(x, y):
    strategy.run(step, args=(x, y))

  xs, ys = data()
  for i in range(STEPS):
    x, y = local(xs[i]), local(ys[i])
    train(x, y)
  return [np.asarray(w) for w in model.get_weights()]


def compare(gg, K, kind, group, strategy, local, replicas):
  got = distributed(gg, K, kind, group, strategy, local)
  ref = one_device(gg, K, kind, group, 1)
  per_replica = one_device(gg, K, kind, group, replicas)

  def diff(xs, ys):
    return max(float(np.max(np.abs(a - b))) for a, b in zip(xs, ys))

  return {"flavour": K.__name__, "optimizer": kind, "group": group,
          "diff": diff(got, ref), "per_replica_diff": diff(per_replica, ref),
          "vs_per_replica": diff(got, per_replica),
          "weights": [w.tolist() for w in got]}


def fit_case(gg, K, strategy):
  """``model.fit`` with a train_step that runs the plan's tape, against the
  same plan in a loop on one device (global batch, the compiled MSE)."""

  class PlanTrainer(K.Model):
    """A model whose train_step takes its gradients from a plan's tape."""

    def __init__(self, inner):
      super().__init__()
      self.inner = inner
      self.plan = make_plan(gg, inner, "clip")

    def call(self, x):
      return self.inner(x)

    def train_step(self, data):
      x, y = data
      with self.plan.tape() as tape:
        loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
      grads = tape.gradient(loss)
      self.optimizer.apply_gradients(zip(grads, self.inner.trainable_variables))
      return {"loss": loss}

  xs, ys = data()
  with strategy.scope():
    trainer = PlanTrainer(make_model(K))
    trainer.compile(optimizer=K.optimizers.SGD(LR), loss="mse")
  trainer.fit(xs.reshape(-1, 4), ys.reshape(-1, 3), batch_size=GLOBAL_BATCH,
              shuffle=False, epochs=1, verbose=0)
  got = [np.asarray(w) for w in trainer.inner.get_weights()]

  model = make_model(K)
  plan = make_plan(gg, model, "clip")
  opt = K.optimizers.SGD(LR)

  @tf.function
  def step(x, y):
    with plan.tape() as tape:
      loss = tf.reduce_mean(tf.square(model(x) - y))
    opt.apply_gradients(zip(tape.gradient(loss), model.trainable_variables))

  for i in range(STEPS):
    step(tf.constant(xs[i]), tf.constant(ys[i]))
  ref = [np.asarray(w) for w in model.get_weights()]
  start = initial_weights()
  return {"flavour": K.__name__, "optimizer": "fit", "group": "clip",
          "diff": max(float(np.max(np.abs(a - b))) for a, b in zip(got, ref)),
          "moved": min(float(np.max(np.abs(a - b)))
                       for a, b in zip(ref, start))}


def recompute_case(gg, K, strategy, local):
  """``plan.recompute()`` on a model with batch norm under ``strategy``,
  against the same plan without recompute under the same strategy: the
  weights and the moving statistics after STEPS steps."""
  weights = {}
  for recompute in (False, True):
    with strategy.scope():
      model = K.Sequential([
          K.Input((4,)),
          K.layers.Dense(8, activation="tanh", name="l1"),
          K.layers.BatchNormalization(name="bn", momentum=0.5),
          K.layers.Dense(8, activation="tanh", name="l2"),
          K.layers.Dense(3, name="l3")])
      start = initial_weights()
      model.set_weights(start[:2] + [np.ones(8, np.float32),
                                     np.zeros(8, np.float32),
                                     np.zeros(8, np.float32),
                                     np.ones(8, np.float32)] + start[2:])
      plan = gg.KerasPlan(model)
      if recompute:
        plan.recompute()
      opt = K.optimizers.SGD(LR)

    def step(x, y, plan=plan, model=model, opt=opt):
      with plan.tape() as tape:
        per = tf.reduce_sum(tf.square(model(x, training=True) - y), axis=-1)
        loss = tf.nn.compute_average_loss(per, global_batch_size=GLOBAL_BATCH)
      opt.apply_gradients(zip(tape.gradient(loss), model.trainable_variables))

    @tf.function
    def train(x, y, step=step):
      strategy.run(step, args=(x, y))

    xs, ys = data()
    for i in range(STEPS):
      train(local(xs[i]), local(ys[i]))
    weights[recompute] = [np.asarray(w) for w in model.get_weights()]
  moving = weights[True][4]  # bn's moving mean
  return {"flavour": K.__name__,
          "diff": max(float(np.max(np.abs(a - b)))
                      for a, b in zip(weights[False], weights[True])),
          "moving_mean_moved": float(np.max(np.abs(moving)))}


PRIVATE_CLIP = 0.5
PRIVATE_SIGMA = 1.0
PRIVATE_DRAWS = 20


def private_case(gg, K, strategy, local):
  """DP-SGD under ``strategy``: the summed replica gradients, noise-free,
  against one device with the global batch; and the noise's std over
  ``PRIVATE_DRAWS`` noised steps, against ``sigma C / B_global``."""
  xs, ys = data()

  def grads_fn(plan, model):
    def fn(x, y):
      with plan.tape() as tape:
        loss = tf.reduce_sum(tf.square(model(x) - y), axis=-1)
      return tape.gradient(loss)
    return fn

  def summed(sigma):
    with strategy.scope():
      model = make_model(K)
      plan = gg.KerasPlan(model).privatize(PRIVATE_CLIP, sigma, seed=5)
    fn = grads_fn(plan, model)

    @tf.function
    def step(x, y):
      per_replica = strategy.run(fn, args=(x, y))
      return [strategy.reduce(tf.distribute.ReduceOp.SUM, g, axis=None)
              for g in per_replica]

    x, y = local(xs[0]), local(ys[0])
    return [[np.asarray(g) for g in step(x, y)]
            for _ in range(1 if sigma == 0 else PRIVATE_DRAWS)]

  clean = summed(0.0)[0]
  model = make_model(K)
  plan = gg.KerasPlan(model).privatize(PRIVATE_CLIP, 0.0)
  ref = [np.asarray(g) for g in grads_fn(plan, model)(
      tf.constant(xs[0]), tf.constant(ys[0]))]
  noise = np.concatenate([np.concatenate([(g - c).ravel()
                                          for g, c in zip(draw, clean)])
                          for draw in summed(PRIVATE_SIGMA)])
  return {"flavour": K.__name__,
          "diff": max(float(np.max(np.abs(a - b)))
                      for a, b in zip(clean, ref)),
          "size": max(float(np.max(np.abs(r))) for r in ref),
          "noise_std": float(noise.std()),
          "expected_std": PRIVATE_SIGMA * PRIVATE_CLIP / GLOBAL_BATCH}


def clipped_mean(weights, x, y, w, clip):
  """numpy, by hand: ``(1/B) sum_i clip_C(grad l_i)`` for make_model's
  network, ``l_i = w_i * mean_j (pred_ij - y_ij)^2`` (the compiled MSE with
  sample weights), each example's gradient over all variables together."""
  w1, b1, w2, b2, w3, b3 = [v.astype(np.float64) for v in weights]
  x, y, w = (a.astype(np.float64) for a in (x, y, w))
  h1 = np.tanh(x @ w1 + b1)
  h2 = np.tanh(h1 @ w2 + b2)
  d3 = w[:, None] * 2 * (h2 @ w3 + b3 - y) / y.shape[1]
  d2 = (d3 @ w3.T) * (1 - h2 ** 2)
  d1 = (d2 @ w2.T) * (1 - h1 ** 2)
  per = [np.einsum("bi,bj->bij", x, d1), d1, np.einsum("bi,bj->bij", h1, d2),
         d2, np.einsum("bi,bj->bij", h2, d3), d3]
  norms = np.sqrt(sum(np.sum(g.reshape(len(x), -1) ** 2, axis=1)
                      for g in per))
  c = np.minimum(1.0, clip / norms)
  return [np.tensordot(c, g, axes=1) / len(x) for g in per]


def private_fit_case(gg, K, strategy):
  """``model.fit`` with a private plan attached, under ``strategy``: with
  no noise, STEPS SGD steps on the global batches equal the numpy
  per-example reference on one device; with noise, each step's update less
  the reference's clean update at the same weights, over PRIVATE_DRAWS
  steps, has std ``sigma C / B_global`` (one draw per global batch)."""
  xs, ys = data()
  x, y = xs.reshape(-1, 4), ys.reshape(-1, 3)
  w = np.linspace(0.5, 1.5, len(x)).astype(np.float32)  # sample weights

  def fit(sigma, x, y, w, record=None):
    with strategy.scope():
      model = make_model(K)
      model.compile(optimizer=K.optimizers.SGD(LR), loss="mse")
    gg.KerasPlan(model).privatize(PRIVATE_CLIP, sigma, seed=5).attach()
    callbacks = [] if record is None else [K.callbacks.LambdaCallback(
        on_train_batch_end=lambda b, logs: record.append(model.get_weights()))]
    model.fit(x, y, sample_weight=w, batch_size=GLOBAL_BATCH, shuffle=False,
              epochs=1, verbose=0, callbacks=callbacks)
    return [np.asarray(v) for v in model.get_weights()]

  got = fit(0.0, x, y, w)
  ref = initial_weights()
  for i in range(STEPS):
    at = slice(i * GLOBAL_BATCH, (i + 1) * GLOBAL_BATCH)
    ref = [v - LR * g for v, g in zip(
        ref, clipped_mean(ref, x[at], y[at], w[at], PRIVATE_CLIP))]

  weights = [initial_weights()]
  tile = lambda a: np.concatenate([a[:GLOBAL_BATCH]] * PRIVATE_DRAWS)  # noqa
  fit(PRIVATE_SIGMA, tile(x), tile(y), tile(w), record=weights)
  draws = []
  for before, after in zip(weights, weights[1:]):
    clean = clipped_mean(before, x[:GLOBAL_BATCH], y[:GLOBAL_BATCH],
                         w[:GLOBAL_BATCH], PRIVATE_CLIP)
    draws.append(np.concatenate([((b - a) / LR - g).ravel() for b, a, g in
                                 zip(before, after, clean)]))
  noise = np.concatenate(draws)
  return {"flavour": K.__name__, "fit": True, "draws": len(draws),
          "diff": max(float(np.max(np.abs(a - b))) for a, b in zip(got, ref)),
          "size": min(float(np.max(np.abs(a - b)))
                      for a, b in zip(ref, initial_weights())),
          "noise_std": float(noise.std()),
          "noise_corr": float(np.corrcoef(draws[0], draws[1])[0, 1]),
          "expected_std": PRIVATE_SIGMA * PRIVATE_CLIP / GLOBAL_BATCH}


def summaries_case(gg, K, strategy, local, group, logdir):
  """plan.summaries() in a step of the replicas and on one device with the
  global batch: the largest relative difference of their figures, and how
  many values the replicas' step wrote per tag."""
  x, y = data()

  def step_of(plan, model):
    def step(x, y):
      with plan.tape() as tape:
        loss = loss_of(model, x, y)
      tape.gradient(loss)
      return plan.summaries(step=0)
    return step

  model = make_model(K)
  ref = tf.function(step_of(make_plan(gg, model, group), model))(
      tf.constant(x[0]), tf.constant(y[0]))
  with strategy.scope():
    model = make_model(K)
  step = step_of(make_plan(gg, model, group), model)
  writer = tf.summary.create_file_writer(logdir)

  @tf.function
  def run(x, y):
    with writer.as_default():
      return strategy.run(step, (x, y))

  got = run(local(x[0]), local(y[0]))
  writer.close()
  written = {}
  for path in tf.io.gfile.glob(os.path.join(logdir, "events.*")):
    for event in tf.compat.v1.train.summary_iterator(path):
      for v in event.summary.value:
        written[v.tag] = written.get(v.tag, 0) + 1
  diff = 0.0
  for tag, value in ref.items():
    mine = strategy.experimental_local_results(got[tag])[0]
    diff = max(diff, abs(float(mine) - float(value))
               / max(abs(float(value)), 1e-12))
  return {"group": group, "tags": sorted(ref), "diff": diff,
          "written": written}


def flavours():
  import keras  # pylint: disable=g-import-not-at-top
  cases = [(keras, "keras3")]
  if os.environ.get("TF_USE_LEGACY_KERAS") == "1":
    cases += [(tf.keras, "tf_keras"), (tf.keras, "legacy")]
  return cases


def run_cases(gg, mode, cases, strategy, local, replicas, out):
  """Trains the runs of ``cases``; writes their results to ``out``."""
  if cases == "rewrites":
    import keras  # pylint: disable=g-import-not-at-top
    runs = [(keras, "keras3", g) for g in ("scale", "value", "norm")]
  else:
    runs = [(K, kind, g) for K, kind in flavours() for g in ("clip", "global")]
  if cases == "summaries":
    import keras  # pylint: disable=g-import-not-at-top
    with open(out, "w", encoding="utf-8") as f:
      json.dump({"summaries": [
          summaries_case(gg, keras, strategy, local, group,
                         f"{out}.{group}.logs")
          for group in ("clip", "value")]}, f)
    return
  if cases == "private":
    with open(out, "w", encoding="utf-8") as f:
      json.dump({"replicas": replicas, "private": [
          private_case(gg, K, strategy, local) for K, kind in flavours()
          if kind != "legacy"], "fit": [
              private_fit_case(gg, K, strategy) for K, kind in flavours()
              if mode == "mirrored" and kind != "legacy"]}, f)
    return
  results = [compare(gg, K, kind, group, strategy, local, replicas)
             for K, kind, group in runs]
  fits, recomputes = [], []
  if mode == "mirrored" and cases == "rewrites":
    recomputes = [recompute_case(gg, K, strategy, local)
                  for K, kind in flavours() if kind != "legacy"]
  if mode == "mirrored" and cases == "transforms":
    fits = [fit_case(gg, K, strategy) for K, kind in flavours()
            if kind != "legacy"]
  with open(out, "w", encoding="utf-8") as f:
    json.dump({"replicas": replicas, "results": results, "fit": fits,
               "recompute": recomputes}, f)


def main():
  mode = sys.argv[1]
  if mode == "mirrored":
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
  import graphgrad as gg  # pylint: disable=g-import-not-at-top
  if mode == "mirrored":
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    replicas = 2

    def local(batch):
      half = GLOBAL_BATCH // replicas
      return strategy.experimental_distribute_values_from_function(
          lambda ctx: tf.constant(
              batch[ctx.replica_id_in_sync_group * half:][:half]))
  else:
    task = int(sys.argv[3])
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": json.loads(sys.argv[4])},
        "task": {"type": "worker", "index": task}})
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    replicas = strategy.num_replicas_in_sync
    half = GLOBAL_BATCH // replicas

    def local(batch):
      return tf.constant(batch[task * half:(task + 1) * half])
  if mode == "mirrored":
    pairs = list(zip(sys.argv[2::2], sys.argv[3::2]))
  else:
    pairs = [(sys.argv[2], "transforms"), (sys.argv[2] + ".private",
                                            "private")]
  for out, cases in pairs:
    run_cases(gg, mode, cases, strategy, local, replicas, out)


if __name__ == "__main__":
  main()
