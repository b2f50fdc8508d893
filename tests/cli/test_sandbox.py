"""The sandbox: a crafted graph touches nothing, and every ending is one line.

Each crafted graph (tests/cli/adversarial.py) runs through the command line
in a process of its own under ``strace -f``; the trace of the sandboxed
child and everything it starts must hold no successful write, create,
rename, delete, link, truncate, connect, bind or exec, and no successful
open of the secret. Each runs with graphgrad's own checks (refused early,
one line) and with ``--no-checks``, where the sandbox alone contains it.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from graphgrad.cli import _confine, _sandbox
from graphgrad.cli import _main as _cli
from helpers import dense, error_line
from tests.cli import adversarial

tf1 = tf.compat.v1
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))

needs_sandbox = pytest.mark.skipif(
    _confine.missing() is not None,
    reason=f"this kernel cannot confine: {_confine.missing()}")
needs_strace = pytest.mark.skipif(shutil.which("strace") is None,
                                  reason="strace is not installed")

_TRACED = ("openat,open,creat,rename,renameat,renameat2,unlink,unlinkat,"
           "mkdir,mkdirat,link,linkat,symlink,symlinkat,truncate,ftruncate,"
           "mknod,mknodat,chmod,fchmodat,chown,fchownat,connect,bind,"
           "execve,execveat,clone,clone3,fork,vfork")
_WRITE_FLAGS = re.compile(r"O_WRONLY|O_RDWR|O_CREAT|O_TRUNC|O_APPEND")
_LINE = re.compile(r"^(\d+)\s+(\w+)\((.*)\)\s+=\s+(-?\d+|\?)")


def _joined(trace: str):
  """The trace's lines, each call whole: strace splits a call that another
  task interrupts into ``<unfinished ...>`` and ``<... NAME resumed>``."""
  pending, out = {}, []
  for line in trace.splitlines():
    pid = line.split(" ", 1)[0]
    if line.endswith("<unfinished ...>"):
      pending[pid] = line[:-len("<unfinished ...>")].rstrip()
    elif " resumed>" in line and pid in pending:
      out.append(pending.pop(pid) + line.split(" resumed>", 1)[1])
    else:
      out.append(line)
  return out


def _child_pids(lines):
  """The sandboxed child's pid and every task it started."""
  pids = set()
  for line in lines:
    m = _LINE.match(line)
    if m and m.group(2) == "execve" and '"-I", "-B", "-c"' in line:
      pids.add(m.group(1))
  for line in lines:  # clone lines come in order: parents before children
    m = _LINE.match(line)
    if m and m.group(1) in pids and m.group(2) in (
        "clone", "clone3", "fork", "vfork") and m.group(4).isdigit():
      pids.add(m.group(4))
  return pids


def violations(trace: str, secret: str = "") -> list:
  """The successful calls of the sandboxed child that touch the world."""
  lines = _joined(trace)
  pids = _child_pids(lines)
  assert pids, "the trace has no sandboxed child"
  found, started = [], set()
  for line in lines:
    m = _LINE.match(line)
    if not m or m.group(1) not in pids or m.group(4) in ("?",) or \
        int(m.group(4)) < 0:
      continue
    pid, call, arguments = m.group(1), m.group(2), m.group(3)
    if call in ("execve", "execveat"):
      if pid in started or '"-I", "-B", "-c"' not in line:
        found.append(line)
      started.add(pid)
    elif call in ("open", "openat", "creat"):
      if call == "creat" or _WRITE_FLAGS.search(arguments) or (
          secret and secret in arguments):
        found.append(line)
    elif call not in ("clone", "clone3", "fork", "vfork"):
      found.append(line)
  return found


