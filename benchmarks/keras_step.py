"""Cost of a KerasPlan training step against a plain GradientTape step.

Times one ``tf.function`` training step (forward, gradients, SGD update) of
a Keras 3 MLP four ways, in alternating repetitions so that machine noise
hits every variant alike. It prints the median time per step, and the
median over repetitions of each variant's time divided by the plain step's
time in the same repetition (paired, so that slow drifts of a shared
machine cancel). It also prints how many ops each traced step has:

* ``plain``: ``tf.GradientTape`` and ``tape.gradient``;
* ``identity``: a KerasPlan whose transforms are all ``identity()`` (it
  intercepts nothing, so the traced graph is the plain one);
* ``forced``: a KerasPlan with ``lambda g: g`` upstream transforms, which
  graphgrad cannot tell from real ones: the cost of the interception itself;
* ``transformed``: upstream ``scale`` on two layers, ``clip_by_norm`` on one
  layer's parameter gradients.

Usage::

  python -m benchmarks.keras_step [--reps 31] [--steps 20] [--batch 256]
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import benchmarks  # noqa: E402
import graphgrad as gg  # noqa: E402

VARIANTS = ("plain", "identity", "forced", "transformed")


def _model(keras, width: int, depth: int, inputs: int):
  inp = keras.Input((inputs,))
  h = inp
  for i in range(depth):
    h = keras.layers.Dense(width, activation="relu", name=f"dense_{i}")(h)
  return keras.Model(inp, keras.layers.Dense(10, name="logits")(h))


def _plan(model, variant: str):
  plan = gg.KerasPlan(model)
  mid = f"dense_{len(model.layers) // 2 - 1}"
  if variant == "identity":
    plan.transform_upstream("logits", gg.transforms.identity())
    plan.transform_upstream(mid, gg.transforms.identity())
  elif variant == "forced":
    plan.transform_upstream("logits", lambda g: g)
    plan.transform_upstream(mid, lambda g: g)
  else:
    plan.transform_upstream("logits", gg.transforms.scale(0.5))
    plan.transform_upstream(mid, gg.transforms.scale(2.0))
    plan.transform_gradients("logits", gg.transforms.clip_by_norm(1.0))
  return plan


def _traced_step(model, optimizer, plan):
  """A traced SGD step: a plain tape without ``plan``, else the plan's tape."""

  def loss_of(x, y):
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=y, logits=model(x)))

  @tf.function
  def step(x, y):
    if plan is None:
      with tf.GradientTape() as tape:
        loss = loss_of(x, y)
      grads = tape.gradient(loss, model.trainable_variables)
    else:
      with plan.tape() as tape:
        loss = loss_of(x, y)
      grads = tape.gradient(loss)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss

  return step


def make_step(keras, variant: str, width: int, depth: int, inputs: int):
  """A traced training step for one variant, on its own model copy."""
  model = _model(keras, width, depth, inputs)
  optimizer = keras.optimizers.SGD(0.001)
  optimizer.build(model.trainable_variables)
  plan = None if variant == "plain" else _plan(model, variant)
  return _traced_step(model, optimizer, plan)


def op_count(step, x, y) -> int:
  """Ops in the traced graph of ``step``."""
  return len(step.get_concrete_function(x, y).graph.get_operations())


def run(reps: int = 31, steps: int = 20, batch: int = 256, width: int = 256,
        depth: int = 4, inputs: int = 64):
  """Returns ``({variant: [s/step per repetition]}, {variant: op count})``."""
  import keras  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  x = tf.constant(rng.normal(size=(batch, inputs)).astype(np.float32))
  y = tf.constant(rng.integers(0, 10, batch).astype(np.int32))
  fns = {v: make_step(keras, v, width, depth, inputs) for v in VARIANTS}
  for fn in fns.values():  # trace and warm up
    for _ in range(3):
      fn(x, y).numpy()
  times = {v: [] for v in VARIANTS}
  for r in range(reps):
    order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
    for v in order:
      start = time.perf_counter()
      for _ in range(steps):
        loss = fns[v](x, y)
      loss.numpy()
      times[v].append((time.perf_counter() - start) / steps)
  return times, {v: op_count(fn, x, y) for v, fn in fns.items()}


def _table(times, ops) -> list:
  rows = [f"| {'variant'} | ms/step (median) | ratio to plain (median, paired) "
          f"| ops |", "| --- | --- | --- | --- |"]
  for v in VARIANTS:
    ratio = statistics.median(t / p for t, p in zip(times[v], times["plain"]))
    rows.append(f"| {v} | {1000 * statistics.median(times[v]):.3f} | "
                f"{ratio:.3f} | {ops[v]} |")
  return rows


# -- linear rewrites: one VJP ----------------------------------------------

LINEAR_VARIANTS = {
    "lstm": ("plain", "scale", "scale_cut", "clip_by_norm"),
    "mlp": ("plain", "scale_all", "scale_all_cut", "scale_clip_all"),
}


def _linear_model(keras, kind: str, depth: int):
  if kind == "lstm":  # 40 steps of 32 features, LSTM(128), batch 64
    inp = keras.Input((40, 32))
    h = keras.layers.Dense(128, activation="relu", name="rnn_in")(inp)
    h = keras.layers.LSTM(128, name="rnn")(h)
    return keras.Model(inp, keras.layers.Dense(10, name="head")(h))
  return _model(keras, 256, depth - 1, 256)


