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


def make_step(keras, variant: str, width: int, depth: int, inputs: int):
  """A traced training step for one variant, on its own model copy."""
  model = _model(keras, width, depth, inputs)
  optimizer = keras.optimizers.SGD(0.001)
  optimizer.build(model.trainable_variables)
  plan = None if variant == "plain" else _plan(model, variant)

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


def _suite(config):
  """The TF2 step benchmark as a section of benchmarks/RESULTS.md."""
  reps = max(config.reps, 15)
  times, ops = run(reps=reps)
  markdown = "\n".join([
      "## TF2: KerasPlan step against a plain tape.gradient step",
      "",
      f"`python -m benchmarks.keras_step`: a `tf.function` training step of "
      f"a Keras 3 MLP 4x256, batch 256, {reps} alternating repetitions of 20 "
      f"steps; each ratio pairs a variant with the plain step of the same "
      f"repetition. Target: identity <= 1.05x.",
      ""] + _table(times, ops) + [""])
  return benchmarks.SuiteResult(markdown=markdown, data={
      "times": times, "ops": ops})


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