def run_traced(argv, folder):
  """``graphgrad ARGV`` in a process under strace: (exit code, stdout,
  stderr, the trace)."""
  log = os.path.join(str(folder), "trace.txt")
  env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3",
             PYTHONDONTWRITEBYTECODE="1")
  done = subprocess.run(
      ["strace", "-f", "-qq", "-e", f"trace={_TRACED}", "-o", log,
       sys.executable, "-m", "graphgrad", *argv],
      capture_output=True, text=True, env=env, timeout=400, check=False)
  with open(log, encoding="utf-8", errors="replace") as f:
    trace = f.read()
  return done.returncode, done.stdout, done.stderr, trace


def _one_line(stderr: str) -> str:
  lines = stderr.strip().splitlines()
  assert len(lines) == 1 and "Traceback" not in stderr, stderr
  return lines[0]


# -- the kernel's confinement, in a process of its own -----------------------

_PROBE = """
import importlib.util, json, os, socket, sys
spec = importlib.util.spec_from_file_location("c", sys.argv[1])
c = importlib.util.module_from_spec(spec); spec.loader.exec_module(c)
allowed, secret, folder = sys.argv[2], sys.argv[3], sys.argv[4]
paths = [sys.prefix, sys.base_prefix, allowed] + [
    p for p in sys.path if p and os.path.isabs(p) and os.path.exists(p)]
paths += ["/lib", "/lib64", "/usr/lib", "/etc/ld.so.cache", "/proc/self"]
os.chdir(folder)
c.confine([p for p in paths if os.path.exists(p)], c.Limits(1 << 30, 60))
out = {}
def attempt(name, fn):
  try:
    fn(); out[name] = "done"
  except MemoryError:
    out[name] = "MemoryError"
  except OSError as e:
    out[name] = type(e).__name__
attempt("write", lambda: open(os.path.join(folder, "new.txt"), "w"))
attempt("remove", lambda: os.unlink(allowed))
attempt("rename", lambda: os.rename(allowed, allowed + ".moved"))
attempt("chmod", lambda: os.chmod(allowed, 0o777))
attempt("read_allowed", lambda: open(allowed).read())
attempt("read_secret", lambda: open(secret).read())
# /proc/self is readable, but its links lead to paths that are not.
attempt("through_root", lambda: open("/proc/self/root" + secret).read())
attempt("through_cwd", lambda: open("/proc/self/cwd/secret.txt").read())
attempt("tcp", lambda: socket.create_connection(("127.0.0.1", 9), 1))
attempt("unix", lambda: socket.socket(socket.AF_UNIX))
attempt("exec", lambda: os.execv("/bin/true", ["true"]))
attempt("allocate", lambda: bytearray(2 << 30))
os.write(1, json.dumps(out).encode())
"""


@needs_sandbox
def test_the_kernel_refuses_each_kind_of_touch(tmp_path):
  allowed, secret = tmp_path / "model.meta", tmp_path / "secret.txt"
  allowed.write_text("model")
  secret.write_text("secret")
  done = subprocess.run(
      [sys.executable, "-I", "-c", _PROBE,
       os.path.join(ROOT, "graphgrad", "cli", "_confine.py"), str(allowed),
       str(secret), str(tmp_path)],
      capture_output=True, text=True, timeout=60, check=True)
  assert json.loads(done.stdout) == {
      "write": "PermissionError", "remove": "PermissionError",
      "rename": "PermissionError", "chmod": "PermissionError",
      "read_allowed": "done", "read_secret": "PermissionError",
      "through_root": "PermissionError", "through_cwd": "PermissionError",
      "tcp": "PermissionError", "unix": "PermissionError",
      "exec": "PermissionError", "allocate": "MemoryError"}
  assert sorted(os.listdir(tmp_path)) == ["model.meta", "secret.txt"]
  assert allowed.read_text() == "model"


def test_the_self_test_fails_where_nothing_confines(tmp_path):
  """Unconfined, the self-test's write succeeds, and it says so."""
  with pytest.raises(_confine.SandboxBroken,
                     match=r"the sandbox's self-test failed: creating a file "
                           r"in .* succeeded"):
    _confine.self_test([str(tmp_path)], "/etc/passwd")
  assert os.listdir(tmp_path) == []


