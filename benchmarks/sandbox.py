"""What the sandbox costs ``graphgrad grads``: start-up and a whole run.

``python -m benchmarks.sandbox [--reps N]`` measures, side by side in one
process, on a saved 4-layer MLP (``.meta`` plus a checkpoint):

- the confinement itself: ``_confine.confine`` and ``self_test`` in a fresh
  process of their own (Landlock rules, seccomp filter, rlimits, and the
  self-test's attempts), in milliseconds;
- the child's start-up: from starting it to its ``confined`` message, and
  to its first phase after TensorFlow is imported;
- a whole ``graphgrad grads`` run as a person types it, a fresh process
  each time, sandboxed and with ``--no-sandbox`` (the in-process run of
  graphgrad 0.4), the two alternating.

Each figure is the median (min-max) of ``--reps`` repetitions; the ratio is
the median of the per-repetition ratios. Results go to stdout and to
``benchmarks/sandbox_results.json``.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

_CONFINE = """
import importlib.util, sys, time, os
spec = importlib.util.spec_from_file_location("c", sys.argv[1])
c = importlib.util.module_from_spec(spec); spec.loader.exec_module(c)
paths = [p for p in [sys.prefix, sys.base_prefix, "/lib", "/usr/lib"]
         + sys.path if p and os.path.isabs(p) and os.path.exists(p)]
dirs = [sys.argv[2], "/tmp"]
start = time.perf_counter()
c.confine(paths, c.Limits(8 << 30, 600))
mid = time.perf_counter()
c.self_test(dirs, "/etc/passwd")
end = time.perf_counter()
print((mid - start) * 1e3, (end - mid) * 1e3)
"""


def _model(folder: str) -> str:
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf1 = tf.compat.v1
  with tf.Graph().as_default():
    x = tf1.placeholder(tf.float32, [None, 64], name="x")
    h = x
    for i in range(4):
      w = tf1.get_variable(f"fc{i}/kernel", [64, 64])
      b = tf1.get_variable(f"fc{i}/bias", [64],
                           initializer=tf1.zeros_initializer())
      h = tf.tanh(tf.matmul(h, w) + b)
    loss = tf.reduce_mean(tf.square(h), name="loss")
    tf1.add_to_collection(tf1.GraphKeys.LOSSES, loss)
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      prefix = tf1.train.Saver().save(sess, os.path.join(folder, "mlp"))
  np.savez(os.path.join(folder, "feed.npz"),
           x=np.random.default_rng(0).normal(size=(32, 64)).astype("f4"))
  return prefix


def _stats(values):
  return {"median": statistics.median(values), "min": min(values),
          "max": max(values)}


def _confinement(folder: str, reps: int):
  rules, test = [], []
  for _ in range(reps):
    out = subprocess.run(
        [sys.executable, "-I", "-c", _CONFINE,
         os.path.join(ROOT, "graphgrad", "cli", "_confine.py"), folder],
        capture_output=True, text=True, check=True).stdout.split()
    rules.append(float(out[0]))
    test.append(float(out[1]))
  return {"confine_ms": _stats(rules), "self_test_ms": _stats(test)}


def _child_startup(prefix: str, reps: int):
  """Seconds from starting the child to ``confined``, and to its first
  phase after TensorFlow (``reading the model``)."""
  sys.path.insert(0, ROOT)
  from graphgrad.cli import _main, _sandbox  # pylint: disable=g-import-not-at-top
  argv = ["grads", prefix + ".meta", "--checkpoint", prefix]
  args = _main.build_parser().parse_args(argv)
  args.memory_text = _sandbox.format_size(args.memory)
  confined, imported = [], []
  for _ in range(reps):
    start = time.perf_counter()
    child = _sandbox._Child(  # pylint: disable=protected-access
        _sandbox.orders(args.command_spec, args, argv), verbose=False)
    seen = {}
    deadline = time.monotonic() + 120
    while "reading the model" not in seen and time.monotonic() < deadline:
      line = _read_message(child)
      if line is None:
        break
      seen.setdefault(line.get("phase", line["kind"]),
                      time.perf_counter() - start)
    child.kill()
    child.proc.wait()
    confined.append(seen["confined"])
    imported.append(seen["reading the model"])
  return {"to_confined_s": _stats(confined),
          "to_tensorflow_imported_s": _stats(imported)}


def _read_message(child):
  """The child's next message, read from its channel (blocking)."""
  buffer = b""
  while not buffer.endswith(b"\n"):
    chunk = os.read(child.channel, 1)
    if not chunk:
      return None
    buffer += chunk
  return json.loads(buffer)


def _whole_runs(prefix: str, folder: str, reps: int):
  env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3")
  base = [sys.executable, "-m", "graphgrad", "grads", prefix + ".meta",
          "--checkpoint", prefix, "--feed", os.path.join(folder, "feed.npz")]
  times = {"sandbox": [], "in_process": []}
  ratios = []
  for i in range(reps):
    order = ["sandbox", "in_process"] if i % 2 == 0 else ["in_process",
                                                          "sandbox"]
    sample = {}
    for kind in order:
      argv = base + ([] if kind == "sandbox" else ["--no-sandbox"])
      start = time.perf_counter()
      subprocess.run(argv, env=env, capture_output=True, check=True)
      sample[kind] = time.perf_counter() - start
      times[kind].append(sample[kind])
    ratios.append(sample["sandbox"] / sample["in_process"])
  return {"sandbox_s": _stats(times["sandbox"]),
          "in_process_s": _stats(times["in_process"]),
          "ratio": _stats(ratios)}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--reps", type=int, default=7)
  args = parser.parse_args(argv)
  with tempfile.TemporaryDirectory() as folder:
    prefix = _model(folder)
    results = {"reps": args.reps,
               "confinement": _confinement(folder, args.reps),
               "child_startup": _child_startup(prefix, args.reps),
               "grads_run": _whole_runs(prefix, folder, args.reps)}
  text = json.dumps(results, indent=1)
  print(text)
  with open(os.path.join(HERE, "sandbox_results.json"), "w",
            encoding="utf-8") as f:
    f.write(text + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
