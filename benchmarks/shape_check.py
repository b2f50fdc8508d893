"""Suite: the run-time shape check of a user's transform.

graphgrad checks a transform's result against the gradient's shape while
building; where a static shape is not fully known (a placeholder's batch
dimension of ``None``), a user's callable also gets a run-time assertion
(graphgrad's own transforms keep shape by construction and get none). This
suite builds an MLP whose batch dimension is unknown with ``minimize()``,
``scale(0.5)`` on every boundary (no check) and ``lambda g: 0.5 * g`` on
every boundary (one check each), and the last once more with a static batch
(no check); one Session each, stepping alternately, it reports ops added
and step time against ``minimize()``.
"""

import logging
import time
from typing import Dict

import numpy as np
import tensorflow as tf

import benchmarks
import graphgrad as gg
from benchmarks import _measure, _models

log = logging.getLogger("graphgrad.benchmarks")
tf1 = tf.compat.v1

VARIANTS = ("minimize", "scale", "callable", "callable_static")


def _mlp(depth: int, width: int, batch: int, static: bool) -> _models.Built:
  rng = np.random.default_rng(depth)
  rows = batch if static else None
  x = tf1.placeholder(tf.float32, [rows, width], name="x")
  y = tf1.placeholder(tf.float32, [rows, 10], name="y")
  h, layers = x, []
  for i in range(depth):
    last = i == depth - 1
    out = _models._dense(h, 10 if last else width, f"l{i:03d}", seed=i)  # pylint: disable=protected-access
    layers.append((f"l{i:03d}", out))
    h = out if last else tf.nn.relu(out)
  loss = tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(
      labels=y, logits=h))
  feed = {x: rng.normal(size=(batch, width)).astype(np.float32),
          y: np.eye(10, dtype=np.float32)[rng.integers(0, 10, batch)]}
  return _models.Built(loss, feed, layers)


def _build(variant: str, depth: int, width: int, batch: int
           ) -> _measure.Instance:
  graph = tf.Graph()
  with graph.as_default():
    built = _mlp(depth, width, batch, static=variant == "callable_static")
    before = len(graph.get_operations())
    start = time.perf_counter()
    opt = _measure.optimizer()
    if variant == "minimize":
      train = opt.minimize(built.loss)
    else:
      fn = (gg.transforms.scale(0.5) if variant == "scale"
            else lambda g: 0.5 * g)
      plan = gg.GradientPlan(built.loss)
      for name, _ in built.layers[1:]:
        plan.transform_upstream(name, fn)
      train = plan.apply_gradients(opt)
    build_s = time.perf_counter() - start
    added = len(graph.get_operations()) - before
  return _measure.Instance(variant, graph, built, train, added, build_s, {})


def run(config: benchmarks.Config) -> benchmarks.SuiteResult:
  depth, width, batch = (4, 32, 16) if config.tiny else (16, 256, 128)
  insts = {v: _build(v, depth, width, batch) for v in VARIANTS}
  reps = 2 if config.tiny else 2 * config.reps + 1
  steps, _, executed, k = _measure.step_alternating(
      insts, reps, target_s=0.01 if config.tiny else 0.25)
  ratios = _measure.paired_ratios(steps)
  data: Dict = {"depth": depth, "width": width, "batch": batch,
                "steps_per_sample": k, "variants": {}}
  rows = []
  for v, inst in insts.items():
    r = ratios[v]
    data["variants"][v] = {"ops_added": inst.ops_added,
                           "executed_ops": executed[v], "step_ratio": r}
    rows.append(f"| {v} | {inst.ops_added} | {executed[v]} | "
                f"{r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f}) |")
  markdown = "\n".join([
      "## Run-time shape check of a user's transform",
      "",
      f"MLP of depth {depth}, width {width}, batch {batch} fed to a "
      f"placeholder of unknown batch size; an upstream transform on every "
      f"boundary but the first. `callable` is `lambda g: 0.5 * g` and gets "
      f"one run-time shape assertion per boundary; `scale` is "
      f"`gg.transforms.scale(0.5)` and gets none; `callable_static` is "
      f"`callable` on a static batch size, where no assertion is needed, so "
      f"the difference of the two is the check's cost. Step ratio: paired, "
      f"against minimize(), median (min-max) of {reps} samples of {k} "
      f"steps.",
      "",
      "| variant | ops added | ops executed | step / minimize() |",
      "|---|---|---|---|",
      *rows, ""])
  return benchmarks.SuiteResult(markdown=markdown, data=data)


benchmarks.register("shape_check", run, order=85, in_tiny=False)