def _linear_plan(model, kind: str, variant: str):
  if variant == "plain":
    return None
  plan = gg.KerasPlan(model)
  if kind == "lstm":
    fn = (gg.transforms.clip_by_norm(1.0) if variant == "clip_by_norm"
          else gg.transforms.scale(0.5))
    return plan.transform_upstream("rnn", _unfused(fn, variant))
  for layer in model.layers[2:]:  # every boundary: all but the first Dense
    plan.transform_upstream(layer.name, _unfused(gg.transforms.chain(
        gg.transforms.scale(0.5), gg.transforms.clip_by_value(-1.0, 1.0))
        if variant == "scale_clip_all" else gg.transforms.scale(0.5),
        variant))
  return plan


def _unfused(fn, variant: str):
  """``fn``, or for a ``*_cut`` variant the same rewrite as a plain callable
  with no linear factor, which the plan calls on the gradient."""
  return (lambda g: fn(g)) if variant.endswith("_cut") else fn


def make_linear_step(keras, kind: str, variant: str, depth: int = 0):
  """A traced SGD step of the LSTM or MLP for one linear-rewrite variant."""
  model = _linear_model(keras, kind, depth)
  optimizer = keras.optimizers.SGD(0.001)
  optimizer.build(model.trainable_variables)
  plan = _linear_plan(model, kind, variant)
  return _traced_step(model, optimizer, plan)


def run_linear(kind: str, depth: int = 0, reps: int = 15,
               target_s: float = 0.25):
  """Paired CPU time per step of each variant; returns (stats, ops)."""
  import keras  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  batch = 64 if kind == "lstm" else 128
  shape = (batch, 40, 32) if kind == "lstm" else (batch, 256)
  x = tf.constant(rng.normal(size=shape).astype(np.float32))
  y = tf.constant(rng.integers(0, 10, batch).astype(np.int32))
  variants = LINEAR_VARIANTS[kind]
  fns = {v: make_linear_step(keras, kind, v, depth) for v in variants}
  for fn in fns.values():  # trace and warm up
    for _ in range(2):
      fn(x, y).numpy()
  start = time.perf_counter()
  fns["plain"](x, y).numpy()
  k = max(1, int(target_s / max(time.perf_counter() - start, 1e-6)))
  cpu = {v: [] for v in variants}
  for r in range(reps):
    for v in variants[r % len(variants):] + variants[:r % len(variants)]:
      c = time.process_time()
      for _ in range(k):
        loss = fns[v](x, y)
      loss.numpy()
      cpu[v].append((time.process_time() - c) / k)
  stats = {}
  for v in variants:
    ratios = [a / b for a, b in zip(cpu[v], cpu["plain"])]
    stats[v] = {"median": statistics.median(ratios), "min": min(ratios),
                "max": max(ratios), "cpu_s": statistics.median(cpu[v])}
  return stats, {v: op_count(fn, x, y) for v, fn in fns.items()}


def _linear_rows(config) -> list:
  rows = ["", "### KerasPlan: linear upstream rewrites, one VJP", "",
          "Paired CPU time per `tf.function` step against the plain tape "
          "step of the same repetition: median (min-max). `_cut`: the same "
          "plan forced through the two-VJP path.", "",
          "| model | variant | ms CPU/step | step x plain | ops traced |",
          "| --- | --- | --- | --- | --- |"]
  reps = max(config.reps, 9)
  data = {}
  for kind, depth, label in (("lstm", 0, "LSTM(128), 40 steps, batch 64"),
                             ("mlp", 32, "MLP 32x256, batch 128"),
                             ("mlp", 128, "MLP 128x256, batch 128")):
    stats, ops = run_linear(kind, depth, reps)
    data[label] = {"stats": stats, "ops": ops}
    for v, s in stats.items():
      rows.append(f"| {label} | {v} | {1000 * s['cpu_s']:.2f} | "
                  f"{s['median']:.3f}x ({s['min']:.3f}-{s['max']:.3f}) | "
                  f"{ops[v]} |")
  return rows, data


def _suite(config):
  """The TF2 step benchmark as a section of benchmarks/RESULTS.md."""
  reps = max(config.reps, 15)
  times, ops = run(reps=reps)
  linear_rows, linear_data = _linear_rows(config)
  markdown = "\n".join([
      "## TF2: KerasPlan step against a plain tape.gradient step",
      "",
      f"`python -m benchmarks.keras_step`: a `tf.function` training step of "
      f"a Keras 3 MLP 4x256, batch 256, {reps} alternating repetitions of 20 "
      f"steps; each ratio pairs a variant with the plain step of the same "
      f"repetition. Target: identity <= 1.05x.",
      ""] + _table(times, ops) + linear_rows + [""])
  return benchmarks.SuiteResult(markdown=markdown, data={
      "times": times, "ops": ops, "linear": linear_data})


benchmarks.register("keras_step", _suite, order=80, in_tiny=False)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--reps", type=int, default=31)
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--batch", type=int, default=256)
  parser.add_argument("--width", type=int, default=256)
  parser.add_argument("--depth", type=int, default=4)
  args = parser.parse_args(argv)
  times, ops = run(args.reps, args.steps, args.batch, args.width,
                   args.depth)
  print(f"tf.function training step, Keras 3 MLP {args.depth}x{args.width}, "
        f"batch {args.batch}; medians of {args.reps} alternating repetitions "
        f"of {args.steps} steps")
  print(f"{'variant':<12} {'ms/step':>9} {'ratio':>7} {'ops':>6}")
  for v in VARIANTS:
    ratio = statistics.median(
        t / p for t, p in zip(times[v], times["plain"]))
    print(f"{v:<12} {1000 * statistics.median(times[v]):9.3f} {ratio:7.3f} "
          f"{ops[v]:6d}")


if __name__ == "__main__":
  main()