def test_confine_refuses_a_process_with_threads():
  """Landlock and seccomp bind the calling thread: a process that already
  runs TensorFlow's threads is refused, not half confined."""
  assert _confine.threads() > 1
  with pytest.raises(_confine.SandboxUnavailable, match=r"already runs \d+ "
                                                        r"threads"):
    _confine.confine([], _confine.Limits(1 << 30, 60))


def test_a_kernel_without_the_mechanisms_is_refused_naming_no_sandbox(
    tmp_path, capsys, monkeypatch):
  meta = adversarial.write_file(tmp_path, tmp_path / "written")
  monkeypatch.setattr(_confine, "missing",
                      lambda: "the kernel's Landlock ABI is absent")
  line = error_line(capsys, ["grads", meta])
  assert line == (
      "graphgrad grads: error: cannot open an untrusted model safely: the "
      "kernel's Landlock ABI is absent. Pass --no-sandbox to open it in "
      "this process, only if you trust it"), line


def test_no_checks_needs_the_sandbox(tmp_path, capsys):
  line = error_line(capsys, ["grads", str(tmp_path / "m.meta"),
                             "--no-checks", "--no-sandbox"])
  assert line.startswith("graphgrad grads: error: --no-checks and "
                         "--no-sandbox: pass at most one"), line


@pytest.mark.parametrize("text, size", [("512M", 512 << 20),
                                        ("1.5G", 3 << 29),
                                        ("8GiB", 8 << 30)])
def test_memory_sizes(text, size):
  from graphgrad.cli import _args  # pylint: disable=g-import-not-at-top
  assert _args.memory_size(text) == size


def test_a_memory_size_below_64m_is_refused(tmp_path, capsys):
  line = error_line(capsys, ["grads", str(tmp_path / "m.meta"),
                             "--memory", "10M"])
  assert line.endswith("argument --memory: expected a memory size of at "
                       "least 64M, such as 4G or 512M; got '10M'"), line


# -- benign graphs: the same numbers through the sandbox ---------------------


@needs_sandbox
def test_a_benign_graph_gives_tf_gradients_numbers_through_the_sandbox(
    tmp_path):
  """A trained checkpoint restored in the child; the figures equal
  tf.gradients' in this process."""
  rng = np.random.default_rng(0)
  feed = rng.normal(size=(6, 3)).astype(np.float32)
  np.savez(tmp_path / "feed.npz", x=feed)
  with tf.Graph().as_default():
    x = tf1.placeholder(tf.float32, [None, 3], name="x")
    h = dense(x, 4, "l1", tf.tanh)
    loss = tf.reduce_mean(tf.square(dense(h, 2, "l2")), name="loss")
    tf1.add_to_collection(tf1.GraphKeys.LOSSES, loss)
    variables = tf1.trainable_variables()
    grads = tf.gradients(loss, variables)
    saver = tf1.train.Saver()
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      sess.run([v.assign(rng.normal(size=v.shape).astype(np.float32))
                for v in variables])
      values = sess.run(grads, {x: feed})
      prefix = saver.save(sess, str(tmp_path / "model.ckpt"))
  want = {s: np.sqrt(sum(np.sum(np.square(g)) for v, g in
                         zip(variables, values) if v.op.name.startswith(s)))
          for s in ("l1", "l2")}
  out = tmp_path / "g.json"
  assert _cli.main(["grads", prefix + ".meta", "--checkpoint", prefix,
                    "--feed", str(tmp_path / "feed.npz"), "--json",
                    str(out)]) == 0
  rows = {r["name"]: r for r in json.loads(out.read_text())["layers"]}
  for scope, norm in want.items():
    np.testing.assert_allclose(rows[scope]["grad_norm"]["before"], norm,
                               rtol=1e-5)


# -- crafted graphs ----------------------------------------------------------


