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

Batch norm (``resnet50_8x112``, tf-slim's ``resnet_v1_50``): the TF1 idiom
(``minimize()`` under ``UPDATE_OPS``), the identity plan and
``recompute()``, at 1 and 2 threads, warm-up step first
(``child MODEL VARIANT WARMUP THREADS``). Keras (``keras MODEL VARIANT
THREADS``): a traced step with a plain ``tf.GradientTape``, the identity
``KerasPlan``, ``KerasPlan.recompute()`` and ``tf.recompute_grad`` around
blocks, on 48 ``Dense(256)`` layers and on bottleneck units with batch norm.
"""

import json
import logging
import os
import statistics
import subprocess
import sys
import time
from typing import Dict, List

import benchmarks

log = logging.getLogger("graphgrad.benchmarks")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
VARIANTS = ("minimize", "recompute")
MLP_DEPTHS = (24, 48, 96)
# Batch-norm models: the TF1 idiom (minimize after UPDATE_OPS), the identity
# plan and the plan with recompute, at 1 and 2 threads.
BN_VARIANTS = ("minimize", "identity", "recompute")
BN_THREADS = (1, 2)
# Keras models in tf.function: a plain tf.GradientTape, the identity
# KerasPlan, KerasPlan.recompute() and tf.recompute_grad around blocks.
KERAS_VARIANTS = ("tape", "plan", "recompute", "recompute_grad")


def _build_model(name: str):
  """(loss, feed, analyze kwargs) of one model, in the default tf.Graph."""

  from benchmarks import _models  # pylint: disable=g-import-not-at-top
  if name.startswith("mlp"):
    depth, width, batch = (int(p) for p in name[3:].split("x"))
    built = _models.mlp(depth, width=width, batch=batch)
    return built.loss, built.feed, {}
  if name == "lstm":
    built = _models.lstm()
    return built.loss, built.feed, {}
  if name.startswith("resnet50"):
    batch, size = (int(p) for p in name[len("resnet50_"):].split("x"))
    built = _models.slim_resnet(50, batch=batch, size=size)
    return built.loss, built.feed, {}
  raise ValueError(name)


def _train_op(variant: str, loss):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  import graphgrad as gg  # pylint: disable=g-import-not-at-top
  opt = tf.compat.v1.train.GradientDescentOptimizer(1e-3)
  if variant == "minimize":  # the TF1 idiom
    update = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)
    with tf.control_dependencies(update):
      return opt.minimize(loss)
  if variant == "identity":
    return gg.GradientPlan(loss).apply_gradients(opt)
  return gg.GradientPlan(loss).recompute().apply_gradients(opt)


def _session_config(threads: int):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf.config.threading.set_intra_op_parallelism_threads(threads)
  tf.config.threading.set_inter_op_parallelism_threads(threads)
  return tf.compat.v1.ConfigProto(intra_op_parallelism_threads=threads,
                                  inter_op_parallelism_threads=threads)


def child(model: str, variant: str, warmup: int, threads: int = 1) -> Dict:
  """One figure: build, warm up, reset the peak, one step, read the peak."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf1 = tf.compat.v1
  config = _session_config(threads)
  with tf.Graph().as_default():
    tf1.set_random_seed(0)
    loss, feed, _ = _build_model(model)
    t0 = time.perf_counter()
    train = _train_op(variant, loss)
    build = time.perf_counter() - t0
    with tf1.Session(config=config) as sess:
      sess.run(tf1.global_variables_initializer())
      for _ in range(warmup):
        sess.run(train, feed)
      tf.config.experimental.reset_memory_stats("CPU:0")
      sess.run(train, feed)
      peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
  return {"peak_bytes": peak, "build_s": build}


def timing_child(model: str, steps: int, threads: int = 1,
                 variants=VARIANTS) -> Dict:
  """The variants' sessions in one process, steps alternating."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf1 = tf.compat.v1
  sessions = {}
  config = _session_config(threads)
  for variant in variants:
    g = tf.Graph()
    with g.as_default():
      tf1.set_random_seed(0)
      loss, feed, _ = _build_model(model)
      train = _train_op(variant, loss)
      sess = tf1.Session(graph=g, config=config)
      sess.run(tf1.global_variables_initializer())
      sess.run(train, feed)
      sessions[variant] = (sess, train, feed)
  samples: Dict[str, List[float]] = {v: [] for v in variants}
  for rep in range(steps):
    order = variants if rep % 2 == 0 else variants[::-1]
    for variant in order:
      sess, train, feed = sessions[variant]
      t0 = time.process_time()
      sess.run(train, feed)
      samples[variant].append(time.process_time() - t0)
  ratios = {v: [a / b for a, b in zip(samples[v], samples["minimize"])]
            for v in variants}
  return {"step_cpu_s": samples, "step_ratio": ratios["recompute"],
          "step_ratios": ratios}


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


def _threads(config: benchmarks.Config):
  """Both thread counts; one in the tiny run, the test suite's smoke test,
  whose figures are not read (each is two more fresh processes)."""
  return BN_THREADS[:1] if config.tiny else BN_THREADS


def _cases(tiny: bool):
  """(model, label, depth or 0, fresh processes per figure, warm-up steps,
  timed steps)."""
  if tiny:
    return [("mlp4x32x64", "MLP depth 4, width 32, batch 64", 4, 1, 1, 2)]
  cases = [(f"mlp{d}x256x4096", f"MLP depth {d}, width 256, batch 4096", d,
            3, 0, 3) for d in MLP_DEPTHS]
  # The LSTM's peak lands on one of a few levels (about 15 to 23.5 MB) from
  # one process to the next, whatever the variant: seven processes per
  # figure (the default --reps); its median still follows the levels hit.
  cases += [("resnet50_32x224", "tf-slim ResNet-50, batch 32, 224x224", 0,
             1, 0, 0),
            ("lstm", "LSTM (dynamic_rnn, LSTMCell(128), 40 steps, batch 64)",
             0, 7, 1, 4)]
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
  data = {"rows": rows, "batch_norm": _batch_norm_rows(config),
          "keras": _keras_rows(config)}
  return benchmarks.SuiteResult(render(data, config.out_dir), data,
                                figures=[_plot(data, config.out_dir)])


# -- Keras: KerasPlan.recompute in a traced step -----------------------------

def _keras_model(name: str):
  """(model, blocks, x, y): ``blocks`` are the sub-models that
  ``tf.recompute_grad`` wraps; calling them in order is the model."""
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  K = keras
  keras.utils.set_random_seed(0)
  if name.startswith("kmlp"):
    depth, width, batch = (int(p) for p in name[4:].split("x"))
    per = max(1, round(depth ** 0.5))
    layers = [K.layers.Dense(width, activation="relu", name=f"d{i}")
              for i in range(depth)]
    blocks = [K.Sequential([K.Input((width,))] + layers[i:i + per],
                           name=f"block{i // per}")
              for i in range(0, depth, per)]
    blocks.append(K.Sequential([K.Input((width,)),
                                K.layers.Dense(1, name="out")], name="head"))
    x = tf.random.stateless_normal((batch, width), seed=(1, 2))
    y = tf.random.stateless_normal((batch, 1), seed=(3, 4))
  else:  # kresnet<units>x<size>x<batch>: bottleneck units with batch norm
    units, size, batch = (int(p) for p in name[7:].split("x"))
    width = 64

    def unit(i):
      inp = K.Input((size, size, width))
      h = inp
      for j, (f, k) in enumerate(((width // 2, 1), (width // 2, 3),
                                  (width, 1))):
        h = K.layers.Conv2D(f, k, padding="same", use_bias=False)(h)
        h = K.layers.BatchNormalization()(h)
        if j < 2:
          h = K.layers.ReLU()(h)
      out = K.layers.ReLU()(K.layers.Add()([inp, h]))
      return K.Model(inp, out, name=f"unit{i}")

    stem_in = K.Input((size, size, 3))
    stem = K.Model(stem_in, K.layers.ReLU()(K.layers.BatchNormalization()(
        K.layers.Conv2D(width, 3, padding="same", use_bias=False)(stem_in))),
                   name="stem")
    head_in = K.Input((size, size, width))
    head = K.Model(head_in, K.layers.Dense(10)(
        K.layers.GlobalAveragePooling2D()(head_in)), name="head")
    blocks = [stem] + [unit(i) for i in range(units)] + [head]
    x = tf.random.stateless_normal((batch, size, size, 3), seed=(1, 2))
    y = tf.random.stateless_normal((batch, 10), seed=(3, 4))
  inp = K.Input(x.shape[1:])
  h = inp
  for b in blocks:
    h = b(h)
  return K.Model(inp, h), blocks, x, y


def _keras_step(model_name: str, variant: str):
  """A traced train step of ``variant`` on a fresh model."""
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  import graphgrad as gg  # pylint: disable=g-import-not-at-top
  model, blocks, x, y = _keras_model(model_name)
  opt = keras.optimizers.SGD(1e-3)
  variables = model.trainable_variables
  if variant in ("plan", "recompute"):
    plan = gg.KerasPlan(model)
    if variant == "recompute":
      plan = plan.recompute()

    @tf.function
    def step():
      with plan.tape() as tape:
        loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
      opt.apply_gradients(tape.grads_and_vars(loss))
    return step
  wrapped = [tf.recompute_grad(b) if variant == "recompute_grad" else b
             for b in blocks]

  @tf.function
  def step():
    with tf.GradientTape() as tape:
      h = x
      for b in wrapped:
        h = b(h, training=True) if variant == "tape" else b(h)
      loss = tf.reduce_mean(tf.square(h - y))
    opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
  return step


def keras_child(model_name: str, variant: str, threads: int) -> Dict:
  """One Keras figure: warm-up step, reset, one step, peak."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  _session_config(threads)
  step = _keras_step(model_name, variant)
  step()
  tf.config.experimental.reset_memory_stats("CPU:0")
  step()
  return {"peak_bytes": tf.config.experimental.get_memory_info(
      "CPU:0")["peak"]}


def keras_timing_child(model_name: str, steps: int, threads: int) -> Dict:
  """CPU time per step of every variant, steps alternating."""
  _session_config(threads)
  fns = {v: _keras_step(model_name, v) for v in KERAS_VARIANTS}
  for fn in fns.values():
    fn()
  samples: Dict[str, List[float]] = {v: [] for v in KERAS_VARIANTS}
  for rep in range(steps):
    order = KERAS_VARIANTS if rep % 2 == 0 else KERAS_VARIANTS[::-1]
    for v in order:
      t0 = time.process_time()
      fns[v]()
      samples[v].append(time.process_time() - t0)
  return {"step_ratios": {v: [a / b for a, b in zip(samples[v],
                                                      samples["tape"])]
                          for v in KERAS_VARIANTS}}


def _keras_cases(tiny: bool):
  """(model, label, fresh processes per figure, timed steps)."""
  if tiny:
    return [("kmlp4x32x64", "Keras MLP depth 4, width 32, batch 64", 1, 2)]
  return [("kmlp48x256x4096", "Keras 48 Dense(256), batch 4096", 3, 5),
          ("kresnet6x32x16", "Keras ResNet-style, 6 bottleneck units with "
           "batch norm, 32x32x64, batch 16", 3, 5)]


def _keras_rows(config: benchmarks.Config) -> List[Dict]:
  rows = []
  for model, label, reps, steps in _keras_cases(config.tiny):
    if config.only and model not in config.only:
      continue
    for threads in _threads(config):
      log.info("memory: %s, %d threads", model, threads)
      row: Dict = {"model": model, "label": label, "threads": threads}
      for variant in KERAS_VARIANTS:
        figures = [_run_child(["keras", model, variant, str(threads)])
                   for _ in range(reps)]
        row[variant] = {"peak_mb": _stats([f["peak_bytes"] / 2**20
                                           for f in figures])}
      steps = min(steps, config.reps)
      if steps:
        t = _run_child(["keras_time", model, str(steps), str(threads)])
        row["step_ratio"] = {v: _stats(t["step_ratios"][v])
                             for v in KERAS_VARIANTS}
      rows.append(row)
  return rows


def _render_keras(rows: List[Dict]) -> List[str]:
  lines = ["### Keras: KerasPlan.recompute() in tf.function", "",
           "A train step in `tf.function` with a plain `tf.GradientTape`, "
           "the identity `KerasPlan`, `KerasPlan.recompute()` (`keep=None`) "
           "and `tf.recompute_grad` around blocks (about sqrt(n) Dense "
           "layers; one bottleneck unit). `tf.recompute_grad` updates batch "
           "norm's moving statistics twice per step. Peak MB: median "
           "(min-max) over fresh processes, `n` per figure; ratios to the "
           "plain tape are of the medians. Step: CPU time per step over the "
           "plain tape's, paired per step in one more process. The machine "
           "is shared: figures are noisy.", "",
           "| model | threads | n | peak MB tape | peak MB plan | peak MB "
           "recompute() | peak MB tf.recompute_grad | recompute / tape "
           "| tf.recompute_grad / tape | step recompute() "
           "| step tf.recompute_grad |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    base = r["tape"]["peak_mb"]["median"]
    steps = r.get("step_ratio", {})
    step = {v: _r(steps[v], "{:.2f}x") if v in steps else "-"
            for v in ("recompute", "recompute_grad")}
    lines.append(
        f"| {r['label']} | {r['threads']} | {r['tape']['peak_mb']['n']} "
        f"| {_r(r['tape']['peak_mb'])} | {_r(r['plan']['peak_mb'])} "
        f"| {_r(r['recompute']['peak_mb'])} "
        f"| {_r(r['recompute_grad']['peak_mb'])} "
        f"| **{r['recompute']['peak_mb']['median'] / base:.2f}** "
        f"| {r['recompute_grad']['peak_mb']['median'] / base:.2f} "
        f"| {step['recompute']} | {step['recompute_grad']} |")
  lines.append("")
  return lines


def _batch_norm_cases(tiny: bool):
  """(model, label, fresh processes per figure, warm-up steps, timed
  steps)."""
  if tiny:
    return [("mlp4x32x64", "MLP depth 4, width 32, batch 64", 1, 1, 2)]
  return [("resnet50_8x112", "tf-slim resnet_v1_50, batch 8, 112x112", 3, 1,
           5)]


def _batch_norm_rows(config: benchmarks.Config) -> List[Dict]:
  """The idiom, the identity plan and recompute, at 1 and 2 threads."""
  rows = []
  for model, label, reps, warmup, steps in _batch_norm_cases(config.tiny):
    if config.only and model not in config.only:
      continue
    for threads in _threads(config):
      log.info("memory: %s, %d threads", model, threads)
      row: Dict = {"model": model, "label": label, "threads": threads}
      for variant in BN_VARIANTS:
        figures = [_run_child(["child", model, variant, str(warmup),
                               str(threads)]) for _ in range(reps)]
        row[variant] = {"peak_mb": _stats([f["peak_bytes"] / 2**20
                                           for f in figures])}
      steps = min(steps, config.reps)
      if steps:
        t = _run_child(["time", model, str(steps), str(threads)]
                       + list(BN_VARIANTS))
        row["step_ratio"] = {v: _stats(t["step_ratios"][v])
                             for v in BN_VARIANTS}
      rows.append(row)
  return rows


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
  if data.get("batch_norm"):
    lines += _render_batch_norm(data["batch_norm"])
  if data.get("keras"):
    lines += _render_keras(data["keras"])
  return "\n".join(lines)


def _render_batch_norm(rows: List[Dict]) -> List[str]:
  lines = ["### Batch norm: where the updates run", "",
           "The TF1 idiom is `with tf.control_dependencies(UPDATE_OPS): "
           "optimizer.minimize(loss)`; the plans' backward pass waits for "
           "the same updates (`apply_gradients` builds the loss's gradient "
           "after them). Peak MB: median (min-max) over fresh processes, "
           "`n` per figure; ratios to the idiom are of the medians. Step: "
           "CPU time per step over the idiom's, paired per step in one "
           "more process. The machine is shared: figures are noisy.", "",
           "| model | threads | n | peak MB idiom | peak MB identity plan "
           "| peak MB recompute() | identity / idiom | recompute / idiom "
           "| step identity | step recompute |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    base = r["minimize"]["peak_mb"]["median"]
    steps = r.get("step_ratio", {})
    step = {v: _r(steps[v], "{:.2f}x") if v in steps else "-"
            for v in ("identity", "recompute")}
    lines.append(
        f"| {r['label']} | {r['threads']} | {r['minimize']['peak_mb']['n']} "
        f"| {_r(r['minimize']['peak_mb'])} | {_r(r['identity']['peak_mb'])} "
        f"| {_r(r['recompute']['peak_mb'])} "
        f"| **{r['identity']['peak_mb']['median'] / base:.3f}** "
        f"| **{r['recompute']['peak_mb']['median'] / base:.3f}** "
        f"| {step['identity']} | {step['recompute']} |")
  lines.append("")
  return lines


benchmarks.register("memory", run, order=60, render=render)


if __name__ == "__main__":
  logging.basicConfig(level=logging.WARNING)
  if sys.argv[1] == "child":
    print(json.dumps(child(sys.argv[2], sys.argv[3], int(sys.argv[4]),
                           *[int(a) for a in sys.argv[5:6]])))
  elif sys.argv[1] == "keras":
    print(json.dumps(keras_child(sys.argv[2], sys.argv[3],
                                 int(sys.argv[4]))))
  elif sys.argv[1] == "keras_time":
    print(json.dumps(keras_timing_child(sys.argv[2], int(sys.argv[3]),
                                        int(sys.argv[4]))))
  elif sys.argv[1] == "time":
    print(json.dumps(timing_child(
        sys.argv[2], int(sys.argv[3]), *[int(a) for a in sys.argv[4:5]],
        *([tuple(sys.argv[5:])] if sys.argv[5:] else []))))
