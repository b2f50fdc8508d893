"""Cost of ``model.fit`` through an attached KerasPlan, and of loss scaling.

Paired CPU time per training step, each variant against its reference in
the same repetition (alternating order), median (min-max):

* ``fit`` with an identity plan, and with ``clip_by_norm`` upstream of
  every layer, against plain ``fit`` (Keras 3 MLP 4x256, batch 256);
* mixed precision: a ``tf.function`` step of a float16 plan with
  ``plan.tape(loss_scale=optimizer)`` against the same plan without it;
* the KerasPlan LSTM with an upstream ``scale`` (``keras_step``'s row).

Usage: ``python -m benchmarks --suites keras_fit``.
"""

import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import benchmarks  # noqa: E402
import graphgrad as gg  # noqa: E402
from benchmarks import keras_step  # noqa: E402

FIT_VARIANTS = ("plain", "identity", "clip_all")


def _fit_model(keras, variant):
  model = keras_step._model(keras, 256, 4, 64)  # pylint: disable=protected-access
  if variant != "plain":
    plan = gg.KerasPlan(model)
    for layer in model.layers[1:]:
      plan.transform_upstream(layer.name, (
          gg.transforms.identity() if variant == "identity"
          else gg.transforms.clip_by_norm(1.0)))
    plan.attach()
  model.compile(keras.optimizers.SGD(0.001),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True))
  return model


def _paired(fns, reps, steps):
  """CPU seconds per step of each variant, alternating per repetition."""
  names = list(fns)
  cpu = {v: [] for v in names}
  for r in range(reps):
    for v in names[r % len(names):] + names[:r % len(names)]:
      c = time.process_time()
      fns[v]()
      cpu[v].append((time.process_time() - c) / steps)
  return cpu


def _stats(cpu, ref):
  out = {}
  for v, ts in cpu.items():
    ratios = [a / b for a, b in zip(ts, cpu[ref])]
    out[v] = {"median": statistics.median(ratios), "min": min(ratios),
              "max": max(ratios), "cpu_s": statistics.median(ts)}
  return out


def run_fit(reps=9, batches=20, batch=256):
  import keras  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  x = rng.normal(size=(batches * batch, 64)).astype(np.float32)
  y = rng.integers(0, 10, batches * batch).astype(np.int32)
  models = {v: _fit_model(keras, v) for v in FIT_VARIANTS}
  for m in models.values():  # trace and warm up
    m.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)
  fns = {v: (lambda m=m: m.fit(x, y, batch_size=batch, epochs=1, verbose=0,
                               shuffle=False)) for v, m in models.items()}
  return _stats(_paired(fns, reps, batches), "plain")


def run_mixed(reps=9, steps=20):
  import keras  # pylint: disable=g-import-not-at-top
  keras.mixed_precision.set_global_policy("mixed_float16")
  try:
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(256, 64)).astype(np.float32))
    y = tf.constant(rng.integers(0, 10, 256).astype(np.int32))
    fns = {}
    for variant in ("none", "loss_scale"):
      model = keras_step._model(keras, 256, 4, 64)  # pylint: disable=protected-access
      opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.001))
      plan = gg.KerasPlan(model).transform_upstream(
          "logits", gg.transforms.clip_by_norm(1.0))
      arg = opt if variant == "loss_scale" else None

      @tf.function
      def step(model=model, opt=opt, plan=plan, arg=arg):
        with plan.tape(loss_scale=arg) as tape:
          logits = tf.cast(model(x), tf.float32)
          loss = tf.reduce_mean(
              tf.nn.sparse_softmax_cross_entropy_with_logits(
                  labels=y, logits=logits))
          scaled = opt.scale_loss(loss)
        opt.apply_gradients(tape.grads_and_vars(scaled))
        return loss

      step().numpy()

      def many(step=step):
        for _ in range(steps):
          loss = step()
        loss.numpy()
      fns[variant] = many
    return _stats(_paired(fns, reps, steps), "none")
  finally:
    keras.mixed_precision.set_global_policy("float32")


def _row(label, s, target):
  return (f"| {label} | {1000 * s['cpu_s']:.2f} | {s['median']:.3f}x "
          f"({s['min']:.3f}-{s['max']:.3f}) | {target} |")


def _suite(config):
  reps = max(config.reps, 9)
  fit = run_fit(reps)
  mixed = run_mixed(reps)
  lstm, _ = keras_step.run_linear("lstm", 0, reps)
  rows = [
      "## TF2: model.fit through an attached KerasPlan; loss scaling", "",
      f"Paired CPU time per step, {reps} alternating repetitions: median "
      f"(min-max) of the ratio to the reference of the same repetition. "
      f"fit: a Keras 3 MLP 4x256, batch 256, 20 batches per repetition.", "",
      "| row | ms CPU/step | ratio | target |", "| --- | --- | --- | --- |",
      _row("fit, identity plan / plain fit", fit["identity"], "<= 1.03x"),
      _row("fit, clip_by_norm upstream of every layer / plain fit",
           fit["clip_all"], "<= 1.10x"),
      _row("mixed_float16 step, plan.tape(loss_scale=opt) / no loss_scale",
           mixed["loss_scale"], "<= 1.03x"),
      _row("LSTM(128), upstream scale(0.5) / plain tape step", lstm["scale"],
           "<= 1.05x"), ""]
  return benchmarks.SuiteResult(markdown="\n".join(rows), data={
      "fit": fit, "mixed": mixed, "lstm": lstm})


benchmarks.register("keras_fit", _suite, order=85, in_tiny=False)
