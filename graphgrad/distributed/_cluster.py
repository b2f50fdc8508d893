"""Local TF1 ps/worker clusters: one process per task, on loopback only.

:class:`LocalCluster` runs a between-graph cluster on one machine, for tests
and examples: it picks free ports on ``127.0.0.1``, starts each task in its
own process group, restarts or kills any of them, and ends them all on
:meth:`LocalCluster.stop` or when its ``with`` block exits. TensorFlow's gRPC
server listens on every interface whatever the ``ClusterSpec`` says, so by
default the cluster runs in a private network namespace with only a loopback
device; that needs root and util-linux's ``unshare`` and ``nsenter`` on
``PATH``. ``isolate=False`` runs without it.

The module is also the parameter-server program::

  python -m graphgrad.distributed._cluster \\
      --cluster '{"ps": [...], "worker": [...]}' --job ps --task 0
"""

import argparse
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

from graphgrad import _errors
from graphgrad.distributed._process import die_with_parent, killpg

log = logging.getLogger("graphgrad")

Task = Tuple[str, int]


class ClusterError(_errors.GraphGradError, RuntimeError):
  """A local cluster process failed to start, stop or finish in time."""


def free_ports(n: int) -> List[int]:
  """Returns ``n`` distinct ports that are free on ``127.0.0.1``.

  Example:
    >>> ports = free_ports(3)
    >>> len(set(ports)), all(1024 <= p < 65536 for p in ports)
    (3, True)
  """
  socks = []
  try:
    for _ in range(n):
      s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
      s.bind(("127.0.0.1", 0))
      socks.append(s)
    return [s.getsockname()[1] for s in socks]
  finally:
    for s in socks:
      s.close()


def start_server(cluster: Dict[str, List[str]], job: str, task: int):
  """Starts this process's ``tf.compat.v1.train.Server`` for ``job:task``.

  Args:
    cluster: ``{"ps": [...], "worker": [...]}`` as ``LocalCluster.spec``.
    job: ``"ps"`` or ``"worker"``.
    task: the task index within ``job``.

  Returns:
    The started server; ``server.target`` is the session master.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  spec = tf.train.ClusterSpec(cluster)
  return tf.compat.v1.train.Server(spec, job_name=job, task_index=task,
                                   protocol="grpc", start=True)


def session_config(task: int):
  """A ``ConfigProto`` for worker ``task`` of a ps/worker cluster.

  Its device filters let the worker talk only to the parameter servers and to
  itself, so that a session can be created while another worker is down (TF
  otherwise waits for every task of the cluster). Its op thread pools have
  one thread each, so that several tasks share a small machine well.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return tf.compat.v1.ConfigProto(
      device_filters=["/job:ps", f"/job:worker/task:{task}"],
      inter_op_parallelism_threads=1, intra_op_parallelism_threads=1)


