"""Suite: the cost of ``plan.privatize`` (DP-SGD) against the plain step.

Models (``benchmarks/_privacy_models.py``, the same weights on both plans,
each at its own batch size unless ``--batch``): a 6x512 MLP and a 3x3 conv
net (batch 256), TF Privacy's MNIST tutorial convnet and a small BERT
(batch 128). Variants, each against its own plan's plain step:

* ``minimize``: ``opt.minimize(mean loss)`` in a Session (GradientPlan), a
  ``GradientTape`` step in a ``tf.function`` (KerasPlan); no privacy;
* ``privatize``: the plan with ``privatize(1.0, 1.1)`` (ghost norms,
  book-keeping sums, one noise draw);
* ``clip_only``: ``noise_multiplier=0``, the cost of the clipping alone;
* ``vectorized`` (GradientPlan, on request): ``tf.vectorized_map`` of
  per-example gradients, clipped, summed, noised;
* ``philox_bits``, ``noise_only`` (GradientPlan, on request): the plain
  step and, beside it, one 32-bit Philox word per parameter (what any
  exact Gaussian drawn with TensorFlow's generators consumes at least), or
  graphgrad's Gaussian noise for every variable: the noise's floor.

Step time: a fresh process per thread count (1 and 2 intra- and inter-op
threads); in it the variants alternate, the order rotating, and each
variant's step over the plain one is taken per repetition (paired). Peak
memory: a fresh seeded process per figure (``get_memory_info("CPU:0")
["peak"]`` after a warm-up step), ``--peak-reps`` per figure. With
``--others``, Opacus (hooks, ghost clipping) and JAX ``vmap`` run the same
models against their own plain steps, when installed (never in CI;
``--others-python`` names an interpreter that has them).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional

from benchmarks import _privacy_models

VARIANTS = ("minimize", "privatize", "clip_only")
FLOORS = ("philox_bits", "noise_only")  # timed only
GRAPH_ONLY = ("vectorized",) + FLOORS
MODELS = _privacy_models.MODELS
PLANS = ("graph", "keras")
CLIP, SIGMA = 1.0, 1.1


def _graph_train_op(variant: str, loss, batch: int):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  import graphgrad as gg  # pylint: disable=g-import-not-at-top
  tf1 = tf.compat.v1
  opt = tf1.train.GradientDescentOptimizer(1e-3)
  if variant == "minimize":
    return opt.minimize(tf.reduce_mean(loss))
  if variant in ("privatize", "clip_only"):
    sigma = SIGMA if variant == "privatize" else 0.0
    return gg.GradientPlan(loss).privatize(CLIP, sigma).apply_gradients(opt)
  if variant in ("philox_bits", "noise_only"):
    gv = opt.compute_gradients(tf.reduce_mean(loss))
    return opt.apply_gradients(zip(_with_draws(variant, [g for g, _ in gv]),
                                   [v for _, v in gv]))
  variables = tf1.trainable_variables()
  per = tf.vectorized_map(lambda i: tf.gradients(loss[i], variables),
                          tf.range(batch))
  norms = tf.sqrt(tf.add_n([tf.reduce_sum(tf.square(tf.reshape(
      g, [batch, -1])), axis=1) for g in per]))
  c = CLIP / tf.maximum(norms, CLIP)
  grads = [(tf.tensordot(c, g, axes=1) + tf.random.normal(
      g.shape[1:], stddev=SIGMA * CLIP)) / batch for g in per]
  return opt.apply_gradients(zip(grads, variables))


def _with_draws(variant: str, grads) -> list:
  """The noise's floor: each gradient plus graphgrad's Gaussian noise
  (``noise_only``), or plus one element of a draw of one 32-bit Philox
  word per parameter, times a zero the optimizers cannot see
  (``philox_bits``); a new seed each step. (A draw nothing reads would be
  pruned.)"""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  from graphgrad.core import _privacy  # pylint: disable=g-import-not-at-top
  step = tf.compat.v1.train.get_or_create_global_step()
  seed = tf.stack([tf.constant(7, tf.int64), step.assign_add(1)])
  zero = tf.compat.v1.placeholder_with_default(0.0, [])
  out = []
  for j, g in enumerate(grads):
    seed_j = seed + tf.constant([j, 0], tf.int64)
    if variant == "noise_only":
      out.append(g + _privacy.gaussian(g.shape, seed_j, stddev=SIGMA * CLIP))
    else:
      bits = tf.random.stateless_uniform(
          [g.shape.num_elements()], seed_j, minval=None, maxval=None,
          dtype=tf.uint32)
      out.append(g + tf.cast(bits[0], tf.float32) * zero)
  return out


def graph_step(model: str, variant: str, batch: int, threads: int
               ) -> Callable[[], None]:
  """One training step of ``variant`` in its own tf.Graph and Session."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf1 = tf.compat.v1
  graph = tf.Graph()
  with graph.as_default():
    loss, x, y = _privacy_models.graph_loss(model, batch)
    train = _graph_train_op(variant, loss, batch)
    init = tf1.global_variables_initializer()
  sess = tf1.Session(graph=graph, config=tf1.ConfigProto(
      intra_op_parallelism_threads=threads,
      inter_op_parallelism_threads=threads))
  sess.run(init)
  xs, ys = _privacy_models.data(model, batch)
  feed = {x: xs, y: ys}
  return lambda: sess.run(train, feed)


