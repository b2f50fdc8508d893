"""A worker task of the cluster tests: a graphgrad plan under TF1 replication.

Run by tests/test_cluster.py through gg.cluster.LocalCluster, once per worker
process. It appends one JSON line per thing the tests check to its events
file (``--events``), which nothing else writes to.
The model and plan builder is also imported by the tests, to compute the
single-process reference of a synchronous step.

Modes:
  sync:  SyncReplicasOptimizer(AfterAggregation(GD)), replicas in lockstep,
         each worker always feeding its own fixed batch.
  async: plain GD, paced by an optional limit file that holds the largest
         global step the workers may reach for now.
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

import graphgrad as gg  # noqa: E402
from graphgrad import demo as _demo  # noqa: E402

tf1 = tf.compat.v1

BATCH = 32
LR = 0.5
UPSTREAM_CLIP = 0.05    # per replica, on d loss / d logits
L1_CLIP = 0.02          # per replica, on l1_dense's parameter gradients
L2_CLIP = 0.05          # after aggregation, on l2_dense's parameter gradients


class CountApplications(gg.transforms.Transform):
  """Leaves the gradient as it is and counts its applications in a variable.

  Stands for any stateful transform (a noise seed counter, an annealing
  clock): the state is a variable created while the plan is built.
  """

  name = "count_applications"

  def apply_dense(self, grad, context):
    # One counter per plan, whatever layer the transform is applied at.
    counter = context.resources.get_or_create(
        None, "count_applications/applications",
        lambda: tf1.Variable(0, dtype=tf.int64, trainable=False,
                             name="applications"))
    with tf1.colocate_with(counter):
      bump = counter.assign_add(1)
    with tf.control_dependencies([bump]):
      return tf.identity(grad)


def batch(task):
  """Worker ``task``'s fixed batch of the seed problem."""
  p = _demo.seed_problem(0)
  return (p.x_train[task * BATCH:(task + 1) * BATCH],
          p.y_train[task * BATCH:(task + 1) * BATCH])


def build_plan():
  """The seed network and its plan, in the default graph."""
  tf1.set_random_seed(1)
  x, y, _, loss = _demo.seed_network()
  plan = gg.GradientPlan(loss)
  plan.transform_upstream("l2_dense", gg.transforms.clip_by_norm(UPSTREAM_CLIP))
  plan.transform_gradients("l1_dense", gg.transforms.chain(
      CountApplications(), gg.transforms.clip_by_norm(L1_CLIP)))
  return x, y, loss, plan


_EVENTS = None


