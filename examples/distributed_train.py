"""Trains the seed network with a graphgrad plan on a local TF1 cluster.

One parameter server and two workers (``--workers``), each in its own
process, all on 127.0.0.1 inside a private network namespace (run as root;
``--no-isolate`` otherwise). Synchronous by default: every update averages
one gradient of each worker through ``SyncReplicasOptimizer``; ``--async``
lets each worker update on its own. The plan's transforms run on each
worker, before aggregation; ``AfterAggregation`` clips the averaged
gradients of ``l2_dense`` once, on the chief.

Run it from a checkout::

  python examples/distributed_train.py

Each worker's progress is printed with its name in front. The script is
also the worker program: the launcher starts it again with ``--task``.
"""

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def seed_problem(seed=0, n_train=2048, n_test=1024, dims=10, classes=2):
  """The seed problem of ``graphgrad demo``: labels from a random teacher."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed)
  w1, w2 = rng.normal(size=(dims, 16)), rng.normal(size=(16, classes))
  x = rng.normal(size=(n_train + n_test, dims)).astype(np.float32)
  y = np.eye(classes, dtype=np.float32)[np.argmax(np.tanh(x @ w1) @ w2, 1)]
  return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


def release_workers_hook(sync, n):
  """A chief-only hook that hands each worker a token when the chief stops.

  SyncReplicasOptimizer's tokens are not tied to workers: a fast worker can
  take another's, which then waits for an update that never comes once the
  chief has stopped. The extra tokens let it finish its step and stop.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  class Release(tf.compat.v1.train.SessionRunHook):

    def __init__(self):
      self.op = sync.get_init_tokens_op(num_tokens=n)

    def end(self, session):
      session.run(self.op)

  return Release()


PROGRESS = re.compile(r"(step +\d+  global step.*|done after \d+ steps|"
                      r"test accuracy .*)$")


def say(text):
  """Prints a line with one write, so other threads' output cannot split it."""
  os.write(sys.stdout.fileno(), (text + "\n").encode())


