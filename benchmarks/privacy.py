"""Suite: the cost of ``plan.privatize`` (DP-SGD) against ``minimize()``.

Models: a 6x512 MLP (ReLU, softmax cross-entropy, batch 256) and a conv net
(``conv2d`` + ``bias_add`` 3x3x16 SAME, 3x3x32 stride 2, dense 10; 28x28x1
inputs, batch 256). Variants, each in its own tf.Graph:

* ``minimize``: ``opt.minimize(mean loss)``, no privacy;
* ``privatize``: ``gg.GradientPlan(per-example loss).privatize(1.0, 1.1)
  .apply_gradients(opt)`` (ghost norms, book-keeping sums: no second
  backward pass);
* ``clip_only``: the same with ``noise_multiplier=0``: the cost of the
  clipping alone, without drawing the noise;
* ``vectorized``: per-example gradients with ``tf.vectorized_map`` over
  ``tf.gradients(loss[i], vars)``, clipped, summed, noised (the vectorized
  route of TF Privacy's optimizers).

Step time: the three sessions live in one process (one thread each) and
their steps alternate, the order rotating, so a slow spell of the shared
machine hits all alike; each sample is the mean of ``k`` steps, and the
ratio to ``minimize`` is taken per repetition. Peak memory: a fresh process
per (model, variant) with ``TF_CPU_ALLOCATOR_USE_BFC=true`` reads
``get_memory_info("CPU:0")["peak"]`` over one step after a warm-up step.

Run ``python -m benchmarks.privacy [--reps N] [--out FILE.json]``.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Dict, List

import numpy as np

VARIANTS = ("minimize", "privatize", "clip_only", "vectorized")
MODELS = ("mlp6x512", "convnet")
BATCH = 256


def _build(model: str):
  """(per-example loss, feed) in the default tf.Graph."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf1 = tf.compat.v1
  rng = np.random.default_rng(0)

  def dense(x, units, name):
    fan_in = int(x.shape[-1])
    with tf1.variable_scope(name):
      w = tf1.get_variable("kernel", initializer=(rng.normal(
          size=(fan_in, units)) * np.sqrt(2.0 / fan_in)).astype(np.float32))
      b = tf1.get_variable("bias", [units],
                           initializer=tf1.zeros_initializer())
    return tf.nn.bias_add(tf.matmul(x, w), b)

  def conv(x, channels, stride, name):
    cin = int(x.shape[-1])
    with tf1.variable_scope(name):
      k = tf1.get_variable("kernel", initializer=(rng.normal(
          size=(3, 3, cin, channels)) * np.sqrt(2.0 / (9 * cin))
      ).astype(np.float32))
      b = tf1.get_variable("bias", [channels],
                           initializer=tf1.zeros_initializer())
    return tf.nn.relu(tf.nn.bias_add(
        tf.nn.conv2d(x, k, stride, "SAME"), b))

  y = tf1.placeholder(tf.int32, [BATCH])
  if model == "mlp6x512":
    x = tf1.placeholder(tf.float32, [BATCH, 512])
    h = x
    for i in range(5):
      h = tf.nn.relu(dense(h, 512, f"l{i}"))
    logits = dense(h, 10, "l5")
    xs = rng.normal(size=(BATCH, 512)).astype(np.float32)
  elif model == "convnet":
    x = tf1.placeholder(tf.float32, [BATCH, 28, 28, 1])
    h = conv(conv(x, 16, 1, "c1"), 32, 2, "c2")
    logits = dense(tf.reshape(h, [BATCH, 14 * 14 * 32]), 10, "out")
    xs = rng.normal(size=(BATCH, 28, 28, 1)).astype(np.float32)
  else:
    raise ValueError(model)
  loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                        logits=logits)
  return loss, {x: xs, y: rng.integers(0, 10, BATCH).astype(np.int32)}


def _train_op(variant: str, loss, clip=1.0, sigma=1.1):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  import graphgrad as gg  # pylint: disable=g-import-not-at-top
  tf1 = tf.compat.v1
  opt = tf1.train.GradientDescentOptimizer(1e-3)
  if variant == "minimize":
    return opt.minimize(tf.reduce_mean(loss))
  if variant in ("privatize", "clip_only"):
    noise = sigma if variant == "privatize" else 0.0
    return gg.GradientPlan(loss).privatize(clip, noise).apply_gradients(opt)
  variables = tf1.trainable_variables()
  per = tf.vectorized_map(lambda i: tf.gradients(loss[i], variables),
                          tf.range(BATCH))
  norms = tf.sqrt(tf.add_n([tf.reduce_sum(tf.square(tf.reshape(
      g, [BATCH, -1])), axis=1) for g in per]))
  c = clip / tf.maximum(norms, clip)
  grads = []
  for g in per:
    s = tf.tensordot(c, g, axes=1)
    grads.append((s + tf.random.normal(tf.shape(s), stddev=sigma * clip))
                 / BATCH)
  return opt.apply_gradients(zip(grads, variables))


