"""A KerasPlan step under MirroredStrategy x2 against the same step without one.

Two logical CPU devices must be configured before TensorFlow runs an op, so
the measurement runs in a child process (``python -m benchmarks.mirrored``).
It times one ``tf.function`` step (``strategy.run``: forward, gradients, SGD
update) of a Keras 3 MLP (4 x 256, global batch 256) in alternating
repetitions:

* ``plain``: ``tf.GradientTape`` and ``tape.gradient``;
* ``plan``: a KerasPlan with ``transform_upstream(mid, scale(0.5))`` and
  ``transform_gradients("logits", clip_by_norm(1.0))``: the clip acts on the
  gradient summed over the replicas, which costs one more all-reduce of the
  logits layer's gradients.

Each sample is the mean step time over ``--steps`` steps, as wall time and
as the process's CPU time; ratios are paired per repetition (plan over
plain of the same repetition), then summarised by median, min and max.

Usage::

  python -m benchmarks.mirrored [--reps 15] [--steps 20] [--json OUT]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import benchmarks  # noqa: E402

VARIANTS = ("plain", "plan")
TARGET = 1.05


def _measure(reps: int, steps: int, batch: int = 256, width: int = 256,
             depth: int = 4, inputs: int = 64):
  """In this process: configures two CPU replicas and times both steps."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  cpu = tf.config.list_physical_devices("CPU")[0]
  tf.config.set_logical_device_configuration(
      cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
  import keras  # pylint: disable=g-import-not-at-top

  import graphgrad as gg  # pylint: disable=g-import-not-at-top
  strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])

  def make(variant):
    with strategy.scope():
      inp = keras.Input((inputs,))
      h = inp
      for i in range(depth):
        h = keras.layers.Dense(width, activation="relu", name=f"dense_{i}")(h)
      model = keras.Model(inp, keras.layers.Dense(10, name="logits")(h))
      opt = keras.optimizers.SGD(0.001)
    plan = None
    if variant == "plan":
      plan = (gg.KerasPlan(model)
              .transform_upstream(f"dense_{depth // 2 - 1}",
                                  gg.transforms.scale(0.5))
              .transform_gradients("logits", gg.transforms.clip_by_norm(1.0)))

    def replica_step(x, y):
      def loss_of():
        per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=model(x))
        return tf.nn.compute_average_loss(per_example,
                                          global_batch_size=batch)
      if plan is None:
        with tf.GradientTape() as tape:
          loss = loss_of()
        grads = tape.gradient(loss, model.trainable_variables)
      else:
        with plan.tape() as tape:
          loss = loss_of()
        grads = tape.gradient(loss)
      opt.apply_gradients(zip(grads, model.trainable_variables))
      return loss

    @tf.function
    def step(x, y):
      losses = strategy.run(replica_step, args=(x, y))
      return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    return step

  rng = np.random.default_rng(0)
  x = rng.normal(size=(batch, inputs)).astype(np.float32)
  y = rng.integers(0, 10, batch).astype(np.int32)
  half = batch // 2

  def local(a):
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(a[ctx.replica_id_in_sync_group * half:][:half]))

  xd, yd = local(x), local(y)
  fns = {v: make(v) for v in VARIANTS}
  for fn in fns.values():  # trace and warm up
    for _ in range(3):
      fn(xd, yd).numpy()
  times = {v: [] for v in VARIANTS}
  cpu_times = {v: [] for v in VARIANTS}
  for r in range(reps):
    order = VARIANTS[r % 2:] + VARIANTS[:r % 2]
    for v in order:
      start, cpu_start = time.perf_counter(), time.process_time()
      for _ in range(steps):
        loss = fns[v](xd, yd)
      loss.numpy()
      times[v].append((time.perf_counter() - start) / steps)
      cpu_times[v].append((time.process_time() - cpu_start) / steps)
  return times, cpu_times


def _stats(xs):
  return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def summarise(times, cpu_times):
  def paired(t):
    return _stats([p / q for p, q in zip(t["plan"], t["plain"])])
  return {"times": times, "cpu_times": cpu_times, "ratio": paired(times),
          "cpu_ratio": paired(cpu_times),
          "ms": {v: 1000 * statistics.median(t) for v, t in times.items()},
          "cpu_ms": {v: 1000 * statistics.median(t)
                     for v, t in cpu_times.items()}}


def render(data, out_dir=None) -> str:
  del out_dir
  r, c = data["ratio"], data["cpu_ratio"]
  verdict = "met" if c["median"] <= TARGET else "**missed**"
  return "\n".join([
      "## TF2: KerasPlan under MirroredStrategy x2",
      "",
      f"`python -m benchmarks.mirrored`: a `tf.function` step "
      f"(`strategy.run`) of a Keras 3 MLP 4x256, global batch 256, on two "
      f"logical CPU replicas, {len(data['times']['plan'])} alternating "
      f"repetitions of 20 steps. The plan: upstream `scale(0.5)` on "
      f"`dense_1`, `clip_by_norm(1.0)` on the logits layer's parameter "
      f"gradients (summed over the replicas first). Target: <= {TARGET}x "
      f"the same step without a plan, on the CPU-time ratio: {verdict}. "
      f"A sample is the mean step time over 20 steps, as wall time and as "
      f"the process's CPU time (all threads), which a busy shared machine "
      f"disturbs less; each ratio pairs the two variants of one "
      f"repetition.",
      "",
      "| variant | CPU ms/step | CPU ratio, paired: median (min-max) "
      "| wall ms/step | wall ratio, paired: median (min-max) |",
      "| --- | --- | --- | --- | --- |",
      f"| plain | {data['cpu_ms']['plain']:.2f} | 1.000 "
      f"| {data['ms']['plain']:.2f} | 1.000 |",
      f"| plan | {data['cpu_ms']['plan']:.2f} | {c['median']:.3f} "
      f"({c['min']:.3f}-{c['max']:.3f}) | {data['ms']['plan']:.2f} "
      f"| {r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f}) |",
      ""])


def _suite(config):
  reps = max(config.reps, 15)
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "mirrored.json")
    subprocess.run([sys.executable, "-m", "benchmarks.mirrored", "--reps",
                    str(reps), "--json", out], check=True,
                   cwd=os.path.dirname(os.path.dirname(os.path.abspath(
                       __file__))))
    with open(out, encoding="utf-8") as f:
      data = json.load(f)
  return benchmarks.SuiteResult(markdown=render(data), data=data)


benchmarks.register("mirrored", _suite, order=85, in_tiny=False,
                    render=render)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--reps", type=int, default=15)
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--json", help="write the numbers here")
  args = parser.parse_args(argv)
  data = summarise(*_measure(args.reps, args.steps))
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(data, f)
  r, c = data["ratio"], data["cpu_ratio"]
  print(f"MirroredStrategy x2, Keras 3 MLP 4x256, global batch 256; "
        f"{args.reps} alternating repetitions of {args.steps} steps")
  for what, key, ratio in (("CPU", "cpu_ms", c), ("wall", "ms", r)):
    print(f"{what}: plain {data[key]['plain']:.3f} ms/step, plan "
          f"{data[key]['plan']:.3f} ms/step; plan/plain paired median "
          f"{ratio['median']:.3f} (min {ratio['min']:.3f}, max "
          f"{ratio['max']:.3f})")


if __name__ == "__main__":
  main()
