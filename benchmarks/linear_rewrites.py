"""Suite: linear rewrites cost one backward pass, nonlinear ones two.

Models: an LSTM (``dynamic_rnn``, ``LSTMCell(128)``, 40 steps, batch 64)
with an upstream rewrite on the recurrent layer, and MLPs of depth 32 and
128 with an upstream rewrite on every boundary. Variants, side by side with
``minimize()`` in one process:

* ``scale`` / ``scale_all``: ``scale(0.5)``, linear: one pass, weighted;
* ``scale_cut`` / ``scale_all_cut``: the same plan forced through the cut
  path (the engine before linear rewrites were fused);
* ``clip_by_norm``: nonlinear, so the recurrent layer is backpropagated
  twice;
* ``scale_clip_all``: ``chain(scale(0.5), clip_by_value(-1, 1))`` on every
  boundary, nonlinear: every layer cut;
* ``floor``: the same rewrite built by hand with the fewest ``tf.gradients``
  calls it needs, each cut layer's gradient function emitted twice (once for
  its parameters with ``g``, once for its input with ``f(g)``), then the glue
  between layers once. Its build time is the floor for ``scale_clip_all``.

And residual nets: tf-slim ``resnet_v1_50`` / ``101`` / ``152`` (batch 2,
64x64) with ``clip_by_norm(1.0)`` upstream of every bottleneck unit
(``conv3/BatchNorm``), variant ``clip_units``: the ops added per unit beyond
``minimize()``'s stay constant with depth (not in the tiny run).

The ops each variant adds are pinned in ``benchmarks/op_counts.json``, for
the full and the tiny models, beside those of ``minimize()`` and of the
identity plan (``gg_identity``); ``tests/test_op_counts.py`` rebuilds the
tiny models and checks every count exactly. A deliberate change re-records
the file with ``python -m benchmarks.linear_rewrites --record`` (graph
building only, about two minutes).
"""

import argparse
import json
import logging
import os
import sys
from typing import Dict

import tensorflow as tf

import benchmarks
import graphgrad as gg
from benchmarks import _measure, _models, _variants
from graphgrad import _compat
from graphgrad.plan import _backprop

tf1 = tf.compat.v1
log = logging.getLogger("graphgrad.benchmarks")

LABELS = {
    "minimize": "minimize()",
    "scale": "upstream scale(0.5) on the LSTM (fused)",
    "scale_cut": "the same, forced through the cut path",
    "clip_by_norm": "upstream clip_by_norm(1.0) on the LSTM (cut)",
    "scale_all": "scale(0.5) on every boundary (fused)",
    "scale_all_cut": "the same, forced through the cut path",
    "scale_clip_all": "scale+clip_by_value on every boundary (cut)",
    "floor": "hand-built floor of scale+clip: two emissions per layer",
    "clip_units": "clip_by_norm(1.0) upstream of every bottleneck unit",
}
LSTM_VARIANTS = ("minimize", "scale", "scale_cut", "clip_by_norm")
MLP_VARIANTS = ("minimize", "scale_all", "scale_all_cut", "scale_clip_all",
                "floor")
RESNET_VARIANTS = ("minimize", "clip_units")
# The file of pinned op counts (see the module docstring).
OP_COUNTS = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                         "op_counts.json")


def _units(net):
  return [n for n in net.names if n.endswith("conv3/BatchNorm")]


def _scale_clip():
  return gg.transforms.chain(gg.transforms.scale(0.5),
                             gg.transforms.clip_by_value(-1.0, 1.0))


def _plan_variant(layers, boundary, fn, fuse=True):
  """A variant rewriting the upstream of ``boundary(net)``'s layers."""
  def build(built, optimizer):
    net = gg.analyze(built.loss, layers=layers)
    plan = gg.GradientPlan(built.loss, net)
    for name in boundary(net):
      # Without a linear factor, the rewrite is called on the gradient.
      f = fn()
      plan.transform_upstream(name, f if fuse else lambda g, f=f: f(g))
    return plan.apply_gradients(optimizer), {}
  return build