# -- KerasPlan: a Keras 3 model and a traced step per variant ------------------


def keras_step(model: str, variant: str, batch: int) -> Callable[[], None]:
  """One traced training step of ``variant`` on its own Keras model."""
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  import graphgrad as gg  # pylint: disable=g-import-not-at-top
  net = _privacy_models.keras_model(model)
  opt = keras.optimizers.SGD(1e-3)
  opt.build(net.trainable_variables)
  plan = None
  if variant != "minimize":
    sigma = SIGMA if variant == "privatize" else 0.0
    plan = gg.KerasPlan(net).privatize(CLIP, sigma)

  def per_example(x, y):
    return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                          logits=net(x))

  @tf.function
  def step(x, y):
    if plan is None:
      with tf.GradientTape() as tape:
        loss = tf.reduce_mean(per_example(x, y))
      grads = tape.gradient(loss, net.trainable_variables)
    else:
      with plan.tape() as tape:
        loss = per_example(x, y)
      grads = tape.gradient(loss)
    opt.apply_gradients(zip(grads, net.trainable_variables))

  xs, ys = (tf.constant(a) for a in _privacy_models.data(model, batch))
  return lambda: step(xs, ys)


def _set_threads(threads: int) -> None:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf.config.threading.set_intra_op_parallelism_threads(threads)
  tf.config.threading.set_inter_op_parallelism_threads(threads)


def _stats(xs: List[float]) -> Dict[str, float]:
  return {"median": statistics.median(xs), "min": min(xs), "max": max(xs),
          "n": len(xs)}


def paired(steps: Dict[str, Callable[[], None]], reps: int,
           target_s: float = 0.5) -> Dict:
  """Alternating, rotating repetitions; ratios to ``minimize`` per rep."""
  names = list(steps)
  k = {}
  for v, fn in steps.items():  # trace, warm up, then steps per sample
    for _ in range(2):
      fn()
    t = time.perf_counter()
    fn()
    k[v] = max(1, round(target_s / (time.perf_counter() - t)))
  samples: Dict[str, List[float]] = {v: [] for v in names}
  for r in range(reps):
    for v in names[r % len(names):] + names[:r % len(names)]:
      n = k[v]
      t = time.perf_counter()
      for _ in range(n):
        steps[v]()
      samples[v].append((time.perf_counter() - t) / n)
  return {"step_s": {v: _stats(s) for v, s in samples.items()},
          "ratio": {v: _stats([a / b for a, b in zip(
              samples[v], samples["minimize"])]) for v in names},
          "steps_per_sample": k}


def batch_size(model: str, batch: Optional[int] = None) -> int:
  """``batch``, or the model's own batch size when ``None``."""
  return batch or _privacy_models.BATCH[model]


def time_child(threads: int, models, plans, variants,
               batch: Optional[int], reps: int) -> Dict:
  """Every (model, plan)'s paired step times, in this process."""
  _set_threads(threads)
  out: Dict = {}
  for model in models:
    b = batch_size(model, batch)
    for plan in plans:
      vs = [v for v in variants if plan == "graph" or v not in GRAPH_ONLY]
      if plan == "graph":
        steps = {v: graph_step(model, v, b, threads) for v in vs}
      else:
        steps = {v: keras_step(model, v, b) for v in vs}
      out[f"{model}/{plan}"] = {"batch": b, **paired(steps, reps)}
  return out


