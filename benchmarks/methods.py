"""Training methods built with graphgrad, on scikit-learn's bundled digits.

A 64-128-128-10 ReLU MLP on the 8x8 digits (1,797 images, shipped with
scikit-learn, no download), fixed stratified 80/20 split, trained with
backprop, feedback alignment, direct feedback alignment, synthetic gradients
and backprop with annealed gradient noise. Each method is one GradientPlan
on the same graph.

Run ``python -m benchmarks.methods`` from the repository root: it trains
every method for 3 seeds and writes ``benchmarks/METHODS.md`` (table) and
``benchmarks/methods.png`` (test accuracy per epoch).
"""

import argparse
import os
import time
from typing import Dict, List

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import benchmarks  # noqa: E402
import graphgrad as gg  # noqa: E402

tf1 = tf.compat.v1

METHODS = ("backprop", "feedback_alignment", "dfa", "synthetic",
           "annealed_noise", "top_only")
LABELS = {
    "backprop": "backprop",
    "feedback_alignment": "feedback alignment",
    "dfa": "direct feedback alignment",
    "synthetic": "synthetic gradients",
    "annealed_noise": "backprop + annealed noise",
    "top_only": "control: only the top layer trains",
}
SIZES = (64, 128, 128, 10)
HIDDEN = ("l1", "l2", "l3")  # dense layers; l3 gives the logits


def load_digits(test_size: float = 0.2):
  """The bundled 8x8 digits, scaled to [0, 1], fixed stratified split."""
  from sklearn.datasets import load_digits as _load  # pylint: disable=g-import-not-at-top
  from sklearn.model_selection import train_test_split  # pylint: disable=g-import-not-at-top
  d = _load()
  x = (d.data / 16.0).astype(np.float32)
  return train_test_split(x, d.target, test_size=test_size, random_state=0,
                          stratify=d.target)


def _dense(x, units, name, seed):
  with tf1.variable_scope(name):
    w = tf1.get_variable(
        "kernel", [x.shape[-1], units],
        initializer=tf1.glorot_uniform_initializer(seed=seed))
    b = tf1.get_variable("bias", [units], initializer=tf1.zeros_initializer())
    return tf.nn.bias_add(tf.matmul(x, w), b)


def build(method: str, seed: int, lr: float = 1e-3):
  """The MLP and the plan of ``method``; returns (x, y, train op, accuracy)."""
  tf1.set_random_seed(seed)
  step = tf1.train.get_or_create_global_step()
  x = tf1.placeholder(tf.float32, [None, SIZES[0]], name="x")
  y = tf1.placeholder(tf.int64, [None], name="y")
  h = x
  for i, (name, units) in enumerate(zip(HIDDEN, SIZES[1:])):
    h = _dense(h, units, name, seed=seed * 10 + i)
    if i < len(HIDDEN) - 1:
      h = tf.nn.relu(h)
  logits = h
  loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=y, logits=logits), name="loss")
  plan = gg.GradientPlan(loss)
  upper = HIDDEN[1:]  # the layers whose backward pass feeds a hidden layer
  if method == "feedback_alignment":
    for name in upper:
      plan.replace_backward(name, gg.backward.feedback_alignment(seed=seed))
  elif method == "dfa":
    for name in upper:
      plan.replace_backward(name,
                            gg.backward.direct_feedback_alignment(seed=seed))
  elif method == "synthetic":
    onehot = tf.one_hot(y, SIZES[-1])
    for name in upper:
      plan.replace_backward(name, gg.backward.synthetic(labels=onehot,
                                                        seed=seed))
  elif method == "annealed_noise":
    for name in HIDDEN:
      plan.transform_gradients(
          name, gg.transforms.add_noise(eta=0.01, gamma=0.55, seed=seed))
  elif method == "top_only":  # control: no learning signal below l3
    plan.transform_upstream("l3", gg.transforms.zero())
  elif method != "backprop":
    raise ValueError(f"unknown method {method!r}; one of {METHODS}")
  train = plan.apply_gradients(tf1.train.AdamOptimizer(lr), global_step=step)
  accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, 1), y),
                                    tf.float32))
  return x, y, train, accuracy


def run(method: str, seed: int, epochs: int, batch_size: int = 32,
        data=None) -> List[float]:
  """Trains one method; returns the test accuracy after each epoch."""
  x_train, x_test, y_train, y_test = data or load_digits()
  rng = np.random.default_rng(seed)
  curve = []
  with tf.Graph().as_default():
    x, y, train, accuracy = build(method, seed)
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      for _ in range(epochs):
        order = rng.permutation(len(x_train))
        for i in range(0, len(order), batch_size):
          idx = order[i:i + batch_size]
          sess.run(train, {x: x_train[idx], y: y_train[idx]})
        curve.append(float(sess.run(accuracy, {x: x_test, y: y_test})))
  return curve


