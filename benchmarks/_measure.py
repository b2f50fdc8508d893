"""Measurements: build time and ops, step time, executed ops, peak RSS.

Build and step time are taken in one process, alternating between the
variants on every repetition (the order rotates), so that a slow spell of the
shared machine hits all variants alike. Peak RSS is taken in a fresh child
process per (model, variant), forked from a server that has only imported
TensorFlow and graphgrad, from the kernel's high-water mark (``VmHWM``).
"""

import dataclasses
import gc
import logging
import multiprocessing
import os
import statistics
import time
from typing import Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from benchmarks import _models, _variants

tf1 = tf.compat.v1
log = logging.getLogger("graphgrad.benchmarks")


def optimizer():
  # Plain SGD: no slot variables to dilute the gradient's share of the
  # figures, so ratios to minimize() are the strictest.
  return tf1.train.GradientDescentOptimizer(1e-3)


THREADS = 1  # per session, intra- and inter-op; 0 is TensorFlow's default


def session_config(grappler: bool = True) -> tf1.ConfigProto:
  # One thread: on a shared 2-core machine a step split over two threads
  # waits for whichever is descheduled, which multiplies the noise.
  config = tf1.ConfigProto(intra_op_parallelism_threads=THREADS,
                           inter_op_parallelism_threads=THREADS)
  if not grappler:
    config.graph_options.rewrite_options.disable_meta_optimizer = True
    config.graph_options.optimizer_options.opt_level = tf1.OptimizerOptions.L0
    opts = config.graph_options.optimizer_options
    opts.do_constant_folding = False
    opts.do_common_subexpression_elimination = False
  return config


def stats(xs: Sequence[float]) -> Dict[str, float]:
  return {"min": min(xs), "median": statistics.median(xs), "max": max(xs),
          "n": len(xs)}


def paired_ratios(samples: Dict[str, List[float]], base: str = "minimize"
                  ) -> Dict[str, Dict[str, float]]:
  """Per repetition, each variant's sample over the base's, then stats.

  Samples of one repetition are adjacent in time, so a slow spell of the
  machine cancels out of their ratio.
  """
  if base not in samples:
    return {}
  return {v: stats([a / b for a, b in zip(xs, samples[base])])
          for v, xs in samples.items()}


@dataclasses.dataclass
class Instance:
  """One variant of one model, built in its own graph."""
  variant: str
  graph: tf.Graph
  built: "_models.Built"
  train_op: tf.Operation
  ops_added: int
  build_s: float
  info: dict


def build_once(model: "_models.Model", variant: str) -> Instance:
  """Builds the model, then times the variant's train op alone."""
  graph = tf.Graph()
  with graph.as_default():
    built = model.build()
    before = len(graph.get_operations())
    t = time.perf_counter()
    train_op, info = _variants.build(variant, built, optimizer())
    build_s = time.perf_counter() - t
    ops_added = len(graph.get_operations()) - before
  return Instance(variant, graph, built, train_op, ops_added, build_s, info)


def fresh_heap() -> None:
  """Collects, then freezes every live object out of the collector's way.

  A build then pays for collecting its own garbage only, as in a process
  that builds one model, instead of for scanning every graph built before
  it. ``gc.unfreeze()`` undoes it.
  """
  gc.collect()
  gc.freeze()


def rotate(items: List, k: int) -> List:
  k %= max(1, len(items))
  return items[k:] + items[:k]


def build_alternating(model, variants, reps: int):
  """Builds every variant ``reps`` times, alternating; keeps the last build.

  Returns:
    (instances, build times per variant, skip reasons per variant).
  """
  times: Dict[str, List[float]] = {v: [] for v in variants}
  last: Dict[str, Instance] = {}
  skipped: Dict[str, str] = {}
  try:
    for r in range(reps):
      for v in rotate(list(variants), r):
        if v in skipped:
          continue
        last.pop(v, None)
        fresh_heap()
        try:
          inst = build_once(model, v)
        except _variants.Skip as e:
          skipped[v] = str(e)
          log.info("%s / %s skipped: %s", model.name, v, e)
          continue
        times[v].append(inst.build_s)
        last[v] = inst
  finally:
    gc.unfreeze()
  return last, {v: t for v, t in times.items() if t}, skipped


def _session(inst: Instance, grappler: bool) -> tf1.Session:
  sess = tf1.Session(graph=inst.graph, config=session_config(grappler))
  with inst.graph.as_default():
    sess.run(tf1.global_variables_initializer())
  return sess


