"""examples/distributed_train.py runs end to end on a local cluster."""

import os
import subprocess
import sys

import graphgrad as gg

ROOT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "distributed_train.py")


def test_distributed_example_trains_with_progress_per_worker(tmp_path):
  env = dict(os.environ, PYTHONPATH=os.path.dirname(
      os.path.dirname(os.path.abspath(gg.__file__))))
  proc = subprocess.Popen(
      [sys.executable, EXAMPLE, "--steps", "40", "--every", "20",
       "--ckpt", str(tmp_path), "--timeout", "150"],
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
      start_new_session=True)
  try:
    out, _ = proc.communicate(timeout=180)
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, 9)
      proc.wait(timeout=30)
  assert proc.returncode == 0, out
  for task in (0, 1):
    assert f"[worker {task}] step   20  global step" in out, out
    assert f"[worker {task}] done after " in out, out
  assert "[worker 0] test accuracy" in out
  assert "workers exited with [0, 0]" in out
  # Synchronous: 40 updates, the last checkpoint is at global step 40.
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  path = tf.train.latest_checkpoint(str(tmp_path))
  assert int(tf.train.load_variable(path, "global_step")) == 40