def _target(tmp_path, name):
  """The file an attack writes (absent) or reads (a secret, present)."""
  if name in ("read_file", "whole_file_reader", "vocab_file"):
    secret = tmp_path / "secret" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("the secret\n")
    return secret
  (tmp_path / "out").mkdir()
  # A name a listing would give away.
  (tmp_path / "out" / "the secret name").write_text("")
  return tmp_path / "out" / "written.txt"


def _untouched(target, before):
  if target.name == "secret.txt":
    assert target.read_text() == "the secret\n"
  else:
    assert not target.exists()
  assert sorted(os.listdir(target.parent)) == before


@needs_sandbox
@needs_strace
@pytest.mark.parametrize("name, checks", [
    *[(name, False) for name in sorted(adversarial.TOUCHING)],
    # Refused by the allowlist in the child, before anything runs (every
    # I/O op by every route: tests/cli/test_io_routes.py, in-process).
    ("write_file", True), ("vocab_file", True),
    ("write_in_nested_function", True)],
    ids=lambda v: {True: "checks", False: "sandbox_alone"}.get(v, v))
def test_a_graph_that_touches_files_is_contained(tmp_path, name, checks):
  target = _target(tmp_path, name)
  before = sorted(os.listdir(target.parent))
  # With --allow-io the sandbox lets the graph read its own directory: the
  # secret and the target lie beside it, not in it.
  (tmp_path / "model").mkdir()
  meta = adversarial.TOUCHING[name](tmp_path / "model", target)
  argv = ["grads", meta] + ([] if checks else ["--no-checks", "--allow-io"])
  code, stdout, stderr, trace = run_traced(argv, tmp_path)
  _untouched(target, before)
  assert violations(trace, str(target)) == []
  assert "the secret" not in stdout + stderr
  if checks:
    assert code == 2 and "saved graph op" in _one_line(stderr), stderr
  elif code != 0:  # the sandbox refused it, or the graph ran and got nothing
    assert code == 2 and _one_line(stderr), stderr


@needs_sandbox
@needs_strace
@pytest.mark.parametrize("name, flags, says", [
    ("recursive_function", [],
     r"the sandboxed process crashed \(SIGSEGV"),
    ("huge_tensor_array", ["--memory", "1G"],
     r"(aborted \(SIGABRT|ran out of memory)"),
    ("endless_allocation", ["--memory", "1G"],
     r"(ran out of memory|aborted \(SIGABRT|killed \(SIGKILL)"),
    # Long enough for TensorFlow to start under strace on a busy machine.
    ("endless_loop", ["--timeout", "25"],
     r"--timeout 25: the model ran for 25 s without finishing \(while "
     r"running the graph\)"),
])
def test_a_graph_that_crashes_or_exhausts_the_child_is_one_line(
    tmp_path, name, flags, says):
  meta = adversarial.EXHAUSTING[name](tmp_path)
  code, _, stderr, trace = run_traced(
      ["grads", meta, "--no-checks", *flags], tmp_path)
  assert code == 2, stderr
  assert re.search(says, _one_line(stderr)), stderr
  assert violations(trace) == []
  leftovers = subprocess.run(["pgrep", "-f", meta], capture_output=True,
                             text=True, check=False).stdout.split()
  assert leftovers == []


@needs_sandbox
@needs_strace
@pytest.mark.parametrize("name", ["write_by_signature_default",
                                  "write_on_restore"])
def test_a_write_by_a_hidden_route_is_contained(tmp_path, name):
  """Routes to an I/O op that graphgrad's checks once missed; the kernel
  does not care which route an op came by, so the sandbox alone holds."""
  (tmp_path / "model").mkdir()
  (tmp_path / "out").mkdir()
  target = tmp_path / "out" / "written.txt"
  built = getattr(adversarial, name)(tmp_path / "model", target)
  meta, more = (built[0], ["--checkpoint", built[1]]) if isinstance(
      built, tuple) else (built, [])
  for flags in ([], ["--no-checks", "--allow-io"]):
    code, _, stderr, trace = run_traced(["grads", meta, *more, *flags],
                                        tmp_path)
    assert not target.exists()
    assert code == 2 and _one_line(stderr), stderr
    assert violations(trace, str(target)) == []


