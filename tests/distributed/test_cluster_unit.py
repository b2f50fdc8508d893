"""LocalCluster's process handling, without TensorFlow servers."""

import signal
import subprocess
import sys

import pytest
import tensorflow as tf

import graphgrad as gg

tf1 = tf.compat.v1
SLEEPER = [sys.executable, "-c", "import time; print('up', flush=True); "
           "time.sleep(60)"]


@pytest.fixture
def plain_cluster(tmp_path):
  cluster = gg.cluster.LocalCluster(num_ps=1, num_workers=2, isolate=False,
                                    log_dir=str(tmp_path))
  try:
    yield cluster
  finally:
    cluster.stop()


@pytest.mark.parametrize("kw", [dict(num_ps=0), dict(num_workers=1.5),
                                dict(num_workers=True)])
def test_task_counts_are_checked(kw):
  with pytest.raises(gg.GraphGradError, match="must be a positive integer"):
    gg.cluster.LocalCluster(isolate=False, **kw)


def test_ports_are_distinct_and_loopback(tmp_path):
  c = gg.cluster.LocalCluster(num_ps=2, num_workers=3, isolate=False,
                              log_dir=str(tmp_path))
  addrs = c.spec["ps"] + c.spec["worker"]
  assert len(set(addrs)) == 5
  assert all(a.startswith("127.0.0.1:") for a in addrs)


def test_launch_kill_restart_and_output(plain_cluster):
  c = plain_cluster
  c.launch("worker", 1, SLEEPER)
  with pytest.raises(gg.cluster.ClusterError, match="still running"):
    c.launch("worker", 1, SLEEPER)
  with pytest.raises(gg.cluster.ClusterError, match="still runs after 0.2 s"):
    c.wait("worker", 1, timeout=0.2)
  assert c.kill("worker", 1) == -signal.SIGKILL
  assert not c.running("worker", 1)
  c.launch("worker", 1, [sys.executable, "-c", "print('again')"])
  assert c.wait("worker", 1, timeout=60) == 0
  out = c.output("worker", 1)
  assert "again" in out and out.index("again") > 0  # a restart appends
  assert c.output("worker", 0) == ""


def test_stop_kills_every_process_group(plain_cluster):
  c = plain_cluster
  # A child in the task's process group dies with it.
  c.launch("worker", 0, [sys.executable, "-c",
                         "import subprocess, sys, time; subprocess.Popen("
                         "[sys.executable, '-c', 'import time; "
                         "time.sleep(60)']); time.sleep(60)"])
  pgid = c.procs[("worker", 0)].pid
  c.stop()
  assert not c.running("worker", 0)
  ps = subprocess.run(["ps", "-o", "pid=", "-g", str(pgid)],
                      capture_output=True, text=True, timeout=30)
  assert ps.stdout.strip() == ""


def test_unknown_task(plain_cluster):
  with pytest.raises(gg.cluster.ClusterError, match="no task worker:2"):
    plain_cluster.launch("worker", 2, SLEEPER)


def test_isolated_launch_needs_start(tmp_path):
  c = gg.cluster.LocalCluster(log_dir=str(tmp_path))
  with pytest.raises(gg.cluster.ClusterError, match="not started"):
    c.launch("worker", 0, SLEEPER)


def test_isolated_tasks_share_a_private_namespace(tmp_path):
  probe = [sys.executable, "-c",
           "import os; print(os.readlink('/proc/self/ns/net'))"]
  with gg.cluster.LocalCluster(log_dir=str(tmp_path)) as c:
    for t in (0, 1):
      c.launch("worker", t, probe)
      assert c.wait("worker", t, timeout=60) == 0
    inside = {c.output("worker", t).split()[-1] for t in (0, 1)}
  mine = __import__("os").readlink("/proc/self/ns/net")
  assert len(inside) == 1 and mine not in inside


def _path_of(tmp_path, **scripts) -> str:
  """A directory holding only the shell scripts ``scripts``, for ``PATH``."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  for name, body in scripts.items():
    script = bin_dir / name
    script.write_text("#!/bin/sh\n" + body + "\n")
    script.chmod(0o755)
  return str(bin_dir)


def test_missing_tools(monkeypatch, tmp_path):
  # The tools are looked up on PATH; an empty one holds neither.
  monkeypatch.setenv("PATH", _path_of(tmp_path))
  c = gg.cluster.LocalCluster(log_dir=str(tmp_path))
  with pytest.raises(gg.cluster.ClusterError,
                     match="needs util-linux's unshare and nsenter"):
    c.start()


def test_namespace_failure_is_explained(monkeypatch, tmp_path):
  # An unshare on PATH that is refused, as it is without CAP_SYS_ADMIN.
  monkeypatch.setenv("PATH", _path_of(
      tmp_path, unshare="echo 'unshare: Operation not permitted' >&2; exit 1",
      nsenter="exit 1"))
  c = gg.cluster.LocalCluster(log_dir=str(tmp_path))
  with pytest.raises(gg.cluster.ClusterError,
                     match=r"private network namespace \(unshare: Operation "
                           r"not permitted\).*isolate=False"):
    c.start()
  c.stop()


def test_stop_reports_a_process_that_does_not_die(tmp_path):
  class Stuck:
    pid = 2 ** 22 + 12345  # no such process group: killpg finds nothing

    def poll(self):
      return None

    def wait(self, timeout=None):
      raise subprocess.TimeoutExpired("stuck", timeout)

  c = gg.cluster.LocalCluster(isolate=False, log_dir=str(tmp_path))
  c.procs[("worker", 0)] = Stuck()
  with pytest.raises(gg.cluster.ClusterError,
                     match=r"processes \[4206649\] did not exit"):
    c.stop(timeout=0.1)


def test_wait_until_initialized_times_out(graph):
  tf1.get_variable("never_initialized", initializer=1.0)
  with pytest.raises(gg.cluster.ClusterError,
                     match="did not initialize 1 variables.*never_initialized"):
    gg.cluster.wait_until_initialized("", timeout=0.3, poll=0.05)

