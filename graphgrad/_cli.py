"""The ``graphgrad`` command line."""

import argparse
import os
import sys
import time
from typing import List, Optional


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


def _demo(args) -> int:
  _quiet_tf()
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import graphgrad as gg  # pylint: disable=g-import-not-at-top
  from graphgrad import _demo as demo  # pylint: disable=g-import-not-at-top

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
  return 0


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
  demo.set_defaults(func=_demo)
  return parser


def main(argv: Optional[List[str]] = None) -> int:
  parser = build_parser()
  args = parser.parse_args(argv)
  if not getattr(args, "func", None):
    parser.print_help()
    return 2
  if getattr(args, "steps", 1) < 1:
    parser.error("--steps must be at least 1")
  return args.func(args)


if __name__ == "__main__":
  sys.exit(main())