def _below(net):
  return [n for n in net.names if any(True for _ in net.graph.predecessors(n))]


def _rnn(net):
  return ["rnn"]


def _grads(ys, xs, grad_ys):
  # The engine's bounded reachability walk (graphgrad/plan/_backprop.py), so
  # that the floor pays for emitting gradient functions, not for TF's walk
  # over everything above ``xs`` (quadratic in depth).
  xs = xs if isinstance(xs, list) else [xs]
  with _compat.bounded_walk(_backprop.behind([ys], xs)):
    return tf1.gradients(ys, xs, grad_ys=grad_ys, gate_gradients=True)


def floor(built, optimizer):
  """scale+clip on every boundary by hand: two emissions per layer."""
  f = _scale_clip()
  outs = [out for _, out in built.layers]
  scopes = [name for name, _ in built.layers]
  gv = []
  g = tf1.gradients(built.loss, outs[-1])[0]
  for i in range(len(outs) - 1, -1, -1):
    var_list = tf1.get_collection(tf1.GraphKeys.TRAINABLE_VARIABLES,
                                  scopes[i] + "/")
    gv += list(zip(_grads(outs[i], var_list, g), var_list))
    if i == 0:
      break
    relu = [c for c in outs[i - 1].consumers() if c.type == "Relu"][0]
    g_in = _grads(outs[i], relu.outputs[0], f(g))[0]
    g = _grads(relu.outputs[0], outs[i - 1], g_in)[0]
  return optimizer.apply_gradients(gv), {}


_variants.EXTRA.update({
    "scale": _plan_variant(_models.LSTM_LAYERS, _rnn,
                           lambda: gg.transforms.scale(0.5)),
    "scale_cut": _plan_variant(_models.LSTM_LAYERS, _rnn,
                               lambda: gg.transforms.scale(0.5), fuse=False),
    "clip_by_norm": _plan_variant(_models.LSTM_LAYERS, _rnn,
                                  lambda: gg.transforms.clip_by_norm(1.0)),
    "scale_all": _plan_variant(None, _below,
                               lambda: gg.transforms.scale(0.5)),
    "scale_all_cut": _plan_variant(None, _below,
                                   lambda: gg.transforms.scale(0.5),
                                   fuse=False),
    "scale_clip_all": _plan_variant(None, _below, _scale_clip),
    "floor": floor,
    "clip_units": _plan_variant(None, _units,
                                lambda: gg.transforms.clip_by_norm(1.0)),
})


def _cases(tiny: bool):
  if tiny:
    return [(_models.Model("lstm", lambda: _models.lstm(8, 4, 4, 8)),
             LSTM_VARIANTS),
            (_models.Model("mlp4", lambda: _models.mlp(4, 32, 16), 4),
             MLP_VARIANTS)]
  return [(_models.Model("lstm", _models.lstm, 0,
                         "dynamic_rnn, LSTMCell(128), 40 steps, batch 64"),
           LSTM_VARIANTS)] + [
      (_models.Model(f"mlp{d}", lambda d=d: _models.mlp(d), d,
                     f"MLP depth {d}, width 256, batch 128"), MLP_VARIANTS)
      for d in (32, 128)] + [
      (_models.Model(f"resnet_v1_{d}", lambda d=d: _models.slim_resnet(d), 0,
                     f"tf-slim resnet_v1_{d}, batch 2, 64x64, clip_by_norm "
                     f"upstream of every bottleneck unit"), RESNET_VARIANTS)
      for d in (50, 101, 152)]