def executed_ops(sess, inst: Instance) -> int:
  """Nodes in the partition graphs the runtime executes (after Grappler)."""
  options = tf1.RunOptions(output_partition_graphs=True)
  meta = tf1.RunMetadata()
  sess.run(inst.train_op, inst.built.feed, options=options, run_metadata=meta)
  return sum(len(g.node) for g in meta.partition_graphs)


def step_alternating(instances: Dict[str, Instance], reps: int,
                     target_s: float = 0.25, grappler: bool = True,
                     max_steps: int = 200):
  """Times train steps, one Session per variant, alternating variants.

  Each sample is the mean over ``k`` steps, with ``k`` chosen once so that
  the fastest variant's sample takes about ``target_s``. A sample is taken
  twice: wall time, and the CPU time of this process (every TensorFlow
  thread), which a busy shared machine disturbs much less.

  Returns:
    (wall seconds per step per variant, CPU seconds per step per variant,
    executed ops per variant, steps per sample).
  """
  sessions = {v: _session(i, grappler) for v, i in instances.items()}
  try:
    executed = {v: executed_ops(sessions[v], i) for v, i in instances.items()}
    for v, i in instances.items():  # warm up
      for _ in range(2):
        sessions[v].run(i.train_op, i.built.feed)
    t = time.perf_counter()
    base = next(iter(instances))
    for _ in range(3):
      sessions[base].run(instances[base].train_op, instances[base].built.feed)
    one = (time.perf_counter() - t) / 3
    k = int(min(max_steps, max(1, round(target_s / max(one, 1e-6)))))
    samples: Dict[str, List[float]] = {v: [] for v in instances}
    cpu: Dict[str, List[float]] = {v: [] for v in instances}
    order = list(instances)
    for r in range(reps):
      for v in rotate(order, r):
        inst, sess = instances[v], sessions[v]
        t, c = time.perf_counter(), time.process_time()
        for _ in range(k):
          sess.run(inst.train_op, inst.built.feed)
        samples[v].append((time.perf_counter() - t) / k)
        cpu[v].append((time.process_time() - c) / k)
    return samples, cpu, executed, k
  finally:
    for s in sessions.values():
      s.close()


# -- peak RSS in a child process ------------------------------------------


def _status(field: str) -> float:
  """A /proc/self/status memory field, in MiB."""
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1]) / 1024.0
  return float("nan")


def _rss_child(tiny: bool, model_name: str, variant: str) -> Dict[str, float]:
  logging.getLogger("graphgrad").setLevel(logging.WARNING)
  model = {m.name: m for m in _models.models(tiny)}[model_name]
  graph = tf.Graph()
  with graph.as_default():
    built = model.build()
    base = _status("VmRSS")
    train_op, _ = _variants.build(variant, built, optimizer())
    built_hwm = _status("VmHWM")
    with tf1.Session(config=session_config()) as sess:
      sess.run(tf1.global_variables_initializer())
      for _ in range(2):
        sess.run(train_op, built.feed)
    return {"base_mb": base, "build_peak_mb": built_hwm,
            "peak_mb": _status("VmHWM")}


_CONTEXT = None


def _context():
  global _CONTEXT
  if _CONTEXT is None:
    if "forkserver" in multiprocessing.get_all_start_methods():
      _CONTEXT = multiprocessing.get_context("forkserver")
      _CONTEXT.set_forkserver_preload(["tensorflow", "graphgrad",
                                       "benchmarks._models"])
    else:
      _CONTEXT = multiprocessing.get_context("spawn")
  return _CONTEXT


def peak_rss(tiny: bool, model_name: str, variant: str,
             timeout: float = 300) -> Optional[Dict[str, float]]:
  """Peak RSS of one variant's build and first steps, in a fresh child."""
  ctx = _context()
  with ctx.Pool(1, maxtasksperchild=1) as pool:
    res = pool.apply_async(_rss_child, (tiny, model_name, variant))
    try:
      return res.get(timeout)
    except Exception as e:  # pylint: disable=broad-except
      log.warning("peak RSS of %s / %s failed: %s", model_name, variant, e)
      return None


def machine() -> Dict[str, str]:
  import platform  # pylint: disable=g-import-not-at-top
  cpu = platform.processor() or "?"
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          cpu = line.split(":", 1)[1].strip()
          break
  except OSError:
    pass
  try:
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
  except OSError:
    load = "?"
  return {"cpu": cpu, "cores": str(os.cpu_count()),
          "python": platform.python_version(), "tensorflow": tf.__version__,
          "numpy": np.__version__, "platform": platform.platform(),
          "load_at_start": load}
