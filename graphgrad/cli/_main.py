"""The ``graphgrad`` command line."""

import argparse
import os
import sys
import time
from typing import List, Optional

from graphgrad._errors import GraphGradError
from graphgrad.cli import _args
from graphgrad.cli._args import CommandError

_PLOT_FORMATS = (".png", ".svg", ".pdf")


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
  _check_demo_args(args)
  _args.quiet_tensorflow(args.verbose)
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  from graphgrad import demo  # pylint: disable=g-import-not-at-top

  problem = demo.seed_problem(args.seed)
  if args.batch_size > len(problem.x_train):
    raise CommandError(
        f"argument --batch-size: the demo has {len(problem.x_train)} training "
        f"examples, so a batch holds at most {len(problem.x_train)}; got "
        f"{args.batch_size}")
  runs = {label: _demo_run(tf, demo, args, label) for label in _DEMO_RUNS}
  print("training three copies side by side under Adam:")
  for label, what in _DEMO_RUNS.items():
    print(f"  {label:<15} {what.format(noise=args.noise)}")
  _demo_train(runs, problem.batches(args.batch_size, args.seed), args.steps)
  _demo_report(runs, problem)
  print(_DEMO_READING)
  if args.plot:
    try:
      _plot_curves(args.plot, {k: r["curve"] for k, r in runs.items()},
                   f"seed network, Adam lr={args.lr}, batch {args.batch_size}")
    except OSError as e:
      raise CommandError(
          f"--plot {args.plot!r}: cannot write it: {e}") from None
    print(f"\nwrote the loss curves to {args.plot}")
  return 0


def _check_demo_args(args) -> None:
  """Refuses a bad --plot before TensorFlow is even imported."""
  if args.plot and os.path.splitext(args.plot)[1].lower() not in _PLOT_FORMATS:
    raise CommandError(
        f"--plot {args.plot!r}: the file name must end in "
        f"{', '.join(_PLOT_FORMATS)}, e.g. --plot curves.png")
  if args.plot:
    from graphgrad import _installed  # pylint: disable=g-import-not-at-top
    if not _installed.has_module("matplotlib"):
      raise CommandError(
          "--plot needs matplotlib: pip install 'graphgrad[draw]'")
    _args.check_output("--plot", args.plot)


_DEMO_RUNS = {
    "plain backprop": "optimizer.minimize(loss)",
    "seed plan": "the seed's plan: l2_dense's parameter gradients x0.8, "
                 "noise (stddev {noise}) on the upstream gradient into "
                 "l1_dense",
    "reversed plan": "transform_upstream('l2_dense', reverse()): l1_dense "
                     "gets the negated upstream gradient",
}

_DEMO_READING = """
How to read it:
  seed plan      trains like plain backprop. Adam divides each step by a
                 running estimate of the gradient's size, so l2_dense's x0.8
                 cancels (the warning above says so), and the noise is small
                 beside the upstream gradient. Under plain SGD the same x0.8
                 acts as a smaller learning rate for l2_dense.
  reversed plan  l1_dense climbs the loss that l2_dense descends: the loss
                 stays high and the test accuracy near chance. This is the
                 gradient reversal of domain-adversarial training, applied
                 to the whole upstream gradient (notebook 02 applies it to
                 one head's share with transform_edge)."""


def _demo_run(tf, demo, args, label: str) -> dict:
  """One of the two runs: its graph, session, train op and loss curve."""
  import graphgrad as gg  # pylint: disable=g-import-not-at-top
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
      if label == "seed plan":
        print(net.summary())
        print()
      plan = gg.GradientPlan(loss, net)
      if label == "seed plan":
        plan.transform_gradients("l2_dense", gg.transforms.scale(0.8))
        plan.transform_upstream(
            "l2_dense", gg.transforms.add_noise(args.noise, seed=args.seed))
      else:
        plan.transform_upstream("l2_dense", gg.transforms.reverse())
      train = plan.apply_gradients(opt)
    sess = tf.compat.v1.Session(graph=graph)
    sess.run(tf.compat.v1.global_variables_initializer())
  return dict(sess=sess, x=x, y=y, loss=loss, acc=accuracy, train=train,
              curve=[])


def _demo_train(runs, batches, steps: int) -> None:
  bar = _Progress(steps)
  for step in range(1, steps + 1):
    xb, yb = next(batches)
    text = []
    for label, r in runs.items():
      _, lv = r["sess"].run([r["train"], r["loss"]], {r["x"]: xb, r["y"]: yb})
      r["curve"].append(float(lv))
      text.append(f"{label.split()[0]} {lv:.4f}")
    bar.update(step, "loss " + "  ".join(text))
  bar.close()