def wait_until_initialized(target: str, config=None, timeout: float = 120.0,
                           poll: float = 0.25) -> None:
  """Waits until the chief has initialized the default graph's variables.

  A non-chief ``MonitoredTrainingSession`` does this too, but re-checks only
  every 30 seconds; calling this first makes a worker start as soon as the
  chief is ready. Call it before the session (it adds one op).

  Args:
    target: the worker's ``server.target``.
    config: the session ``ConfigProto`` (see :func:`session_config`).
    timeout: seconds to wait at most.
    poll: seconds between checks.

  Raises:
    ClusterError: if variables are still uninitialized after ``timeout``.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  with tf.name_scope("graphgrad_wait"):
    # Local variables (SyncReplicasOptimizer's local step) are the worker's
    # own to initialize, after this.
    report = tf.compat.v1.report_uninitialized_variables(
        tf.compat.v1.global_variables())
  deadline = time.monotonic() + timeout
  with tf.compat.v1.Session(target, config=config) as sess:
    while True:
      missing = sess.run(report)
      if not len(missing):
        return
      if time.monotonic() > deadline:
        raise ClusterError(
            f"the chief did not initialize {len(missing)} variables (e.g. "
            f"{missing[0].decode()}) within {timeout} s. Start the chief "
            f"(worker 0), or check its output.")
      time.sleep(poll)


class LocalCluster:
  """A TF1 ps/worker cluster of local processes on ``127.0.0.1``.

  Parameter servers are started by :meth:`start`; each worker runs a program
  of yours, started by :meth:`launch` and given the cluster as
  ``LocalCluster.spec`` (for example on its command line).

  Args:
    num_ps: number of parameter-server tasks.
    num_workers: number of worker tasks.
    log_dir: where each task's output goes (``ps0.log``, ``worker1.log``...);
      a new temporary directory when ``None``.
    isolate: run every task in a private network namespace, so that no
      server is reachable from outside (see the module docstring).
    env: extra environment variables for every task.

  Raises:
    GraphGradError: if a count is not a positive integer.

  Example:
    >>> c = LocalCluster(num_ps=1, num_workers=2, isolate=False)
    >>> sorted(c.spec), len(c.spec["worker"])
    (['ps', 'worker'], 2)
    >>> c.spec["ps"][0].startswith("127.0.0.1:")
    True
    >>> c.stop()  # ends every task; removes its temporary log_dir
  """

  def __init__(self, num_ps: int = 1, num_workers: int = 2,
               log_dir: Optional[str] = None, isolate: bool = True,
               env: Optional[Dict[str, str]] = None):
    for arg, n in (("num_ps", num_ps), ("num_workers", num_workers)):
      if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise _errors.GraphGradError(
            f"`{arg}` must be a positive integer; got {n!r}. A cluster needs "
            f"at least one ps and one worker task.")
    ports = free_ports(num_ps + num_workers)
    self.spec: Dict[str, List[str]] = {
        "ps": [f"127.0.0.1:{p}" for p in ports[:num_ps]],
        "worker": [f"127.0.0.1:{p}" for p in ports[num_ps:]],
    }
    self._own_log_dir = log_dir is None
    self.log_dir = log_dir or tempfile.mkdtemp(prefix="graphgrad-cluster-")
    os.makedirs(self.log_dir, exist_ok=True)
    self.isolate = isolate
    self.env = dict(os.environ)
    self.env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # Tasks import the same graphgrad as this process.
    root = os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))
    self.env["PYTHONPATH"] = os.pathsep.join(
        [root] + [p for p in [self.env.get("PYTHONPATH")] if p])
    self.env.update(env or {})
    self.procs: Dict[Task, subprocess.Popen] = {}
    self._holder: Optional[subprocess.Popen] = None

  # -- lifecycle -----------------------------------------------------------

  def start(self) -> "LocalCluster":
    """Creates the network namespace (if isolated) and starts the ps tasks.

    Raises:
      ClusterError: if the namespace cannot be created.
    """
    if self.isolate and self._holder is None:
      self._make_namespace()
    for i in range(len(self.spec["ps"])):
      self.launch("ps", i, [sys.executable, "-m",
                            "graphgrad.distributed._cluster",
                            "--cluster", json.dumps(self.spec),
                            "--job", "ps", "--task", str(i)])
    return self

  def stop(self, timeout: float = 30.0) -> None:
    """Kills every task's process group and the namespace; waits for them."""
    procs = list(self.procs.values())
    if self._holder is not None:
      procs.append(self._holder)
    for p in procs:
      killpg(p, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    stuck = []
    for p in procs:
      try:
        p.wait(timeout=max(0.1, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        stuck.append(p.pid)
    self._holder = None
    if self._own_log_dir and not stuck:
      shutil.rmtree(self.log_dir, ignore_errors=True)
    if stuck:
      raise ClusterError(
          f"processes {stuck} did not exit within {timeout} s of SIGKILL.")

  def __enter__(self) -> "LocalCluster":
    try:
      return self.start()
    except BaseException:
      self.stop()
      raise

  def __exit__(self, *exc) -> None:
    self.stop()

  # -- tasks ---------------------------------------------------------------

  def launch(self, job: str, task: int, argv: Sequence[str]
             ) -> subprocess.Popen:
    """Starts (or restarts) ``job:task`` as ``argv`` in its own process group.

    Output goes to :meth:`log_path`; a restart appends to it.

    Raises:
      ClusterError: if the task is unknown or still running.
    """
    key = self._key(job, task)
    old = self.procs.get(key)
    if old is not None and old.poll() is None:
      raise ClusterError(
          f"{job}:{task} is still running (pid {old.pid}); kill it first "
          f"with kill({job!r}, {task}).")
    argv = list(argv)
    if self.isolate:
      if self._holder is None:
        raise ClusterError("the cluster is not started; call start() first.")
      argv = ["nsenter", f"--net=/proc/{self._holder.pid}/ns/net", "--"] + argv
    with open(self.log_path(job, task), "ab") as out:
      proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                              stderr=subprocess.STDOUT, env=self.env,
                              start_new_session=True,
                              preexec_fn=die_with_parent)
    self.procs[key] = proc
    log.info("started %s:%d (pid %d)", job, task, proc.pid)
    return proc

  def kill(self, job: str, task: int, sig: int = signal.SIGKILL,
           timeout: float = 30.0) -> Optional[int]:
    """Sends ``sig`` to the task's process group.

    For SIGKILL and SIGTERM, waits until the process is gone and returns its
    exit code; for other signals (SIGSTOP, SIGCONT) returns ``None``.
    """
    proc = self.procs[self._key(job, task)]
    killpg(proc, sig)
    if sig in (signal.SIGKILL, signal.SIGTERM):
      return self.wait(job, task, timeout)
    return None

  def wait(self, job: str, task: int, timeout: float) -> int:
    """Waits for the task to exit; returns its exit code.

    Raises:
      ClusterError: if it is still running after ``timeout`` seconds; the
        message holds the end of its output.
    """
    proc = self.procs[self._key(job, task)]
    try:
      return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      raise ClusterError(
          f"{job}:{task} (pid {proc.pid}) still runs after {timeout} s. Last "
          f"output:\n{self.tail(job, task)}") from None

  def running(self, job: str, task: int) -> bool:
    proc = self.procs.get(self._key(job, task))
    return proc is not None and proc.poll() is None

  def log_path(self, job: str, task: int) -> str:
    return os.path.join(self.log_dir, f"{job}{task}.log")

  def output(self, job: str, task: int) -> str:
    """Everything ``job:task`` has written so far, across restarts."""
    try:
      with open(self.log_path(job, task), encoding="utf-8",
                errors="replace") as f:
        return f.read()
    except FileNotFoundError:
      return ""

  def tail(self, job: str, task: int, lines: int = 30) -> str:
    return "\n".join(self.output(job, task).splitlines()[-lines:])

  # -- helpers -------------------------------------------------------------

  def _key(self, job: str, task: int) -> Task:
    if job not in self.spec or not 0 <= task < len(self.spec[job]):
      raise ClusterError(
          f"no task {job}:{task} in this cluster; it has "
          f"{len(self.spec['ps'])} ps and {len(self.spec['worker'])} worker "
          f"tasks.")
    return (job, task)

  def _make_namespace(self) -> None:
    missing = [t for t in ("unshare", "nsenter") if not shutil.which(t)]
    if missing:
      raise ClusterError(
          f"isolate=True needs util-linux's {' and '.join(missing)}, which "
          f"is not on PATH. Install util-linux, or pass isolate=False to let "
          f"TensorFlow's servers listen on every interface.")
    holder = subprocess.Popen(
        _UNSHARE, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, start_new_session=True,
        preexec_fn=die_with_parent)
    self._holder = holder
    mine = os.readlink("/proc/self/ns/net")
    deadline = time.monotonic() + 10
    while not _in_other_namespace(holder.pid, mine):
      if holder.poll() is not None or time.monotonic() > deadline:
        killpg(holder, signal.SIGKILL)
        holder.wait(timeout=10)
        raw = holder.stderr.read() if holder.stderr else b""
        err = raw.decode(errors="replace").strip()
        self._holder = None
        raise ClusterError(
            f"could not create a private network namespace "
            f"({err or 'no namespace after 10 s'}). isolate=True needs root "
            f"or CAP_SYS_ADMIN; run as root, or pass isolate=False to let "
            f"TensorFlow's servers listen on every interface.")
      time.sleep(0.01)
    # A new namespace's loopback device is down; bring it up from inside.
    subprocess.run(["nsenter", f"--net=/proc/{holder.pid}/ns/net", "--",
                    sys.executable, "-c", _LOOPBACK_UP], check=True,
                   timeout=30, stdin=subprocess.DEVNULL, capture_output=True)


_UNSHARE = ["unshare", "--net", "--", "sleep", "infinity"]


def _in_other_namespace(pid: int, mine: str) -> bool:
  try:
    return os.readlink(f"/proc/{pid}/ns/net") != mine
  except OSError:
    return False


_LOOPBACK_UP = """
import fcntl, socket, struct
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
req = struct.pack("16sH22x", b"lo", 0)
flags = struct.unpack("16sH22x", fcntl.ioctl(s, 0x8913, req))[1]  # SIOCGIFFLAGS
fcntl.ioctl(s, 0x8914, struct.pack("16sH22x", b"lo", flags | 1))  # IFF_UP
"""


def _main(argv: Optional[Sequence[str]] = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--cluster", required=True, help="JSON cluster spec")
  parser.add_argument("--job", default="ps")
  parser.add_argument("--task", type=int, default=0)
  args = parser.parse_args(argv)
  server = start_server(json.loads(args.cluster), args.job, args.task)
  server.join()


if __name__ == "__main__":
  _main()
