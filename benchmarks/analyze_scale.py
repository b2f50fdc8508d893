"""Suite: ``gg.analyze`` against ``tf.gradients`` on large synthetic graphs.

The graph is a chain of small residual blocks (a layer each), a glue
activation between blocks and an L2 regularizer per block summed into the
loss, scaled to a given number of ops. For each size: the time to build the
forward graph, ``gg.analyze(loss)`` (median of repetitions), and one
``tf.gradients(loss, trainable_variables)`` on the same graph.
"""

import gc
import logging
import statistics
import time
from typing import Dict, List

import numpy as np
import tensorflow as tf

import benchmarks
import graphgrad as gg
from benchmarks import _measure, _report

tf1 = tf.compat.v1
log = logging.getLogger("graphgrad.benchmarks")

OPS_PER_BLOCK = 26  # measured: variables and their initializers, forward, glue


def synthetic(blocks: int, width: int = 8):
  rng = np.random.default_rng(0)
  x = tf1.placeholder(tf.float32, [4, width], name="x")
  h, regs = x, []
  for i in range(blocks):
    with tf1.variable_scope(f"b{i}"):
      w = tf1.get_variable("w", initializer=(
          rng.normal(size=(width, width)) * 0.1).astype(np.float32))
      b = tf1.get_variable("b", initializer=np.zeros(width, np.float32))
      h = tf.tanh(tf.matmul(h, w) + b) * 0.5 + h
    h = tf.nn.relu(h) - 0.01 * h
    regs.append(tf.reduce_sum(tf.square(w)))
  return tf.reduce_sum(h) + 1e-4 * tf.add_n(regs)


def measure(blocks: int, reps: int) -> Dict:
  try:
    return _measure_unfrozen(blocks, reps)
  finally:
    gc.unfreeze()


def _measure_unfrozen(blocks: int, reps: int) -> Dict:
  graph = tf.Graph()
  with graph.as_default():
    _measure.fresh_heap()
    t, c = time.perf_counter(), time.process_time()
    loss = synthetic(blocks)
    forward_s, forward_cpu = time.perf_counter() - t, time.process_time() - c
    n_ops = len(graph.get_operations())
    times, cpu = [], []
    for _ in range(reps):
      _measure.fresh_heap()
      t, c = time.perf_counter(), time.process_time()
      net = gg.analyze(loss)
      times.append(time.perf_counter() - t)
      cpu.append(time.process_time() - c)
    fwd = net.op_graph
    _measure.fresh_heap()
    t, c = time.perf_counter(), time.process_time()
    tf1.gradients(loss, tf1.trainable_variables())
    grad_s, grad_cpu = time.perf_counter() - t, time.process_time() - c
  return {"blocks": blocks, "graph_ops": n_ops,
          "forward_ops": fwd.number_of_nodes(),
          "forward_edges": fwd.number_of_edges(),
          "layers": len(net), "layer_edges": net.graph.number_of_edges(),
          "forward_build_s": forward_s,
          "forward_build_cpu_s": forward_cpu,
          "analyze_s": {"min": min(times), "median": statistics.median(times),
                        "max": max(times), "n": len(times)},
          "analyze_cpu_s": _measure.stats(cpu),
          "gradients_s": grad_s,
          "gradients_cpu_s": grad_cpu,
          "ops_after_gradients": len(graph.get_operations())}


def run(config: benchmarks.Config) -> benchmarks.SuiteResult:
  targets = (300, 600) if config.tiny else (12500, 25000, 100000)
  reps = 1 if config.tiny else 3
  rows: List[Dict] = []
  for n in targets:
    blocks = max(1, n // OPS_PER_BLOCK)
    log.info("analyze scale: %d blocks", blocks)
    rows.append(measure(blocks, reps))
  return benchmarks.SuiteResult(_report.analyze_markdown(rows), {"sizes": rows})


def render(data: Dict, out_dir: str) -> str:
  del out_dir  # no figures
  return _report.analyze_markdown(data["sizes"])


benchmarks.register("analyze_scale", run, order=20, render=render)
