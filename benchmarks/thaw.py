"""``python -m benchmarks.thaw``: gg.thaw on a 26-layer frozen conv net.

The model: ten conv + batch-norm blocks (``tf.compat.v1.layers``, inference
batch norm with non-trivial statistics), then six dense layers made with
``get_variable``: 26 layers, 36 weight constants once frozen with
``convert_variables_to_constants``. Measured, in one process:

* thaw time: ``gg.thaw(frozen)`` into a fresh ``tf.Graph``, beside a plain
  ``tf.compat.v1.import_graph_def(frozen)`` of the same GraphDef (median,
  min and max over repetitions, alternating);
* round trip: the largest absolute difference between the frozen graph's
  logits and the thawed graph's, and between the original graph's
  parameter gradients and the thawed graph's (same weights, same batch);
* layers: whether ``gg.analyze`` finds the original layer names;
* overrides: the same model with its conv activations rounded to 8 bits,
  frozen and thawed, trained with ``plan.straight_through("Round")`` (and a
  ``transform_upstream`` at the middle conv block), against the unfrozen
  model built under ``gradient_override_map({"Round": "Identity"})`` with
  the same declaration; and with ``plan.override_gradient("Round", fn)``
  against a ``tf.custom_gradient`` version: the largest absolute and
  relative differences of the parameter gradients;
* override build time: a plan on a 64-layer chain with every activation
  rounded and every other layer's upstream scaled, with
  ``straight_through("Round")``, beside the same plan on the same chain built
  under ``gradient_override_map`` (median, min, max; paired ratio).

``--reps N`` sets the repetitions (default 15).
"""

import argparse
import contextlib
import importlib.util
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
if importlib.util.find_spec("tf_keras") is not None:  # tf.compat.v1.layers
  os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import graphgrad as gg  # noqa: E402

tf1 = tf.compat.v1
BLOCKS, DENSE = 10, 6


@tf.custom_gradient
def _round_saturating(t):
  return tf.round(t), lambda dy: dy * tf.cast(tf.abs(t) <= 255.0, dy.dtype)


def saturating(op, dy):
  """The override the custom_gradient reference builds in: 1{|x| <= 255}."""
  return dy * tf.cast(tf.abs(op.inputs[0]) <= 255.0, dy.dtype)


def _quantize(h, scope, quant):
  """Rounds ``h`` to multiples of 1/255 inside ``scope``'s layer."""
  if quant is None:
    return h
  with tf.name_scope(scope + "/quant/"):
    if quant == "custom":
      return _round_saturating(h * 255.0) / 255.0
    graph = tf1.get_default_graph()
    with (graph.gradient_override_map({"Round": "Identity"}) if quant == "map"
          else contextlib.nullcontext()):
      return tf.round(h * 255.0) / 255.0


def network(x, quant=None):
  h = x
  for i in range(BLOCKS):
    h = tf1.layers.conv2d(h, 8, 3, padding="same", name=f"conv{i}")
    h = tf.nn.relu(tf1.layers.batch_normalization(h, training=False,
                                                  name=f"bn{i}"))
    h = _quantize(h, f"bn{i}", quant)
  h = tf.reshape(h, [-1, 8 * 8 * 8])
  for i in range(DENSE):
    with tf1.variable_scope(f"fc{i}"):
      units = 10 if i == DENSE - 1 else 32
      w = tf1.get_variable("weights", [int(h.shape[-1]), units])
      b = tf1.get_variable("biases", [units])
      h = tf.matmul(h, w) + b
      h = tf.nn.relu(h) if i < DENSE - 1 else h
  return tf.identity(h, name="logits")


def _loss(logits):
  return tf.reduce_sum(tf.square(logits), name="loss")


def _declare(plan, quant):
  plan.transform_upstream(f"bn{BLOCKS // 2}", gg.transforms.scale(0.5))
  if quant == "plain":
    plan.straight_through("Round")
  elif quant == "custom_fn":
    plan.override_gradient("Round", saturating)
  return plan


def frozen_model(x_value, quant=None):
  """Returns (GraphDef, logits, gradients by variable name, layer names).

  With ``quant`` ("map" or "custom"), the gradients are a plan's, with the
  middle block's upstream halved.
  """
  with tf.Graph().as_default() as g:
    tf1.set_random_seed(0)
    x = tf1.placeholder(tf.float32, [None, 8, 8, 3], name="x")
    logits = network(x, quant)
    loss = _loss(logits)
    variables = tf1.trainable_variables()
    if quant is None:
      grads = tf.gradients(loss, variables)
    else:
      grads = [gr for gr, _ in _declare(gg.GradientPlan(loss),
                                        quant).compute_gradients()]
    names = gg.analyze(loss).names
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      for v in tf1.global_variables():
        if "/moving_" in v.name or "/gamma" in v.name:
          sess.run(v.assign(tf.random.uniform(v.shape, 0.5, 1.5, seed=1)))
      out, grad_values = sess.run([logits, grads], {x: x_value})
      frozen = tf1.graph_util.convert_variables_to_constants(
          sess, g.as_graph_def(), ["logits"])
  return (frozen, out,
          {v.op.name: gv for v, gv in zip(variables, grad_values)}, names)