def run_case(config, model, variants) -> Dict:
  reps = 2 if config.tiny else config.reps
  insts, build_s, skipped = _measure.build_alternating(model, variants, reps)
  steps, cpu, executed, k = _measure.step_alternating(
      insts, 1 if config.tiny else 2 * reps + 1,
      target_s=0.01 if config.tiny else 0.25)
  paired_cpu = _measure.paired_ratios(cpu)
  paired_wall = _measure.paired_ratios(steps)
  base_build = build_s["minimize"]
  out = {"model": model.name, "description": model.description,
         "steps_per_sample": k, "skipped": skipped, "variants": {}}
  for v, inst in insts.items():
    out["variants"][v] = {
        "build_s": _measure.stats(build_s[v]),
        "build_ratio": _measure.stats(
            [a / b for a, b in zip(build_s[v], base_build)]),
        "ops_added": inst.ops_added,
        "ops_ratio": inst.ops_added / insts["minimize"].ops_added,
        "executed_ops": executed[v],
        "step_cpu_s": _measure.stats(cpu[v]),
        "step_cpu_ratio": paired_cpu.get(v),
        "step_ratio": paired_wall.get(v),
    }
  return out


def _r(s) -> str:
  return f"{s['median']:.3f}x ({s['min']:.3f}-{s['max']:.3f})"


def render(data: Dict, out_dir: str = ".") -> str:
  lines = ["## Linear rewrites: one backward pass", "",
           "Paired ratios to `minimize()` in the same repetition: median "
           "(min-max). Build time is `gg.analyze` + plan + `apply_gradients`.",
           ""]
  for case in data["cases"]:
    lines += [f"### {case['model']}: {case['description']}", "",
              "| variant | build s | build x min() | ops added | ops x min() "
              "| executed ops | step CPU x min() | step wall x min() |",
              "|---|---|---|---|---|---|---|---|"]
    for v in sorted(case["variants"], key=list(LABELS).index):
      e, b = case["variants"][v], case["variants"][v]["build_s"]
      lines.append(
          f"| {LABELS[v]} | {b['median']:.3f} ({b['min']:.3f}-{b['max']:.3f}) "
          f"| {_r(e['build_ratio'])} | {e['ops_added']} "
          f"| {e['ops_ratio']:.3f}x | {e['executed_ops']} "
          f"| {_r(e['step_cpu_ratio'])} | {_r(e['step_ratio'])} |")
    lines.append("")
  return "\n".join(lines)


def run(config: benchmarks.Config) -> benchmarks.SuiteResult:
  cases = []
  for model, variants in _cases(config.tiny):
    if config.only and model.name not in config.only:
      continue
    log.info("linear rewrites: %s", model.name)
    cases.append(run_case(config, model, variants))
  data = {"cases": cases}
  return benchmarks.SuiteResult(render(data), data)


benchmarks.register("linear_rewrites", run, order=15, render=render)


def op_counts(tiny: bool) -> Dict[str, Dict[str, int]]:
  """Per model, the ops each variant's train op adds, built once each.

  The builds of :func:`run_case` without the timing, plus the identity plan
  (``gg_identity``: ``transform_upstream(identity())`` below every layer),
  which builds what ``minimize()`` builds. A skipped variant is left out.
  """
  out: Dict[str, Dict[str, int]] = {}
  for model, variants in _cases(tiny):
    counts = out.setdefault(model.name, {})
    for v in tuple(variants) + ("gg_identity",):
      try:
        counts[v] = _measure.build_once(model, v).ops_added
      except _variants.Skip as e:
        log.info("%s / %s skipped: %s", model.name, v, e)
  return out


def record(path: str = OP_COUNTS) -> Dict:
  """Writes the op counts of the full and the tiny models to ``path``."""
  data = {"regenerate": "python -m benchmarks.linear_rewrites --record",
          "tensorflow": tf.__version__,
          "tiny": op_counts(True), "full": op_counts(False)}
  with open(path, "w") as f:
    json.dump(data, f, indent=1)
    f.write("\n")
  return data


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m benchmarks.linear_rewrites",
      description="Op counts of the linear-rewrite variants.")
  parser.add_argument("--record", action="store_true",
                      help=f"rewrite {os.path.relpath(OP_COUNTS)} with "
                      f"today's op counts")
  parser.add_argument("--tiny", action="store_true",
                      help="print the tiny models' counts only")
  args = parser.parse_args(argv)
  logging.getLogger("graphgrad").setLevel(logging.WARNING)
  data = (record() if args.record
          else {"tiny" if args.tiny else "full": op_counts(args.tiny)})
  print(json.dumps(data, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
