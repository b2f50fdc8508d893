"""Suite: peak memory of a train step with and without ``plan.recompute()``.

Models: MLPs of depth 24, 48 and 96 (width 256, batch 4096), tf-slim's
ResNet-50 (batch 32) and an LSTM (``dynamic_rnn``). Variants:
``minimize()`` and ``GradientPlan(loss).recompute()`` (``keep=None``).

Each peak comes from a fresh process (``python -m benchmarks.memory
child MODEL VARIANT WARMUP``): it builds the model and the variant, runs
``WARMUP`` steps (the LSTM one, the others none), calls
``tf.config.experimental.reset_memory_stats("CPU:0")``, runs one step and
reads
``get_memory_info("CPU:0")["peak"]``. TensorFlow tracks the CPU allocator's
peak only with ``TF_CPU_ALLOCATOR_USE_BFC=true``, which the child sets.
Step time is measured side by side: one more fresh process per model holds
both variants' sessions and alternates their steps.
"""

import json
import logging
import os
import statistics
import subprocess
import sys
import time
from typing import Dict, List

import numpy as np

import benchmarks

log = logging.getLogger("graphgrad.benchmarks")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
VARIANTS = ("minimize", "recompute")
MLP_DEPTHS = (24, 48, 96)


def _build_model(name: str):
  """(loss, feed, analyze kwargs) of one model, in the default tf.Graph."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  from benchmarks import _models  # pylint: disable=g-import-not-at-top
  if name.startswith("mlp"):
    depth, width, batch = (int(p) for p in name[3:].split("x"))
    built = _models.mlp(depth, width=width, batch=batch)
    return built.loss, built.feed, {}
  if name == "lstm":
    built = _models.lstm()
    return built.loss, built.feed, {}
  if name.startswith("resnet50"):
    _alias_legacy_layers()
    from tf_slim.nets import resnet_v1  # pylint: disable=g-import-not-at-top
    batch, size = (int(p) for p in name[len("resnet50_"):].split("x"))
    tf1 = tf.compat.v1
    x = tf1.placeholder(tf.float32, [batch, size, size, 3])
    y = tf1.placeholder(tf.int32, [batch])
    import tf_slim as slim  # pylint: disable=g-import-not-at-top
    with slim.arg_scope(resnet_v1.resnet_arg_scope()):
      logits, _ = resnet_v1.resnet_v1_50(x, num_classes=10,
                                         is_training=True, global_pool=True)
    logits = tf.reshape(logits, [batch, 10])
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=y, logits=logits))
    rng = np.random.default_rng(0)
    feed = {x: rng.normal(size=(batch, size, size, 3)).astype(np.float32),
            y: rng.integers(0, 10, batch).astype(np.int32)}
    return loss, feed, {}
  raise ValueError(name)


def _alias_legacy_layers():
  """tf_slim 1.1 imports tf_keras.legacy_tf_layers, which tf-keras 2.16+
  keeps under tf_keras.src."""
  import importlib  # pylint: disable=g-import-not-at-top
  prefix = "tf_keras.src.legacy_tf_layers"
  sys.modules["tf_keras.legacy_tf_layers"] = importlib.import_module(prefix)
  for sub in ("base", "core", "convolutional", "normalization", "pooling"):
    sys.modules[f"tf_keras.legacy_tf_layers.{sub}"] = importlib.import_module(
        f"{prefix}.{sub}")


def _train_op(variant: str, loss):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  import graphgrad as gg  # pylint: disable=g-import-not-at-top
  opt = tf.compat.v1.train.GradientDescentOptimizer(1e-3)
  if variant == "minimize":
    update = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)
    with tf.control_dependencies(update):
      return opt.minimize(loss)
  return gg.GradientPlan(loss).recompute().apply_gradients(opt)


def child(model: str, variant: str, warmup: int) -> Dict:
  """One figure: build, warm up, reset the peak, one step, read the peak."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf1 = tf.compat.v1
  with tf.Graph().as_default():
    loss, feed, _ = _build_model(model)
    t0 = time.perf_counter()
    train = _train_op(variant, loss)
    build = time.perf_counter() - t0
    config = tf1.ConfigProto(intra_op_parallelism_threads=1,
                             inter_op_parallelism_threads=1)
    with tf1.Session(config=config) as sess:
      sess.run(tf1.global_variables_initializer())
      for _ in range(warmup):
        sess.run(train, feed)
      tf.config.experimental.reset_memory_stats("CPU:0")
      sess.run(train, feed)
      peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
  return {"peak_bytes": peak, "build_s": build}