def override_differences(x_value):
  """Largest gradient differences of thawed + override against references."""
  out = {}
  for quant, reference in (("plain", "map"), ("custom_fn", "custom")):
    _, _, expected, _ = frozen_model(x_value, reference)
    frozen, _, _, _ = frozen_model(x_value, "plain")
    with tf.Graph().as_default() as g:
      variables = [v for v in gg.thaw(frozen) if v.trainable]
      loss = _loss(g.get_tensor_by_name("logits:0"))
      plan = _declare(gg.GradientPlan(loss, var_list=variables), quant)
      grads = [gr for gr, _ in plan.compute_gradients()]
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        values = sess.run(grads, {"x:0": x_value})
    diff = [np.abs(a - expected[v.op.name]) for a, v in zip(values, variables)]
    scale = max(float(np.max(np.abs(e))) for e in expected.values())
    rel = max(float(np.max(d / (np.abs(expected[v.op.name]) + 1e-6 * scale)))
              for d, v in zip(diff, variables))
    out[quant] = (max(float(np.max(d)) for d in diff), rel, scale)
  return out


def _rounded_chain(layers, reference):
  """Builds the chain; returns a function that builds its plan."""
  graph = tf1.get_default_graph()
  h = tf1.placeholder(tf.float32, [None, 8])
  for i in range(layers):
    with tf1.variable_scope(f"l{i}"):
      w = tf1.get_variable("w", [8, 8])
      h = tf.sigmoid(tf.matmul(h, w))
      with (graph.gradient_override_map({"Round": "Identity"}) if reference
            else contextlib.nullcontext()):
        h = tf.round(h * 255.0) / 255.0
  loss = tf.reduce_sum(h)

  def build():
    plan = gg.GradientPlan(loss)
    for i in range(1, layers, 2):
      plan.transform_upstream(f"l{i}", gg.transforms.scale(0.9))
    if not reference:
      plan.straight_through("Round")
    plan.compute_gradients()
  return build


def override_build_times(reps, layers=64):
  samples = {"straight_through": [], "gradient_override_map": []}
  for rep in range(reps):
    for label in list(samples)[::1 if rep % 2 else -1]:
      with tf.Graph().as_default():
        build = _rounded_chain(layers, label == "gradient_override_map")
        start = time.perf_counter()
        build()
        samples[label].append(time.perf_counter() - start)
  return samples


def _time(fn):
  with tf.Graph().as_default():
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _print_overrides(x_value, build_reps):
  print("\nrounded activations, thawed, against references on the unfrozen "
        "model (upstream x0.5 at the middle block):")
  labels = {"plain": "straight_through vs gradient_override_map",
            "custom_fn": "override_gradient(fn) vs tf.custom_gradient"}
  for key, (abs_diff, rel, scale) in override_differences(x_value).items():
    print(f"  {labels[key]}: max |difference| {abs_diff:.3g} (largest "
          f"gradient {scale:.3g}); max relative {rel:.3g}")
  builds = override_build_times(build_reps)
  n = len(builds["straight_through"])
  print(f"\nplan build, 64 rounded layers, 32 upstream transforms (n={n}):")
  for label, xs in builds.items():
    print(f"  {label:<22} median {statistics.median(xs):.2f} s "
          f"(min {min(xs):.2f}, max {max(xs):.2f})")
  ratios = [a / b for a, b in zip(builds["straight_through"],
                                  builds["gradient_override_map"])]
  print(f"  straight_through / gradient_override_map: median "
        f"{statistics.median(ratios):.2f} (min {min(ratios):.2f}, "
        f"max {max(ratios):.2f})")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--reps", type=int, default=15)
  args = parser.parse_args(argv)
  x_value = np.random.default_rng(0).normal(size=(16, 8, 8, 3)).astype(
      np.float32)
  frozen, expected, grads, names = frozen_model(x_value)
  consts = sum(1 for n in frozen.node if n.op == "Const")
  samples = {"thaw": [], "import_graph_def": []}
  for rep in range(args.reps):
    order = ["thaw", "import_graph_def"][::1 if rep % 2 else -1]
    for label in order:
      fn = ((lambda: gg.thaw(frozen)) if label == "thaw"
            else (lambda: tf1.import_graph_def(frozen, name="")))
      samples[label].append(_time(fn))
  with tf.Graph().as_default() as g:
    variables = gg.thaw(frozen)
    logits = g.get_tensor_by_name("logits:0")
    loss = _loss(logits)
    thawed_names = gg.analyze(loss).names
    trainable = [v for v in variables if v.trainable]
    new_grads = tf.gradients(loss, trainable)
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      out, grad_values = sess.run([logits, new_grads], {"x:0": x_value})
  out_diff = float(np.max(np.abs(out - expected)))
  grad_diff = max(float(np.max(np.abs(gv - grads[v.op.name])))
                  for v, gv in zip(trainable, grad_values))
  params = sum(int(np.prod(v.shape)) for v in trainable)
  print(f"model: {len(names)} layers, {len(frozen.node)} GraphDef nodes, "
        f"{consts} Consts, {len(variables)} thawed ({len(trainable)} "
        f"trainable, {params:,} parameters)")
  print(f"layers found after thaw equal the original's: "
        f"{thawed_names == names}")
  print(f"round trip, max |logits difference|: {out_diff:.3g}")
  print(f"round trip, max |gradient difference| vs the unfrozen graph: "
        f"{grad_diff:.3g}")
  print(f"\n{'step':<18} {'median ms':>10} {'min':>8} {'max':>8}  "
        f"(n={args.reps})")
  for label, xs in samples.items():
    print(f"{label:<18} {1e3 * statistics.median(xs):>10.1f} "
          f"{1e3 * min(xs):>8.1f} {1e3 * max(xs):>8.1f}")
  ratios = [a / b for a, b in zip(samples["thaw"], samples["import_graph_def"])]
  print(f"thaw / import_graph_def: median {statistics.median(ratios):.2f} "
        f"(min {min(ratios):.2f}, max {max(ratios):.2f})")
  _print_overrides(x_value, max(3, args.reps // 3))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