@needs_sandbox
@needs_strace
@pytest.mark.parametrize("name, argv", [
    ("huge_placeholder", ["grads"]),
    ("gradient_override_of_int", ["grads"]),
    ("chain_of_functions", ["inspect"]),
    ("recursive_function", ["inspect"]),
    ("corrupt_saved_model", ["inspect"]),
    ("gradient_override_not_utf8", ["grads"]),
    ("gradient_borrowed_from_conv2d", ["grads"]),
    ("frozen_const_bomb", ["inspect", "--output", "y"]),
])
def test_a_crafted_file_is_one_line_with_the_sandbox_alone(tmp_path, name,
                                                           argv):
  path = getattr(adversarial, name)(tmp_path)
  code, _, stderr, trace = run_traced(
      [argv[0], path, *argv[1:], "--no-checks", "--memory", "2G"], tmp_path)
  assert code in (0, 2), stderr
  if code == 2:
    _one_line(stderr)
  assert violations(trace) == []


@needs_sandbox
def test_allow_io_reads_the_models_directory_and_nothing_else(tmp_path):
  """A vocabulary beside the model is read with --allow-io; the same
  vocabulary one directory up is refused by the kernel."""
  (tmp_path / "model").mkdir()
  inside = tmp_path / "model" / "vocab.txt"
  outside = tmp_path / "vocab.txt"
  for path in (inside, outside):
    path.write_text("a,1\nb,3\n")
  meta = adversarial.vocab_file(tmp_path / "model", inside)
  assert _cli.main(["grads", meta, "--allow-io"]) == 0
  meta = adversarial.vocab_file(tmp_path / "model", outside)
  code, _, stderr, trace = run_traced(["grads", meta, "--allow-io"],
                                      tmp_path)
  assert code == 2
  assert _one_line(stderr).startswith(
      "graphgrad grads: error: the sandbox refused what the graph tried "
      "while running the graph (op 'FixedUnigramCandidateSampler': "), stderr
  assert violations(trace, str(outside)) == []


def test_orders_read_only_the_model_and_the_installation(tmp_path):
  meta = adversarial.write_file(tmp_path, tmp_path / "written")
  args = _cli.build_parser().parse_args(["grads", meta])
  args.memory_text = "8G"
  orders = _sandbox.orders(args.command_spec, args, ["grads", meta])
  home = os.path.expanduser("~")
  assert meta in orders["read"]
  assert str(tmp_path) not in orders["read"]
  assert home not in orders["read"] and "/etc" not in orders["read"]
  assert "/tmp" not in orders["read"]
  assert orders["unreadable"] not in orders["read"]


def _with_orders(monkeypatch, **changes):
  """The parent sends the child its orders with ``changes``."""
  real = _sandbox.orders
  monkeypatch.setattr(_sandbox, "orders",
                      lambda *a: dict(real(*a), **changes))


@needs_sandbox
def test_a_self_test_that_fails_in_the_child_refuses_the_model(
    tmp_path, capsys, monkeypatch):
  """The child is told that a file it may read is unreadable: its
  self-test finds the read allowed, and the model is never opened."""
  meta = adversarial.write_file(tmp_path, tmp_path / "written")
  _with_orders(monkeypatch, unreadable=meta)
  line = error_line(capsys, ["grads", meta])
  assert line == (
      f"graphgrad grads: error: the sandbox could not be set up: the "
      f"sandbox's self-test failed: reading {meta!r} succeeded. The kernel "
      f"does not confine as graphgrad relies on. Pass --no-sandbox to open "
      f"the model in this process, only if you trust it"), line


