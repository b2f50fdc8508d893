"""A plan on a real TF1 ps/worker cluster: 1 ps and 2 workers, one process each.

Every server runs in a private network namespace on 127.0.0.1; every process
is killed by the cluster's teardown, also when a test fails.
"""

import os
import socket

import cluster_worker as cw
import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from cluster_util import (
  TIMEOUT,
  checkpoint_step,
  events,
  launch_worker,
  print_tails,
  wait_event,
)

tf1 = tf.compat.v1

SYNC_STEPS = 4


def _assert_ended(cluster, pids):
  for (job, task), proc in cluster.procs.items():
    assert proc.returncode is not None, f"{job}:{task} still runs"
  for pid in pids:  # tasks and the namespace's holder
    assert not os.path.exists(f"/proc/{pid}"), f"process {pid} lingers"


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
  """Trains SYNC_STEPS synchronous steps; returns (events, ckpt, refused)."""
  ckpt = tmp_path_factory.mktemp("sync_ckpt")
  cluster = gg.cluster.LocalCluster(
      log_dir=str(tmp_path_factory.mktemp("sync_logs")))
  pids = []
  try:
    with cluster:
      for task in (0, 1):
        launch_worker(cluster, task, "sync", ckpt, SYNC_STEPS)
      pids = [p.pid for p in cluster.procs.values()] + [cluster._holder.pid]
      wait_event(cluster, 1, lambda e: e["kind"] == "session", "session")
      # The servers live in the cluster's own network namespace: from here
      # (this machine's namespace) nothing answers on their ports.
      refused = []
      for addr in cluster.spec["ps"] + cluster.spec["worker"]:
        host, port = addr.split(":")
        with socket.socket() as s:
          s.settimeout(5)
          refused.append(s.connect_ex((host, int(port))) != 0)
      codes = [cluster.wait("worker", t, TIMEOUT) for t in (0, 1)]
      evs = [events(cluster, t) for t in (0, 1)]
      assert codes == [0, 0], [cluster.tail("worker", t) for t in (0, 1)]
  except BaseException:
    print_tails(cluster)
    raise
  finally:
    _assert_ended(cluster, pids)
  return evs, ckpt, refused


def _one(evs, kind):
  found = [e for e in evs if e["kind"] == kind]
  assert len(found) == 1, (kind, found)
  return found[0]


def test_servers_are_unreachable_from_outside_the_cluster(sync_run):
  _, _, refused = sync_run
  assert refused == [True, True, True]


def test_plan_state_and_variables_land_on_the_ps(sync_run):
  evs, _, _ = sync_run
  counter = _one(evs[0], "counter")["name"]
  for task in (0, 1):
    placed = _one(evs[task], "placement")
    assert set(placed["global_vars"]) == {
        "global_step", "l1_dense/kernel", "l1_dense/bias", "l2_dense/kernel",
        "l2_dense/bias", counter}
    assert set(placed["global_vars"].values()) == {"/job:ps/task:0"}
    # SyncReplicasOptimizer keeps its local step on the worker by design.
    assert placed["local_vars"] == {
        "sync_rep_local_step": f"/job:worker/task:{task}"}
    # graphgrad's own ops run on the worker; only the transform's state
    # (its counter and the ops colocated with it) sits on the ps.
    off_worker = placed["graphgrad_ops"]
    assert off_worker and all("count_applications" in n for n in off_worker)
    assert set(off_worker.values()) <= {"/job:ps/task:0", ""}


def test_monitored_session_trains_to_the_last_step_and_checkpoints(sync_run):
  evs, ckpt, _ = sync_run
  for task in (0, 1):
    assert _one(evs[task], "done")["steps"] == SYNC_STEPS
  assert checkpoint_step(ckpt) == SYNC_STEPS
  # The stateful transform's counter is shared on the ps: it was applied to
  # 2 variables (l1's kernel and bias) in each run of both replicas.
  path = tf.train.latest_checkpoint(str(ckpt))
  counter = _one(evs[0], "counter")["name"]
  assert tf.train.load_variable(path, counter) == 2 * 2 * SYNC_STEPS


def _clip(g, c):
  return g * min(1.0, c / np.linalg.norm(g))


def _replica_gradients(before):
  """Per-replica gradients in one process: the plan's, and without l1's clip."""
  with tf.Graph().as_default():
    x, y, loss, plan = cw.build_plan()
    unclipped = gg.GradientPlan(loss).transform_upstream(
        "l2_dense", gg.transforms.clip_by_norm(cw.UPSTREAM_CLIP))
    variables = tf1.trainable_variables()
    grads = [g for g, _ in plan.compute_gradients()]
    raw = [g for g, _ in unclipped.compute_gradients()]
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      for v, value in zip(variables, before):
        v.load(np.asarray(value, np.float32), sess)
      out = []
      for task in (0, 1):
        xs, ys = cw.batch(task)
        out.append(sess.run([grads, raw], {x: xs, y: ys}))
  return out


def test_sync_step_equals_one_process_on_the_averaged_gradient(sync_run):
  evs, _, _ = sync_run
  before = [np.asarray(v) for v in _one(evs[0], "before")["values"]]
  after_ev = _one(evs[0], "after")
  assert _one(evs[0], "before")["global_step"] == 0
  assert after_ev["global_step"] == 1
  after = [np.asarray(v) for v in after_ev["values"]]
  (plan_a, raw_a), (plan_b, raw_b) = _replica_gradients(before)

  # Plan transforms per replica, SyncReplicas averages, AfterAggregation
  # clips l2's averaged gradients, gradient descent applies them.
  mean = [(a + b) / 2 for a, b in zip(plan_a, plan_b)]
  final = mean[:2] + [_clip(g, cw.L2_CLIP) for g in mean[2:]]
  expected = [w - cw.LR * g for w, g in zip(before, final)]
  err = max(np.max(np.abs(a - e)) for a, e in zip(after, expected))
  for a, e in zip(after, expected):
    np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6)

  # Where each transform runs is visible in the numbers: clipping l1 after
  # averaging, or l2 before it, gives updates far from what the cluster did.
  l1_after_mean = [_clip((a + b) / 2, cw.L1_CLIP) for a, b in
                   zip(raw_a[:2], raw_b[:2])]
  l2_per_replica = [(_clip(a, cw.L2_CLIP) + _clip(b, cw.L2_CLIP)) / 2
                    for a, b in zip(plan_a[2:], plan_b[2:])]
  gaps = []
  for wrong in (l1_after_mean + final[2:], final[:2] + l2_per_replica):
    moved = [w - cw.LR * g for w, g in zip(before, wrong)]
    gaps.append(max(np.max(np.abs(m - a)) for m, a in zip(moved, after)))
  print(f"sync step: max |cluster - one process| = {err:.3g}; other "
        f"orders miss by {gaps[0]:.3g} (l1 clipped after averaging) and "
        f"{gaps[1]:.3g} (l2 clipped per replica)")
  assert min(gaps) > 100 * max(err, 1e-7), gaps