def emit(kind, **data):
  # One write per line, to a file of its own: TF and gRPC write to stdout and
  # stderr from other threads, sometimes a line in several pieces.
  line = json.dumps(dict(kind=kind, **data)) + "\n"
  fd = os.open(_EVENTS, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
  try:
    os.write(fd, line.encode())
  finally:
    os.close(fd)


class _Restored(tf1.train.SessionRunHook):
  """Reports the global step right after the session is created or restored."""

  def __init__(self, gs):
    self.gs = gs

  def after_create_session(self, session, coord):
    emit("session", global_step=int(session.run(self.gs)))


class _ReleaseWorkers(tf1.train.SessionRunHook):
  """When the chief stops, hands each worker a token.

  A worker may wait for its token from an update that will never come (the
  other worker took it); without this, it would wait forever.
  """

  def __init__(self, sync, n):
    self.op = sync.get_init_tokens_op(num_tokens=n)

  def end(self, session):
    session.run(self.op)


def _read_limit(path):
  try:
    with open(path) as f:
      return int(f.read().strip() or 0)
  except (OSError, ValueError):
    return 0


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--cluster", required=True)
  parser.add_argument("--task", type=int, required=True)
  parser.add_argument("--mode", choices=["sync", "async"], required=True)
  parser.add_argument("--ckpt", required=True)
  parser.add_argument("--events", required=True)
  parser.add_argument("--last-step", type=int, required=True)
  parser.add_argument("--save-steps", type=int, default=10)
  parser.add_argument("--limit-file")
  parser.add_argument("--pace", type=float, default=0.0)
  args = parser.parse_args()
  global _EVENTS
  _EVENTS = args.events

  spec = json.loads(args.cluster)
  server = gg.cluster.start_server(spec, "worker", args.task)
  config = gg.cluster.session_config(args.task)
  is_chief = args.task == 0
  xs, ys = batch(args.task)

  with tf.Graph().as_default():
    setter = tf1.train.replica_device_setter(
        cluster=tf.train.ClusterSpec(spec),
        worker_device=f"/job:worker/task:{args.task}")
    with tf1.device(setter):
      gs = tf1.train.get_or_create_global_step()
      x, y, _, plan = build_plan()
      sgd = tf1.train.GradientDescentOptimizer(LR)
      if args.mode == "sync":
        inner = gg.AfterAggregation(sgd, plan.net).transform_gradients(
            "l2_dense", gg.transforms.clip_by_norm(L2_CLIP))
        opt = tf1.train.SyncReplicasOptimizer(
            inner, replicas_to_aggregate=2, total_num_replicas=2)
      else:
        opt = sgd
      train_op = plan.apply_gradients(opt, global_step=gs)
    trainable = tf1.trainable_variables()
    emit("counter", name=plan.resources.get(
        None, "count_applications/applications").op.name)
    graph = tf1.get_default_graph()
    emit("placement",
         global_vars={v.op.name: v.device for v in tf1.global_variables()},
         local_vars={v.op.name: v.device for v in tf1.local_variables()},
         graphgrad_ops={op.name: op.device for op in graph.get_operations()
                        if op.name.startswith("graphgrad/")
                        and not op.device.startswith("/job:worker/")})

    hooks = [tf1.train.StopAtStepHook(last_step=args.last_step), _Restored(gs)]
    if args.mode == "sync":
      # No initial tokens: each worker's run returns after the update its
      # gradient went into, so every update averages exactly one gradient of
      # each replica, computed on the current weights.
      hooks.append(opt.make_session_run_hook(is_chief, num_tokens=0))
      if is_chief:
        hooks.append(_ReleaseWorkers(opt, 2))
      # A replica may take both tokens of an update (the other's too) and
      # put two gradients into the next one. Waiting until the queue is empty
      # before the next step keeps the replicas in lockstep: every update
      # then holds exactly one gradient of each.
      queue = opt._sync_token_queue  # pylint: disable=protected-access
      tokens_left = queue.size()
    if not is_chief:
      gg.cluster.wait_until_initialized(server.target, config)
    feed = {x: xs, y: ys}
    steps = 0
    with tf1.train.MonitoredTrainingSession(
        master=server.target, is_chief=is_chief, checkpoint_dir=args.ckpt,
        hooks=hooks, config=config, save_checkpoint_steps=args.save_steps,
        save_summaries_steps=None, save_summaries_secs=None,
        log_step_count_steps=0, stop_grace_period_secs=5) as sess:
      if is_chief and args.mode == "sync":
        values, g = sess.run([trainable, gs])
        emit("before", global_step=int(g), values=[v.tolist() for v in values])
      last = -1
      waiting = False
      while not sess.should_stop():
        if args.limit_file and last >= _read_limit(args.limit_file):
          if not waiting:
            emit("waiting", global_step=last)
            waiting = True
          time.sleep(0.02)
          continue
        waiting = False
        _, g = sess.run([train_op, gs], feed)
        steps += 1
        while args.mode == "sync" and not sess.should_stop():
          if sess.run(tokens_left) == 0:
            break
          time.sleep(0.005)
        if is_chief and args.mode == "sync" and steps == 1:
          values, g1 = sess.run([trainable, gs])
          emit("after", global_step=int(g1),
               values=[v.tolist() for v in values])
        last = int(g)
        emit("step", step=steps, global_step=last)
        if args.pace:
          time.sleep(args.pace)
    emit("done", steps=steps)
  return 0


if __name__ == "__main__":
  sys.exit(main())