def test_a_child_that_ends_before_it_is_confined_is_one_line(
    tmp_path, capsys, monkeypatch):
  meta = adversarial.write_file(tmp_path, tmp_path / "written")
  _with_orders(monkeypatch, confine=str(tmp_path / "missing.py"))
  line = error_line(capsys, ["grads", meta])
  assert line.startswith(
      "graphgrad grads: error: the sandboxed process ended with exit status "
      "1 before it was confined: FileNotFoundError: "), line
  assert line.endswith("Pass --no-sandbox to open the model in this "
                       "process, only if you trust it"), line


def test_a_child_that_cannot_start_is_one_line(tmp_path, capsys,
                                               monkeypatch):
  meta = adversarial.write_file(tmp_path, tmp_path / "written")

  def cannot(*args, **kwargs):
    raise OSError(8, "Exec format error")
  monkeypatch.setattr(_sandbox.subprocess, "Popen", cannot)
  monkeypatch.setattr(_confine, "missing", lambda: None)
  line = error_line(capsys, ["grads", meta])
  assert line == (
      "graphgrad grads: error: cannot start the sandboxed process ([Errno "
      "8] Exec format error); pass --no-sandbox to open the model in this "
      "process, only if you trust it"), line


@needs_sandbox
def test_the_cpu_time_limit_ends_the_child_in_one_line(tmp_path, capsys,
                                                       monkeypatch):
  """A CPU-time limit of 1 s: the child's own start of TensorFlow uses it
  up, and the kernel's SIGXCPU is named."""
  meta = adversarial.endless_loop(tmp_path)
  _with_orders(monkeypatch, cpu_seconds=1)
  line = error_line(capsys, ["grads", meta])
  assert line.startswith(
      "graphgrad grads: error: the sandboxed process used up its CPU-time "
      "limit (SIGXCPU) while "), line
  assert line.endswith("; nothing outside it was touched"), line


def _signature_output(saved_model):
  """What ``--output`` names for the ``serving_default`` signature of a
  SavedModel: its output's key (TF2), or its tensor (TF1)."""
  from tensorflow.core.protobuf import saved_model_pb2  # pylint: disable=g-import-not-at-top
  model = saved_model_pb2.SavedModel()
  with open(os.path.join(saved_model, "saved_model.pb"), "rb") as f:
    model.ParseFromString(f.read())
  meta_graph = model.meta_graphs[0]
  ((key, out),) = meta_graph.signature_def["serving_default"].outputs.items()
  return key if meta_graph.object_graph_def.nodes else out.name


@needs_sandbox
@needs_strace
@pytest.mark.parametrize("name, command", [
    ("print_in_cond_branch_pbtxt", "grads"),
    ("print_in_cond_branch_pbtxt", "scan"),
    ("save_in_while_body", "grads"),
    ("print_in_v1_restore", "grads"),
])
def test_a_saved_model_that_touches_files_is_contained(tmp_path, name,
                                                       command):
  """SavedModels whose I/O hides in a function, a restore or an init op
  (tests/cli/test_scan.py finds each), and a saved_model.pbtxt: the
  sandbox alone contains grads, and scan reads without running."""
  (tmp_path / "model").mkdir()
  target = _target(tmp_path, name)
  before = sorted(os.listdir(target.parent))
  built = name.removesuffix("_pbtxt")
  path = getattr(adversarial, built)(tmp_path / "model", target)
  argv = [command, path]
  if command == "grads":
    argv += ["--output", _signature_output(path), "--no-checks",
             "--allow-io"]
  if name.endswith("_pbtxt"):
    argv[1] = adversarial.as_pbtxt(path)
  code, _, stderr, trace = run_traced(argv, tmp_path)
  _untouched(target, before)
  assert violations(trace, str(target)) == []
  if command == "scan":
    assert code == 1, stderr
  elif code != 0:
    assert code == 2 and _one_line(stderr), stderr
