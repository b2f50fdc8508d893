"""Where the tutorial convnet's private step goes: its two convolutions.

At one thread, batch 128 (``python -m benchmarks.privacy_conv``):

* whole steps, against the plain step of the whole model: ``clip_only``
  (``privatize(1.0, 0.0)``) of all variables, and of one kernel alone
  (``var_list``) beside that kernel's own plain step;
* one layer's per-example squared norms, from stored ``x`` and ``g`` of
  its shapes: graphgrad's rule (``combined_sq_norms`` of a ``Conv2DForm``),
  the per-example product from the patches (``[B, T, kh*kw*C]`` by ``g``,
  batched), the ghost norm on the patches, for one input channel the
  per-example product as one depthwise filter gradient, the patches alone
  (graphgrad's gather, ``extract_patches``, a one-hot conv), and for
  scale the plain step's filter gradient (``Conv2DBackpropFilter``).
"""

import argparse
import json
from typing import Callable, Dict

import numpy as np

from benchmarks import _privacy_models, privacy

MODEL = "tutorial_convnet"
# (name, input shape, kernel shape, stride, padding): c2 reads c1's output
# after the 2/1 max pool.
CONVS = (("c1", (28, 28, 1), (8, 8, 1, 16), 2, "SAME"),
         ("c2", (13, 13, 16), (4, 4, 16, 32), 2, "VALID"))


def _session(graph, threads: int):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf1 = tf.compat.v1
  sess = tf1.Session(graph=graph, config=tf1.ConfigProto(
      intra_op_parallelism_threads=threads,
      inter_op_parallelism_threads=threads))
  with graph.as_default():
    sess.run(tf1.global_variables_initializer())
  return sess