def _demo_report(runs, problem) -> None:
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


def _inspect_check(args) -> None:
  """``inspect``'s argument checks, before any model is opened."""
  for flag, value, ext in (("--dot", args.dot, ".dot"),
                           ("--png", args.png, ".png")):
    if value and not value.lower().endswith(ext):
      raise CommandError(f"{flag} {value!r}: the file name must end in {ext}")
    if value:
      _args.check_output(flag, value)
  if args.png:
    from graphgrad.analysis import _draw  # pylint: disable=g-import-not-at-top
    if not _draw.can_render():
      raise CommandError(
          "--png needs Graphviz's `dot` program (with pydot or graphviz) or "
          "matplotlib: pip install 'graphgrad[draw]', or write --dot "
          "instead")
  if args.loss and args.output:
    raise CommandError(
        f"--loss {args.loss!r} and --output {args.output!r}: pass one; "
        f"--output analyses the layers an output depends on when the graph "
        f"has no loss.")


def _inspect_reads(args) -> List[str]:
  return [args.path]


def _inspect_compute(args) -> dict:
  """``inspect``'s work on the model: prints the layer table; returns the
  layer graph's picture as data when ``--dot`` or ``--png`` asks for it."""
  _args.quiet_tensorflow(args.verbose)
  import graphgrad as gg  # pylint: disable=g-import-not-at-top
  from graphgrad.analysis import _draw, _metagraph  # pylint: disable=g-import-not-at-top
  _args.phase("reading the model")
  model = _metagraph.load(args.path, tag=args.tag, memory_bytes=args.memory,
                          checks=not args.no_checks, signature=args.signature)
  _args.phase("analysing the graph")
  with model.graph.as_default():
    target = _metagraph.choose_target(model, args.loss, args.output)
    loss, reason = target.tensor, target.reason
    what = "output" if target.is_output else "loss"
    if args.output and model.signature is None:
      reason += ": the layers it depends on"
    net = gg.analyze(loss)
    print(f"{args.path} ({model.kind}): {what} {loss.name} ({reason})")
    if not (args.loss or args.output):
      print("  pass --loss NAME to analyse another tensor" + (
          ", --output KEY another output" if model.signature else ""))
    print()
    print(net.summary())
    _print_ops_without_gradient(net)
    _print_lost_overrides(net)
    if args.memory_report:
      from graphgrad.plan import _recompute
      print()
      print(_recompute.memory_report(net))
    if args.dot or args.png:
      return {"picture": _draw.picture(net)}
  return {}


def _inspect_finish(args, outcome: dict) -> int:
  """Prints ``inspect``'s text and writes its pictures, in the command
  line's own process."""
  from graphgrad.analysis import _draw  # pylint: disable=g-import-not-at-top
  sys.stdout.write(outcome["text"])
  written = [p for p in (args.dot, args.png) if p]
  try:
    for i, path in enumerate(written):
      _draw.write_picture(outcome["picture"], path)
      print(("" if i else "\n") + f"wrote {path}")
  except GraphGradError as e:
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
    _print_ops(net, zero)
  if not missing:
    print(f"gradients: every op on the backward path of {net.loss.name} has "
          f"a registered gradient")
    return
  print(f"gradients: {len(missing)} op(s) on the backward path of "
        f"{net.loss.name} have no registered gradient (tf.gradients stops "
        f"there with LookupError; a plan needs plan.straight_through(op) or "
        f"plan.override_gradient(op, fn) for each):")
  _print_ops(net, missing)


def _print_lost_overrides(net) -> None:
  lost = net.lost_overrides
  if not lost:
    return
  print()
  print(f"gradient overrides: {len(lost)} op(s) carry a gradient_override_map "
        f"name that no gradient function is registered for in this process "
        f"(the function stayed in the process that built the graph):")
  for item in lost:
    layer = net.layer_of(item.op)
    print(f"  {item.op.name}  type {item.op.type}  "
          f"{'layer ' + layer if layer else 'glue'}  override "
          f"{item.override!r}")
    print(f"    {item.hint}:")
    print(f"    {item.declaration}")


def _print_ops(net, ops) -> None:
  for op in ops:
    layer = net.layer_of(op)
    print(f"  {op.name}  type {op.type}  "
          f"{'layer ' + layer if layer else 'glue'}")