def peak_child(model: str, plan: str, variant: str, batch: int,
               threads: int) -> Dict:
  """One figure: a warm-up step, the peak reset, one step."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  _set_threads(threads)
  step = (graph_step(model, variant, batch, threads) if plan == "graph"
          else keras_step(model, variant, batch))
  step()
  tf.config.experimental.reset_memory_stats("CPU:0")
  step()
  return {"peak_bytes": tf.config.experimental.get_memory_info(
      "CPU:0")["peak"]}


def _child(*args, python: str = sys.executable) -> Dict:
  env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true",
             TF_CPP_MIN_LOG_LEVEL="3", PYTHONHASHSEED="0")
  out = subprocess.run([python, "-m", "benchmarks.privacy",
                        *map(str, args)],
                       env=env, capture_output=True, text=True, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> Dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("cmd", nargs="?", default="run",
                      choices=["run", "time", "peak", "others"])
  parser.add_argument("args", nargs="*")
  parser.add_argument("--reps", type=int, default=9)
  parser.add_argument("--peak-reps", type=int, default=3)
  parser.add_argument("--batch", type=int, default=None,
                      help="every model's batch size (default: each "
                           "model's own, _privacy_models.BATCH)")
  parser.add_argument("--threads", default="1,2")
  parser.add_argument("--models", default=",".join(MODELS))
  parser.add_argument("--plans", default=",".join(PLANS))
  parser.add_argument("--variants", default=",".join(VARIANTS),
                      help="minimize first; add any of GRAPH_ONLY for "
                           "GradientPlan")
  parser.add_argument("--others", action="store_true",
                      help="also Opacus and JAX, where installed")
  parser.add_argument("--others-python", default=sys.executable,
                      help="the interpreter that has Opacus and JAX")
  parser.add_argument("--out", default=None)
  parser.add_argument("--tag", default="",
                      help="store as <model>/<plan>-<tag>/<threads>")
  parser.add_argument("--update", action="store_true",
                      help="keep the figures in --out that this run does "
                           "not make (such as the --others ones)")
  a = parser.parse_args(argv)
  models, plans = a.models.split(","), a.plans.split(",")
  variants = a.variants.split(",")
  if a.cmd == "time":
    print(json.dumps(time_child(int(a.args[0]), models, plans, variants,
                                a.batch, a.reps)))
    return {}
  if a.cmd == "peak":
    model, plan, variant, batch, threads = a.args
    print(json.dumps(peak_child(model, plan, variant, int(batch),
                                int(threads))))
    return {}
  if a.cmd == "others":
    from benchmarks import _privacy_others  # pylint: disable=g-import-not-at-top
    print(json.dumps(_privacy_others.run(int(a.args[0]), models, a.batch,
                                         a.reps)))
    return {}
  batch_flag = ["--batch", a.batch] if a.batch else []
  results: Dict = {"batch": {m: batch_size(m, a.batch) for m in models},
                   "clip": CLIP, "sigma": SIGMA}
  for threads in map(int, a.threads.split(",")):
    timing = _child("time", threads, "--reps", a.reps, *batch_flag,
                    "--models", a.models, "--plans", a.plans,
                    "--variants", a.variants)
    for key, res in timing.items():
      model, plan = key.split("/")
      peaks = {v: [_child("peak", model, plan, v, res["batch"], threads)
                   ["peak_bytes"] for _ in range(a.peak_reps)]
               for v in res["ratio"] if v not in FLOORS and a.peak_reps}
      res["peak_ratio"] = {}
      if peaks:
        base = statistics.median(peaks["minimize"])
        res["peak_bytes"] = {v: _stats(p) for v, p in peaks.items()}
        res["peak_ratio"] = {v: statistics.median(p) / base
                             for v, p in peaks.items()}
      results[f"{key}{'-' + a.tag if a.tag else ''}/{threads}"] = res
      for v in list(res["ratio"])[1:]:
        r = res["ratio"][v]
        peak = res["peak_ratio"].get(v)
        print(f"{model} {plan} {threads} thread(s) {v}: step / plain "
              f"{r['median']:.2f}x [{r['min']:.2f}, {r['max']:.2f}]"
              + (f", peak / plain {peak:.2f}x" if peak else ""), flush=True)
    if a.others:
      others = _child("others", threads, "--reps", a.reps, *batch_flag,
                      "--models", a.models,
                      python=a.others_python)
      for key, res in others.items():
        results[f"{key}/{threads}"] = res
        for v, r in list(res["ratio"].items())[1:]:
          print(f"{key.replace('/', ' ')} {threads} thread(s) {v}: step / "
                f"plain {r['median']:.2f}x [{r['min']:.2f}, {r['max']:.2f}]",
                flush=True)
  if a.out:
    if a.update and os.path.exists(a.out):
      with open(a.out) as f:
        old = json.load(f)
      kept = old.get("batch", {})
      if not isinstance(kept, dict):  # one batch size for every model
        kept = {k.split("/")[0]: kept for k in old if "/" in k}
      results = {**old, **results, "batch": {**kept, **results["batch"]}}
    with open(a.out, "w") as f:
      json.dump(results, f, indent=1, sort_keys=True)
  return results


if __name__ == "__main__":
  main()