def worker(args):
  """One worker task: builds the graph under replica_device_setter, trains."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  import graphgrad as gg  # pylint: disable=g-import-not-at-top
  tf1 = tf.compat.v1

  spec = json.loads(args.cluster)
  server = gg.cluster.start_server(spec, "worker", args.task)
  config = gg.cluster.session_config(args.task)
  is_chief = args.task == 0
  n_workers = len(spec["worker"])
  x_train, y_train, x_test, y_test = seed_problem()
  shard = slice(args.task, None, n_workers)  # each worker its own examples
  xs, ys = x_train[shard], y_train[shard]

  def dense(x, units, name):
    with tf1.variable_scope(name):
      w = tf1.get_variable("kernel", [x.shape[-1], units])
      b = tf1.get_variable("bias", [units], initializer=tf1.zeros_initializer())
      return tf.nn.bias_add(tf.matmul(x, w), b)

  with tf.Graph().as_default():
    tf1.set_random_seed(0)
    setter = tf1.train.replica_device_setter(
        cluster=tf.train.ClusterSpec(spec),
        worker_device=f"/job:worker/task:{args.task}")
    with tf1.device(setter):
      global_step = tf1.train.get_or_create_global_step()
      x = tf1.placeholder(tf.float32, [None, 10], name="x")
      y = tf1.placeholder(tf.float32, [None, 2], name="y")
      logits = dense(dense(x, 20, "l1_dense"), 2, "l2_dense")
      loss = tf.reduce_mean(
          tf.nn.softmax_cross_entropy_with_logits(labels=y, logits=logits))
      accuracy = tf.reduce_mean(tf.cast(
          tf.equal(tf.argmax(logits, 1), tf.argmax(y, 1)), tf.float32))

      plan = gg.GradientPlan(loss)
      plan.transform_upstream("l2_dense", gg.transforms.add_noise(0.01))
      plan.transform_gradients("l2_dense", gg.transforms.scale(0.8))
      opt = tf1.train.AdamOptimizer(args.lr)
      hooks = [tf1.train.StopAtStepHook(last_step=args.steps)]
      if args.sync:
        opt = tf1.train.SyncReplicasOptimizer(
            gg.AfterAggregation(opt, plan.net).transform_gradients(
                "l2_dense", gg.transforms.clip_by_norm(1.0)),
            replicas_to_aggregate=n_workers)
      train_op = plan.apply_gradients(opt, global_step=global_step)
      if args.sync:
        hooks.append(opt.make_session_run_hook(is_chief, num_tokens=0))
        if is_chief:
          hooks.append(release_workers_hook(opt, n_workers))

    if not is_chief:
      gg.cluster.wait_until_initialized(server.target, config)
    rng = np.random.default_rng(args.task)
    step = 0
    with tf1.train.MonitoredTrainingSession(
        master=server.target, is_chief=is_chief, checkpoint_dir=args.ckpt,
        hooks=hooks, config=config, save_checkpoint_steps=50,
        save_summaries_steps=None, save_summaries_secs=None,
        log_step_count_steps=0, stop_grace_period_secs=5) as sess:
      while not sess.should_stop():
        idx = rng.choice(len(xs), args.batch, replace=False)
        _, g, l = sess.run([train_op, global_step, loss],
                           {x: xs[idx], y: ys[idx]})
        step += 1
        if step % args.every == 0 or step == 1:
          say(f"step {step:4d}  global step {g:4d}  loss {l:.4f}")
    say(f"done after {step} steps")
    if is_chief:  # the trained variables live on the ps
      with tf1.Session(server.target, config=config) as plain:
        acc, g = plain.run([accuracy, global_step], {x: x_test, y: y_test})
      say(f"test accuracy {acc:.3f} at global step {g}")
  return 0


def launch(args):
  """Starts the cluster, runs the workers, prints their progress."""
  import graphgrad as gg  # pylint: disable=g-import-not-at-top
  ckpt = args.ckpt or tempfile.mkdtemp(prefix="graphgrad-ckpt-")
  mode = "synchronous" if args.sync else "asynchronous"
  start = time.monotonic()
  with gg.cluster.LocalCluster(num_ps=1, num_workers=args.workers,
                               isolate=args.isolate) as cluster:
    print(f"cluster {json.dumps(cluster.spec)}; {mode} training of "
          f"{args.steps} steps; checkpoints in {ckpt}", flush=True)
    for task in range(args.workers):
      cluster.launch("worker", task, [
          sys.executable, os.path.abspath(__file__), "--task", str(task),
          "--cluster", json.dumps(cluster.spec), "--ckpt", ckpt,
          "--steps", str(args.steps), "--batch", str(args.batch),
          "--lr", str(args.lr), "--every", str(args.every),
          "--async" if not args.sync else "--sync"])
    seen = [0] * args.workers
    deadline = time.monotonic() + args.timeout
    while True:
      # Whether any runs is asked before reading, so that the last lines of
      # a worker that exits meanwhile are still printed.
      alive = any(cluster.running("worker", t) for t in range(args.workers))
      for task in range(args.workers):
        # Whole lines only: a worker may be writing the last one right now.
        lines = cluster.output("worker", task).split("\n")[:-1]
        for line in lines[seen[task]:]:
          found = PROGRESS.search(line)  # TF may have written before it
          if found:
            print(f"[worker {task}] {found.group(0)}", flush=True)
        seen[task] = len(lines)
      if not alive:
        break
      if time.monotonic() > deadline:
        print(f"timed out after {args.timeout} s", file=sys.stderr)
        return 1
      time.sleep(0.2)
    codes = [cluster.wait("worker", t, 10) for t in range(args.workers)]
    for task, code in enumerate(codes):
      if code != 0:
        print(f"[worker {task}] exited with {code}:\n"
              f"{cluster.tail('worker', task)}", file=sys.stderr)
  if not args.ckpt:
    shutil.rmtree(ckpt, ignore_errors=True)
  print(f"workers exited with {codes} in {time.monotonic() - start:.1f} s")
  return 0 if all(c == 0 for c in codes) else 1


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--workers", type=int, default=2)
  p.add_argument("--steps", type=int, default=300, help="last global step")
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--lr", type=float, default=0.01)
  p.add_argument("--every", type=int, default=50, help="print every N steps")
  p.add_argument("--sync", dest="sync", action="store_true", default=True)
  p.add_argument("--async", dest="sync", action="store_false")
  p.add_argument("--no-isolate", dest="isolate", action="store_false",
                 help="run without a private network namespace (servers "
                      "then listen on every interface)")
  p.add_argument("--ckpt", help="checkpoint directory (kept)")
  p.add_argument("--timeout", type=float, default=600)
  p.add_argument("--task", type=int, help=argparse.SUPPRESS)
  p.add_argument("--cluster", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  return worker(args) if args.task is not None else launch(args)


if __name__ == "__main__":
  sys.exit(main())