def _config():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1,
                                  inter_op_parallelism_threads=1)


def peak_child(model: str, variant: str) -> Dict:
  """One figure: build, one warm-up step, reset the peak, one step."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf1 = tf.compat.v1
  with tf.Graph().as_default():
    loss, feed = _build(model)
    train = _train_op(variant, loss)
    with tf1.Session(config=_config()) as sess:
      sess.run(tf1.global_variables_initializer())
      sess.run(train, feed)
      tf.config.experimental.reset_memory_stats("CPU:0")
      sess.run(train, feed)
      peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
  return {"peak_bytes": peak}


def _stats(xs: List[float]) -> Dict[str, float]:
  return {"median": statistics.median(xs), "min": min(xs), "max": max(xs),
          "n": len(xs)}


def timing(model: str, reps: int, variants=VARIANTS, target_s: float = 1.0
           ) -> Dict:
  """Step times of the variants, alternating in one process."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf1 = tf.compat.v1
  runs = {}
  for v in variants:
    graph = tf.Graph()
    with graph.as_default():
      loss, feed = _build(model)
      t = time.perf_counter()
      train = _train_op(v, loss)
      build = time.perf_counter() - t
      sess = tf1.Session(graph=graph, config=_config())
      sess.run(tf1.global_variables_initializer())
    for _ in range(2):
      sess.run(train, feed)
    runs[v] = (sess, train, feed, build)
  sess, train, feed, _ = runs["minimize"]
  t = time.perf_counter()
  sess.run(train, feed)
  k = max(1, round(target_s / (time.perf_counter() - t)))
  samples: Dict[str, List[float]] = {v: [] for v in variants}
  for r in range(reps):
    order = list(variants[r % len(variants):] + variants[:r % len(variants)])
    for v in order:
      sess, train, feed, _ = runs[v]
      steps = k if v != "vectorized" else max(1, k // 8)
      t = time.perf_counter()
      for _ in range(steps):
        sess.run(train, feed)
      samples[v].append((time.perf_counter() - t) / steps)
  for sess, *_ in runs.values():
    sess.close()
  ratios = {v: _stats([a / b for a, b in zip(samples[v],
                                             samples["minimize"])])
            for v in variants}
  return {"step_s": {v: _stats(s) for v, s in samples.items()},
          "ratio_to_minimize": ratios,
          "build_s": {v: runs[v][3] for v in variants},
          "steps_per_sample": k}


def _peak(model: str, variant: str) -> int:
  env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true",
             TF_CPP_MIN_LOG_LEVEL="3")
  out = subprocess.run(
      [sys.executable, "-m", "benchmarks.privacy", "child", model, variant],
      env=env, capture_output=True, text=True, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])["peak_bytes"]


def main(argv=None) -> Dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("cmd", nargs="?", default="run")
  parser.add_argument("args", nargs="*")
  parser.add_argument("--reps", type=int, default=7)
  parser.add_argument("--models", default=",".join(MODELS))
  parser.add_argument("--variants", default=",".join(VARIANTS),
                      help="minimize first")
  parser.add_argument("--out", default=None)
  a = parser.parse_args(argv)
  if a.cmd == "child":
    print(json.dumps(peak_child(*a.args)))
    return {}
  results = {}
  variants = tuple(a.variants.split(","))
  for model in a.models.split(","):
    res = timing(model, a.reps, variants)
    res["peak_bytes"] = {v: _peak(model, v) for v in variants}
    base = res["peak_bytes"]["minimize"]
    res["peak_ratio"] = {v: p / base for v, p in res["peak_bytes"].items()}
    results[model] = res
    r = res["ratio_to_minimize"]
    for v in variants[1:]:
      print(f"{model} {v}: step / minimize() {r[v]['median']:.2f}x "
            f"[{r[v]['min']:.2f}, {r[v]['max']:.2f}], peak / minimize() "
            f"{res['peak_ratio'][v]:.2f}x", flush=True)
  if a.out:
    with open(a.out, "w") as f:
      json.dump(results, f, indent=1, sort_keys=True)
  return results


if __name__ == "__main__":
  main()