def timing_child(model: str, steps: int) -> Dict:
  """Both variants' sessions in one process, steps alternating."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf1 = tf.compat.v1
  sessions = {}
  for variant in VARIANTS:
    g = tf.Graph()
    with g.as_default():
      loss, feed, _ = _build_model(model)
      train = _train_op(variant, loss)
      sess = tf1.Session(graph=g, config=tf1.ConfigProto(
          intra_op_parallelism_threads=1, inter_op_parallelism_threads=1))
      sess.run(tf1.global_variables_initializer())
      sess.run(train, feed)
      sessions[variant] = (sess, train, feed)
  samples: Dict[str, List[float]] = {v: [] for v in VARIANTS}
  ratios = []
  for rep in range(steps):
    order = VARIANTS if rep % 2 == 0 else VARIANTS[::-1]
    for variant in order:
      sess, train, feed = sessions[variant]
      t0 = time.process_time()
      sess.run(train, feed)
      samples[variant].append(time.process_time() - t0)
    ratios.append(samples["recompute"][-1] / samples["minimize"][-1])
  return {"step_cpu_s": samples, "step_ratio": ratios}


def _run_child(args: List[str], nice: bool = True) -> Dict:
  """Runs ``python -m benchmarks.memory ARGS``; ``nice``: at a lower
  priority (a full run; the tiny one, the test suite's smoke test, must not
  wait behind the other tests of a busy machine)."""
  env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true",
             TF_CPP_MIN_LOG_LEVEL="3", TF_USE_LEGACY_KERAS="1")
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  proc = subprocess.run(
      (["nice"] if nice else []) + [sys.executable, "-m", "benchmarks.memory"]
      + args, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
  if proc.returncode != 0:
    raise RuntimeError(f"benchmarks.memory {args}: {proc.stderr[-2000:]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _stats(xs) -> Dict[str, float]:
  return {"median": statistics.median(xs), "min": min(xs), "max": max(xs),
          "n": len(xs)}


def _cases(tiny: bool):
  """(model, label, depth or 0, fresh processes per figure, warm-up steps,
  timed steps)."""
  if tiny:
    return [("mlp4x32x64", "MLP depth 4, width 32, batch 64", 4, 1, 1, 2)]
  cases = [(f"mlp{d}x256x4096", f"MLP depth {d}, width 256, batch 4096", d,
            3, 0, 3) for d in MLP_DEPTHS]
  cases += [("resnet50_32x224", "tf-slim ResNet-50, batch 32, 224x224", 0,
             1, 0, 0),
            ("lstm", "LSTM (dynamic_rnn, LSTMCell(128), 40 steps, batch 64)",
             0, 3, 1, 4)]
  return cases


def run(config: benchmarks.Config) -> benchmarks.SuiteResult:
  rows = []
  for model, label, depth, reps, warmup, steps in _cases(config.tiny):
    if config.only and model not in config.only:
      continue
    log.info("memory: %s", model)
    row: Dict = {"model": model, "label": label, "depth": depth}
    reps = min(reps, config.reps)
    steps = min(steps, config.reps)
    for variant in VARIANTS:
      figures = [_run_child(["child", model, variant, str(warmup)],
                            nice=not config.tiny) for _ in range(reps)]
      row[variant] = {
          "peak_mb": _stats([f["peak_bytes"] / 2**20 for f in figures]),
          "build_s": _stats([f["build_s"] for f in figures])}
    row["memory_ratio"] = (row["minimize"]["peak_mb"]["median"]
                           / row["recompute"]["peak_mb"]["median"])
    if steps:
      t = _run_child(["time", model, str(steps)], nice=not config.tiny)
      row["step_ratio"] = _stats(t["step_ratio"])
      row["step_cpu_s"] = {v: _stats(t["step_cpu_s"][v]) for v in VARIANTS}
    rows.append(row)
  data = {"rows": rows}
  return benchmarks.SuiteResult(render(data, config.out_dir), data,
                                figures=[_plot(data, config.out_dir)])


def _plot(data: Dict, out_dir: str) -> str:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  rows = [r for r in data["rows"] if r["depth"]]
  path = os.path.join(out_dir, "memory.png")
  fig, ax = plt.subplots(figsize=(5, 3.5))
  for variant, label in (("minimize", "minimize()"),
                         ("recompute", "plan.recompute()")):
    ax.errorbar(
        [r["depth"] for r in rows],
        [r[variant]["peak_mb"]["median"] for r in rows],
        yerr=[[r[variant]["peak_mb"]["median"] - r[variant]["peak_mb"]["min"]
               for r in rows],
              [r[variant]["peak_mb"]["max"] - r[variant]["peak_mb"]["median"]
               for r in rows]], marker="o", label=label, capsize=3)
  ax.set_xlabel("MLP depth (width 256, batch 4096)")
  ax.set_ylabel("peak memory of a train step (MB)")
  ax.legend()
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def _r(s, fmt="{:.1f}") -> str:
  return (f"{fmt.format(s['median'])} ({fmt.format(s['min'])}-"
          f"{fmt.format(s['max'])})")


def render(data: Dict, out_dir: str = ".") -> str:
  lines = ["## Saving memory: plan.recompute()", "",
           "Peak memory of one train step (`get_memory_info(\"CPU:0\")"
           "[\"peak\"]` after `reset_memory_stats`, BFC allocator), one fresh "
           "process per figure: median (min-max) over the processes. Step "
           "time: CPU time of one step, both variants' sessions side by side "
           "in one more fresh process, steps alternating; the ratio is the "
           "median (min-max) of the paired per-step ratios. Build time: "
           "`minimize()`, or `GradientPlan(loss).recompute()` + "
           "`apply_gradients` (analysis included). Plot: `memory.png`.", "",
           "| model | peak MB minimize() | peak MB recompute() | memory "
           "reduced | step x minimize() | build s minimize() | build s "
           "recompute() |",
           "|---|---|---|---|---|---|---|"]
  for r in data["rows"]:
    step = _r(r["step_ratio"], "{:.2f}x") if "step_ratio" in r else "-"
    lines.append(
        f"| {r['label']} | {_r(r['minimize']['peak_mb'])} "
        f"| {_r(r['recompute']['peak_mb'])} | **{r['memory_ratio']:.2f}x** "
        f"| {step} | {_r(r['minimize']['build_s'], '{:.2f}')} "
        f"| {_r(r['recompute']['build_s'], '{:.2f}')} |")
  lines.append("")
  return "\n".join(lines)


benchmarks.register("memory", run, order=60, render=render)


if __name__ == "__main__":
  logging.basicConfig(level=logging.WARNING)
  if sys.argv[1] == "child":
    print(json.dumps(child(sys.argv[2], sys.argv[3], int(sys.argv[4]))))
  elif sys.argv[1] == "time":
    print(json.dumps(timing_child(sys.argv[2], int(sys.argv[3]))))
