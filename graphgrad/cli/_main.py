"""The ``graphgrad`` command line."""

import argparse
import os
import sys
import time
from typing import List, Optional

_PLOT_FORMATS = (".png", ".svg", ".pdf")


class CommandError(Exception):
  """A user error: printed as one line, exit code 2."""


def _quiet_tf() -> None:
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


class _Progress:
  """A one-line progress bar on a terminal; a few plain lines elsewhere."""

  def __init__(self, total: int, stream=None, width: int = 30):
    self.total, self.width = total, width
    self.stream = stream or sys.stderr
    self.tty = self.stream.isatty()
    self.start = time.perf_counter()
    self._last_tenth = -1

  def update(self, step: int, text: str) -> None:
    frac = step / max(self.total, 1)
    if self.tty:
      filled = int(frac * self.width)
      bar = "#" * filled + "-" * (self.width - filled)
      self.stream.write(f"\r[{bar}] {step}/{self.total} {text}")
      self.stream.flush()
    elif int(frac * 10) > self._last_tenth:
      self._last_tenth = int(frac * 10)
      self.stream.write(f"{step:>6}/{self.total} {text}\n")

  def close(self) -> None:
    if self.tty:
      self.stream.write("\n")
    self.stream.write(f"done in {time.perf_counter() - self.start:.1f} s\n")
    self.stream.flush()


