"""Driving cluster_worker.py processes from the tests: events and waits."""

import json
import os
import sys
import time

import tensorflow as tf

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      "cluster_worker.py")
TIMEOUT = 120.0  # seconds for any one thing to happen; never reached when green


def launch_worker(cluster, task, mode, ckpt, last_step, **flags):
  argv = [sys.executable, WORKER, "--cluster", json.dumps(cluster.spec),
          "--task", str(task), "--mode", mode, "--ckpt", str(ckpt),
          "--last-step", str(last_step), "--events", events_path(cluster, task)]
  for k, v in flags.items():
    argv += ["--" + k.replace("_", "-"), str(v)]
  return cluster.launch("worker", task, argv)


def events_path(cluster, task):
  return os.path.join(cluster.log_dir, f"worker{task}.events")


def events(cluster, task, kind=None):
  """The events worker ``task`` reported, across restarts, in order."""
  try:
    with open(events_path(cluster, task), encoding="utf-8") as f:
      text = f.read()
  except FileNotFoundError:
    return []
  out = []
  # Complete lines only: the worker may be writing the last one right now.
  for line in text.split("\n")[:-1]:
    e = json.loads(line)
    if kind is None or e["kind"] == kind:
      out.append(e)
  return out


def wait_event(cluster, task, pred, what, start=0, timeout=TIMEOUT,
               alive=True):
  """Waits until an event at index >= ``start`` satisfies ``pred``.

  Returns ``(index, event)``. Fails with the worker's output if it takes
  longer than ``timeout`` or (with ``alive``) if the worker exits first.
  """
  deadline = time.monotonic() + timeout
  while True:
    evs = events(cluster, task)
    for i in range(start, len(evs)):
      if pred(evs[i]):
        return i, evs[i]
    if alive and not cluster.running("worker", task):
      raise AssertionError(f"worker {task} exited before {what}:\n"
                           f"{cluster.tail('worker', task)}")
    if time.monotonic() > deadline:
      raise AssertionError(
          f"worker {task}: no {what} within {timeout} s:\n"
          f"{cluster.tail('worker', task)}")
    time.sleep(0.05)


def checkpoint_step(ckpt_dir):
  """The global step of the newest checkpoint in ``ckpt_dir`` (or -1)."""
  path = tf.train.latest_checkpoint(str(ckpt_dir))
  if path is None:
    return -1
  return int(tf.train.load_variable(path, "global_step"))


def wait_checkpoint(ckpt_dir, at_least, timeout=TIMEOUT):
  deadline = time.monotonic() + timeout
  while True:
    try:
      step = checkpoint_step(ckpt_dir)
    except (tf.errors.OpError, ValueError):  # being written right now
      step = -1
    if step >= at_least:
      return step
    if time.monotonic() > deadline:
      raise AssertionError(f"no checkpoint at step >= {at_least} in "
                           f"{timeout} s; newest is at {step}")
    time.sleep(0.1)


def print_tails(cluster):
  """Prints the end of every task's output, to diagnose a failed test."""
  for job in ("ps", "worker"):
    for task in range(len(cluster.spec[job])):
      print(f"--- {job}{task} ---\n{cluster.tail(job, task, 40)}")