def step(var_names, private: bool, batch: int, threads: int
         ) -> Callable[[], None]:
  """A plain or clip-only step training ``var_names`` (all when empty)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  import graphgrad as gg  # pylint: disable=g-import-not-at-top
  tf1 = tf.compat.v1
  graph = tf.Graph()
  with graph.as_default():
    loss, x, y = _privacy_models.graph_loss(MODEL, batch)
    var_list = [v for v in tf1.trainable_variables()
                if not var_names or v.op.name in var_names]
    opt = tf1.train.GradientDescentOptimizer(1e-3)
    if private:
      train = gg.GradientPlan(loss, var_list=var_list).privatize(
          privacy.CLIP, 0.0).apply_gradients(opt)
    else:
      train = opt.minimize(tf.reduce_mean(loss), var_list=var_list)
  sess = _session(graph, threads)
  xs, ys = _privacy_models.data(MODEL, batch)
  return lambda: sess.run(train, {x: xs, y: ys})


def norms(batch: int, threads: int) -> Dict[str, Callable[[], None]]:
  """Each conv's per-example squared norms by each method, and its filter
  gradient, from ``x`` and ``g`` held in variables."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  from graphgrad.core import _clipping, _forms  # pylint: disable=g-import-not-at-top
  tf1 = tf.compat.v1
  rng = np.random.default_rng(2)
  graph = tf.Graph()
  fetches = {}
  with graph.as_default():
    for name, x_shape, k_shape, stride, padding in CONVS:
      kh, kw, cin, cout = k_shape
      h = x_shape[0]
      ho = -(-h // stride) if padding == "SAME" else (h - kh) // stride + 1
      x = tf1.get_variable(f"{name}_x", initializer=rng.normal(
          size=(batch,) + x_shape).astype(np.float32))
      g = tf1.get_variable(f"{name}_g", initializer=rng.normal(
          size=(batch, ho, ho, cout)).astype(np.float32))
      x, g = tf.identity(x), tf.identity(g)
      strides = [1, stride, stride, 1]
      form = _forms.Conv2DForm(x, g, k_shape, strides, padding)
      fetches[f"{name}/graphgrad"] = _clipping.combined_sq_norms(
          [form], k_shape, batch, tf.float32)
      a = tf.reshape(_forms.patches(x, kh, kw, strides, padding),
                     [batch, -1, kh * kw * cin])  # [B, T, p]
      gr = tf.reshape(g, [batch, -1, cout])  # [B, T, cout]
      fetches[f"{name}/patches_product"] = tf.reduce_sum(tf.square(
          tf.matmul(a, gr, transpose_a=True)), axis=[1, 2])
      fetches[f"{name}/patches_ghost"] = tf.reduce_sum(
          tf.matmul(a, a, transpose_b=True)
          * tf.matmul(gr, gr, transpose_b=True), axis=[1, 2])
      fetches[f"{name}/patches_only"] = tf.reduce_sum(a)
      fetches[f"{name}/extract_patches_only"] = tf.reduce_sum(
          tf.image.extract_patches(x, [1, kh, kw, 1], strides, [1, 1, 1, 1],
                                   padding))
      eye = np.eye(kh * kw * cin, dtype=np.float32).reshape(
          kh, kw, cin, kh * kw * cin)
      fetches[f"{name}/onehot_conv_patches_only"] = tf.reduce_sum(
          tf.nn.conv2d(x, eye, strides, padding))
      if cin == 1:  # the examples as the channels of one depthwise conv
        per = tf1.nn.depthwise_conv2d_native_backprop_filter(
            tf.transpose(x, [3, 1, 2, 0]), [kh, kw, batch, cout],
            tf.reshape(tf.transpose(g, [1, 2, 0, 3]), [1, ho, ho, -1]),
            strides, padding)  # [kh, kw, B, cout]
        fetches[f"{name}/depthwise_product"] = tf.reduce_sum(
            tf.square(per), axis=[0, 1, 3])
      fetches[f"{name}/filter_gradient"] = tf.reduce_sum(
          tf1.nn.conv2d_backprop_filter(x, k_shape, g, strides, padding))
  sess = _session(graph, threads)
  out = sess.run(fetches)
  for name, *_ in CONVS:  # the three methods agree
    ref = out[f"{name}/patches_product"]
    for method in ("graphgrad", "patches_ghost", "depthwise_product"):
      if f"{name}/{method}" in out:
        np.testing.assert_allclose(out[f"{name}/{method}"], ref, rtol=1e-4)
  return {k: (lambda t=t: sess.run(t)) for k, t in fetches.items()}


def main(argv=None) -> Dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=None)
  parser.add_argument("--threads", type=int, default=1)
  parser.add_argument("--reps", type=int, default=9)
  parser.add_argument("--out", default=None)
  a = parser.parse_args(argv)
  batch = privacy.batch_size(MODEL, a.batch)
  privacy._set_threads(a.threads)  # pylint: disable=protected-access
  steps = {"minimize": step((), False, batch, a.threads),
           "clip_only": step((), True, batch, a.threads)}
  for name, *_ in CONVS:
    kernel = f"{name}/kernel"
    steps[f"{name}_kernel/minimize"] = step((kernel,), False, batch,
                                            a.threads)
    steps[f"{name}_kernel/clip_only"] = step((kernel,), True, batch,
                                             a.threads)
  steps.update(norms(batch, a.threads))
  res = {"batch": batch, "threads": a.threads,
         **privacy.paired(steps, a.reps)}
  plain = res["step_s"]["minimize"]["median"]
  for k, s in res["step_s"].items():
    r = res["ratio"][k]
    print(f"{k}: {s['median'] * 1e3:.2f} ms [{s['min'] * 1e3:.2f}, "
          f"{s['max'] * 1e3:.2f}], {r['median']:.2f}x the plain step "
          f"[{r['min']:.2f}, {r['max']:.2f}] (plain {plain * 1e3:.2f} ms)",
          flush=True)
  if a.out:
    with open(a.out, "w") as f:
      json.dump(res, f, indent=1, sort_keys=True)
  return res


if __name__ == "__main__":
  main()