def build_parser() -> argparse.ArgumentParser:
  parser = _args.Parser(
      prog="graphgrad",
      description="Rewrite gradients at layer boundaries of TF1 graphs.")
  parser.add_argument("--verbose", action="store_true",
                      help="show TensorFlow's start-up and deprecation logs")
  parser.add_argument("--version", action=_args.Version)
  sub = parser.add_subparsers(dest="command", metavar="command")
  # Also accepted after the command; SUPPRESS keeps a --verbose given before.
  common = _args.Parser(add_help=False)
  common.add_argument("--verbose", action="store_true",
                      default=argparse.SUPPRESS,
                      help="show TensorFlow's start-up and deprecation logs")
  _add_demo(sub, common)
  _add_inspect(sub, common)
  from graphgrad.cli import _grads  # pylint: disable=g-import-not-at-top
  _grads.add_parser(sub)
  from graphgrad.cli import _scan  # pylint: disable=g-import-not-at-top
  _scan.add_parser(sub)
  return parser


def _add_demo(sub, common: argparse.ArgumentParser) -> None:
  """Registers ``graphgrad demo`` on ``sub``, with the ``common`` flags."""
  demo = sub.add_parser(
      "demo", parents=[common],
      help="train the seed network plainly and with two gradient plans",
      description="Builds the two-layer seed network, prints its layer table, "
                  "then trains plain backprop, the seed's gradient plan and a "
                  "gradient-reversal plan side by side on a fixed synthetic "
                  "problem, and says how to read the results.")
  demo.add_argument("--steps", type=_args.positive_int, default=300,
                    help="training steps per run (default 300)")
  demo.add_argument("--seed", type=_args.non_negative_int, default=0,
                    help="seed of data, weights and noise (default 0)")
  demo.add_argument("--batch-size", type=_args.positive_int, default=64,
                    help="minibatch size, at most 2048 (default 64)")
  demo.add_argument("--lr", type=_args.positive_float, default=0.01,
                    help="Adam learning rate (default 0.01)")
  demo.add_argument("--noise", type=_args.non_negative_float, default=0.01,
                    help="stddev of the upstream noise (default 0.01)")
  demo.add_argument("--plot", metavar="FILE",
                    help="write the loss curves of the three runs to FILE "
                         "(.png, .svg or .pdf)")
  demo.set_defaults(func=_demo)


def _add_inspect(sub, common: argparse.ArgumentParser) -> None:
  """Registers ``graphgrad inspect`` on ``sub``, with the ``common`` flags."""
  inspect = sub.add_parser(
      "inspect", parents=[common],
      help="print the layer table of a saved graph (.meta, SavedModel "
           "directory, or frozen .pb)",
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
                            "depends on (a TF2 SavedModel: a key of the "
                            "signature's outputs, default its only one)")
  _args.add_saved_model_flags(inspect)
  inspect.add_argument("--dot", metavar="FILE",
                       help="also write the layer graph as Graphviz DOT")
  inspect.add_argument("--png", metavar="FILE",
                       help="also draw the layer graph to a PNG file")
  inspect.add_argument("--memory-report", action="store_true",
                       help="print each layer's activation bytes and the "
                            "estimated peak with and without recompute()")
  from graphgrad.cli import _sandbox  # pylint: disable=g-import-not-at-top
  _sandbox.add_flags(inspect, runs_graph=False)
  inspect.set_defaults(command_spec=_sandbox.ModelCommand(
      check=_inspect_check, reads=_inspect_reads, compute=_inspect_compute,
      finish=_inspect_finish))


def main(argv: Optional[List[str]] = None) -> int:
  """Runs the command line; returns the exit code (2 for any user error).

  A bad argument, a file that cannot be read or written, and a
  ``GraphGradError`` from the library each print one line,
  ``graphgrad COMMAND: error: ...``, to stderr, with no traceback.
  """
  parser = build_parser()
  try:
    args = parser.parse_args(argv)
  except _args.UsageError as e:
    return _fail(e.prog, str(e))
  spec = getattr(args, "command_spec", None)
  if not (spec or getattr(args, "func", None)):
    parser.print_help()
    return 2
  prog = f"graphgrad {args.command}"
  try:
    if spec is not None:
      from graphgrad.cli import _sandbox  # pylint: disable=g-import-not-at-top
      return _sandbox.run(spec, args, list(sys.argv[1:] if argv is None
                                           else argv))
    return args.func(args)
  except (CommandError, GraphGradError) as e:
    return _fail(prog, str(e))


def _fail(prog: str, message: str) -> int:
  message = " ".join(message.split())  # one line, whatever the message
  print(f"{prog}: error: {message}", file=sys.stderr)
  return 2


if __name__ == "__main__":
  sys.exit(main())