def _plot_curves(path: str, curves, title: str) -> None:
  """Writes per-step loss curves and their running means to ``path``."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  # A bare Figure needs no pyplot and no display.
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  fig = Figure(figsize=(7, 4))
  ax = fig.add_subplot(1, 1, 1)
  for i, (label, curve) in enumerate(curves.items()):
    color = f"C{i}"
    steps = np.arange(1, len(curve) + 1)
    ax.plot(steps, curve, color=color, alpha=0.25, lw=0.8)
    k = max(1, len(curve) // 20)
    smooth = np.convolve(curve, np.ones(k) / k, mode="valid")
    ax.plot(steps[k - 1:], smooth, color=color, lw=2, label=label)
  ax.set_xlabel("step")
  ax.set_ylabel("training loss (minibatch)")
  ax.set_title(title)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def _demo(args) -> int:
  if args.plot and os.path.splitext(args.plot)[1].lower() not in _PLOT_FORMATS:
    raise CommandError(
        f"--plot {args.plot!r}: the file name must end in "
        f"{', '.join(_PLOT_FORMATS)}, e.g. --plot curves.png")
  if args.plot:
    from graphgrad import _compat  # pylint: disable=g-import-not-at-top
    if not _compat.has_module("matplotlib"):
      raise CommandError(
          "--plot needs matplotlib: pip install 'graphgrad[draw]'")
  _quiet_tf()
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  import graphgrad as gg  # pylint: disable=g-import-not-at-top
  from graphgrad.cli import _demo as demo  # pylint: disable=g-import-not-at-top

  problem = demo.seed_problem(args.seed)
  runs = {}
  for label in ("plain backprop", "graphgrad plan"):
    graph = tf.Graph()
    with graph.as_default():
      tf.compat.v1.set_random_seed(args.seed)
      x, y, logits, loss = demo.seed_network()
      accuracy = tf.reduce_mean(tf.cast(
          tf.equal(tf.argmax(logits, 1), tf.argmax(y, 1)), tf.float32))
      opt = tf.compat.v1.train.AdamOptimizer(args.lr)
      if label == "plain backprop":
        train = opt.minimize(loss)
      else:
        net = gg.analyze(loss)
        print(net.summary())
        print()
        plan = (gg.GradientPlan(loss, net)
                .transform_gradients("l2_dense", gg.transforms.scale(0.8))
                .transform_upstream("l2_dense",
                                    gg.transforms.add_noise(args.noise,
                                                            seed=args.seed)))
        train = plan.apply_gradients(opt)
      sess = tf.compat.v1.Session(graph=graph)
      sess.run(tf.compat.v1.global_variables_initializer())
    runs[label] = dict(sess=sess, x=x, y=y, loss=loss, acc=accuracy,
                       train=train, curve=[])

  print("training both side by side: plain backprop, and the seed's plan "
        f"(l2 parameter gradients x0.8, noise stddev {args.noise} on the "
        "upstream into l1)")
  bar = _Progress(args.steps)
  batches = problem.batches(args.batch_size, args.seed)
  for step in range(1, args.steps + 1):
    xb, yb = next(batches)
    text = []
    for label, r in runs.items():
      _, lv = r["sess"].run([r["train"], r["loss"]], {r["x"]: xb, r["y"]: yb})
      r["curve"].append(float(lv))
      text.append(f"{label.split()[0]} {lv:.4f}")
    bar.update(step, "loss " + "  ".join(text))
  bar.close()

  print()
  print(f"{'run':<16} {'train loss':>10} {'test loss':>10} {'test acc':>9}")
  for label, r in runs.items():
    train_loss = r["sess"].run(r["loss"], {r["x"]: problem.x_train,
                                           r["y"]: problem.y_train})
    test_loss, test_acc = r["sess"].run(
        [r["loss"], r["acc"]], {r["x"]: problem.x_test, r["y"]: problem.y_test})
    r["final"] = (train_loss, test_loss, test_acc)
    print(f"{label:<16} {train_loss:>10.4f} {test_loss:>10.4f} "
          f"{test_acc:>9.3f}")
    r["sess"].close()
  del np
  if args.plot:
    _plot_curves(args.plot, {k: r["curve"] for k, r in runs.items()},
                 f"seed network, Adam lr={args.lr}, batch {args.batch_size}")
    print(f"\nwrote the loss curves to {args.plot}")
  return 0


def _inspect(args) -> int:
  _quiet_tf()
  import graphgrad as gg  # pylint: disable=g-import-not-at-top
  from graphgrad.analysis import _metagraph  # pylint: disable=g-import-not-at-top
  for flag, value, ext in (("--dot", args.dot, ".dot"),
                           ("--png", args.png, ".png")):
    if value and not value.lower().endswith(ext):
      raise CommandError(f"{flag} {value!r}: the file name must end in {ext}")
  if args.loss and args.output:
    raise CommandError(
        f"--loss {args.loss!r} and --output {args.output!r}: pass one; "
        f"--output analyses the layers an output depends on when the graph "
        f"has no loss.")
  try:
    graph = _metagraph.load(args.path, tag=args.tag)
    with graph.as_default():
      if args.output:
        loss = _metagraph.find_loss(graph, args.output, flag="--output")
        what, reason = "output", "given with --output: the layers it depends on"
      elif args.loss:
        loss = _metagraph.find_loss(graph, args.loss)
        what, reason = "loss", "given with --loss"
      else:
        loss, reason = _metagraph.guess_loss(graph)
        what = "loss"
      net = gg.analyze(loss)
      print(f"{args.path} ({_metagraph.kind_of(args.path)}): {what} "
            f"{loss.name} ({reason})")
      if not (args.loss or args.output):
        print("  pass --loss NAME to analyse another tensor")
      print()
      print(net.summary())
      _print_ops_without_gradient(net)
      if args.dot:
        net.draw(args.dot)
        print(f"\nwrote {args.dot}")
      if args.png:
        net.draw(args.png)
        print(f"wrote {args.png}")
  except gg.GraphGradError as e:
    raise CommandError(str(e)) from None
  except OSError as e:
    raise CommandError(f"cannot write output: {e}") from None
  return 0


def _print_ops_without_gradient(net) -> None:
  from graphgrad.analysis import _no_gradient  # pylint: disable=g-import-not-at-top
  missing = _no_gradient.ops_without_gradient(net.loss)
  zero = _no_gradient.ops_with_zero_gradient(net.loss)
  print()
  if zero:
    print(f"gradients: {len(zero)} op(s) on the backward path send no "
          f"gradient below them (their registered gradient is None or zero; "
          f"plan.straight_through(op) gives them an identity backward):")
    for op in zero:
      layer = net.layer_of(op)
      print(f"  {op.name}  type {op.type}  "
            f"{'layer ' + layer if layer else 'glue'}")
  if not missing:
    print(f"gradients: every op on the backward path of {net.loss.name} has "
          f"a registered gradient")
    return
  print(f"gradients: {len(missing)} op(s) on the backward path of "
        f"{net.loss.name} have no registered gradient (tf.gradients stops "
        f"there with LookupError; a plan needs plan.straight_through(op) or "
        f"plan.override_gradient(op, fn) for each):")
  for op in missing:
    layer = net.layer_of(op)
    print(f"  {op.name}  type {op.type}  "
          f"{'layer ' + layer if layer else 'glue'}")


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="graphgrad",
      description="Rewrite gradients at layer boundaries of TF1 graphs.")
  sub = parser.add_subparsers(dest="command", metavar="command")
  demo = sub.add_parser(
      "demo", help="train the seed network plainly and with a gradient plan",
      description="Builds the two-layer seed network, prints its layer table, "
                  "then trains plain backprop and the seed's gradient plan "
                  "side by side on a fixed synthetic problem.")
  demo.add_argument("--steps", type=int, default=300,
                    help="training steps per run (default 300)")
  demo.add_argument("--seed", type=int, default=0,
                    help="seed of data, weights and noise (default 0)")
  demo.add_argument("--batch-size", type=int, default=64,
                    help="minibatch size (default 64)")
  demo.add_argument("--lr", type=float, default=0.01,
                    help="Adam learning rate (default 0.01)")
  demo.add_argument("--noise", type=float, default=0.01,
                    help="stddev of the upstream noise (default 0.01)")
  demo.add_argument("--plot", metavar="FILE",
                    help="write the loss curves of both runs to FILE "
                         "(.png, .svg or .pdf)")
  demo.set_defaults(func=_demo)
  inspect = sub.add_parser(
      "inspect", help="print the layer table of a saved graph (.meta, "
                      "SavedModel directory, or frozen .pb)",
      description="Loads a MetaGraph written by tf.compat.v1.train.Saver, a "
                  "v1 SavedModel directory, or a frozen GraphDef (.pb, "
                  "thawed so its weights form layers), finds its loss (the "
                  "LOSSES collection, or a scalar float op named like a "
                  "loss; --loss or --output overrides), and prints its "
                  "layers, parameters, boundary tensors, and the ops on the "
                  "backward path that have no registered gradient.")
  inspect.add_argument("path", metavar="PATH",
                       help="a .meta file, a SavedModel directory, or a "
                            "frozen .pb file")
  inspect.add_argument("--loss", metavar="NAME",
                       help="name of the loss tensor or op (default: guessed)")
  inspect.add_argument("--output", metavar="NAME",
                       help="for a graph with no loss (an inference graph, a "
                            "frozen .pb): analyse the layers this output "
                            "depends on")
  inspect.add_argument("--tag", default="serve",
                       help="tag of the SavedModel MetaGraph to load "
                            "(default: serve)")
  inspect.add_argument("--dot", metavar="FILE",
                       help="also write the layer graph as Graphviz DOT")
  inspect.add_argument("--png", metavar="FILE",
                       help="also draw the layer graph to a PNG file")
  inspect.set_defaults(func=_inspect)
  from graphgrad.cli import _grads  # pylint: disable=g-import-not-at-top
  _grads.add_parser(sub)
  return parser


def main(argv: Optional[List[str]] = None) -> int:
  parser = build_parser()
  args = parser.parse_args(argv)
  if not getattr(args, "func", None):
    parser.print_help()
    return 2
  if getattr(args, "steps", 1) < 1:
    parser.error("--steps must be at least 1")
  try:
    return args.func(args)
  except CommandError as e:
    message = " ".join(str(e).split())  # one line, whatever the message
    print(f"graphgrad {args.command}: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