def write_results(curves: Dict[str, np.ndarray], times: Dict[str, float],
                  epochs: int, out_dir: str) -> None:
  """Writes METHODS.md (table) and methods.png (accuracy per epoch)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  seeds = len(next(iter(curves.values())))
  x_train, x_test, _, _ = load_digits()
  lines = [
      "# Training methods on the bundled digits",
      "",
      f"`python -m benchmarks.methods` ({seeds} seeds, {epochs} epochs). "
      f"scikit-learn's 8x8 digits (1,797 images, no download), stratified "
      f"80/20 split with `random_state=0` ({len(x_train)} train, "
      f"{len(x_test)} test), pixels / 16. A 64-128-128-10 ReLU MLP "
      f"(`l1`, `l2`, `l3`; Glorot-uniform kernels, zero biases), mean "
      f"softmax cross-entropy, Adam (lr 1e-3), batch 32, one "
      f"`plan.apply_gradients` train op per method. Test accuracy after the "
      f"last epoch, mean +- std over seeds 0..{seeds - 1} (population std); "
      f"the seed sets the initial weights, feedback matrices and batch order.",
      "",
      "| method | graphgrad plan | test accuracy (%) | s per run |",
      "| --- | --- | --- | --- |",
  ]
  plans = {
      "backprop": "none (plain `tf.gradients`)",
      "feedback_alignment": "`replace_backward(l, feedback_alignment(seed))`, "
                            "l in l2, l3",
      "dfa": "`replace_backward(l, direct_feedback_alignment(seed))`, "
             "l in l2, l3",
      "synthetic": "`replace_backward(l, synthetic(labels=onehot))`, "
                   "l in l2, l3 (linear cDNI modules)",
      "annealed_noise": "`transform_gradients(l, add_noise(eta=0.01, "
                        "gamma=0.55))`, l in l1, l2, l3",
      "top_only": "`transform_upstream(l3, zero())`: l1, l2 stay random",
  }
  for method, c in curves.items():
    final = 100 * c[:, -1]
    lines.append(f"| {LABELS[method]} | {plans[method]} | "
                 f"{final.mean():.2f} +- {final.std():.2f} | "
                 f"{times[method]:.1f} |")
  lines += [
      "",
      "The control row shows what the top layer alone reaches on fixed random "
      "hidden features: a method whose lower layers learn from its signal "
      "should beat it. On this small problem every method reaches "
      "backprop's final accuracy; the plot shows that the replacements and "
      "the noise learn more slowly in the first epochs. Seconds per run are "
      "wall time on a shared 2-core CPU, graph building included: indicative "
      "only.",
      "",
      "![test accuracy per epoch](methods.png)",
      "",
  ]
  with open(os.path.join(out_dir, "METHODS.md"), "w") as f:
    f.write("\n".join(lines))
  fig, ax = plt.subplots(figsize=(7, 4.5))
  epochs_axis = np.arange(1, epochs + 1)
  for method, c in curves.items():
    mean, std = 100 * c.mean(0), 100 * c.std(0)
    ax.plot(epochs_axis, mean, label=LABELS[method],
            linestyle="--" if method == "top_only" else "-")
    ax.fill_between(epochs_axis, mean - std, mean + std, alpha=0.2)
  ax.set_xlabel("epoch")
  ax.set_ylabel("test accuracy (%)")
  ax.set_ylim(80, 100)
  ax.grid(alpha=0.3)
  ax.set_title(f"digits, 64-128-128-10 MLP, mean +- std over {seeds} seeds")
  ax.legend(loc="lower right", fontsize=8)
  fig.tight_layout()
  fig.savefig(os.path.join(out_dir, "methods.png"), dpi=120)
  plt.close(fig)


def train_all(methods=METHODS, seeds: int = 3, epochs: int = 40, log=print):
  """Trains every method for every seed; returns (curves, seconds per run)."""
  data = load_digits()
  curves, times = {}, {}
  for method in methods:
    start = time.time()
    curves[method] = np.array([run(method, s, epochs, data=data)
                               for s in range(seeds)])
    times[method] = (time.time() - start) / seeds
    final = curves[method][:, -1]
    log(f"{LABELS[method]:36s} {100 * final.mean():6.2f} +- "
        f"{100 * final.std():4.2f}  ({times[method]:.1f} s per run)")
  return curves, times


def _suite(config):
  """The methods table as a section of benchmarks/RESULTS.md."""
  epochs = 40
  curves, times = train_all(epochs=epochs, log=lambda m: None)
  write_results(curves, times, epochs, config.out_dir)
  with open(os.path.join(config.out_dir, "METHODS.md")) as f:
    markdown = f.read().replace("# Training methods", "## Training methods", 1)
  final = {m: [float(v) for v in c[:, -1]] for m, c in curves.items()}
  return benchmarks.SuiteResult(markdown=markdown, data={"final": final},
                                figures=["methods.png"])


benchmarks.register("methods", _suite, order=90, in_tiny=False)


def main(argv=None) -> Dict[str, np.ndarray]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seeds", type=int, default=3)
  parser.add_argument("--epochs", type=int, default=40)
  parser.add_argument("--methods", nargs="*", default=list(METHODS))
  parser.add_argument("--out",
                      default=os.path.dirname(os.path.abspath(__file__)),
                      help="directory for METHODS.md and methods.png")
  parser.add_argument("--no-write", action="store_true",
                      help="print the table only")
  args = parser.parse_args(argv)
  curves, times = train_all(args.methods, args.seeds, args.epochs)
  if not args.no_write:
    write_results(curves, times, args.epochs, args.out)
  return curves


if __name__ == "__main__":
  main()
