"""Runs a command that opens an untrusted model in a confined child process.

A saved graph is a program, so ``inspect`` and ``grads`` parse, import and
run it in a child that the kernel confines before the model's first byte is
read (:mod:`graphgrad.cli._confine`). The parent only checks arguments,
reads the child's JSON messages (never pickle: the child is not trusted once
it has read the model), writes the output files and prints; it imports no
TensorFlow. Every ending of the child (an error it reports, a crash, a
limit, ``--timeout``) is one line and exit code 2, and the parent lives on.
A :class:`ModelCommand` splits a command into the parent's ``check`` and
``reads``, the child's ``compute`` and the parent's ``finish``;
``--no-sandbox`` runs ``compute`` in the parent. The threat model is in
docs/security.md.
"""

import dataclasses
import json
import math
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, Optional

from graphgrad.cli import _args, _confine
from graphgrad.cli._args import CommandError

_HERE = os.path.dirname(os.path.abspath(__file__))
# The directory graphgrad is imported from: site-packages, or a checkout.
_ROOT = os.path.dirname(os.path.dirname(_HERE))

# The child's first lines: it imports nothing of graphgrad until it has
# confined itself (TensorFlow, which the command's work imports, starts
# threads).
BOOT = """\
import importlib.util, json, sys
orders = json.loads(sys.stdin.read())
channel = open(orders["channel_fd"], "w", encoding="utf-8")
spec = importlib.util.spec_from_file_location("_graphgrad_confine",
                                              orders["confine"])
confine = importlib.util.module_from_spec(spec)
spec.loader.exec_module(confine)
try:
  confine.enter(orders, channel)
except confine.SandboxError:
  sys.exit(0)
sys.path.insert(0, orders["root"])
from graphgrad.cli import _child, _main
_child.run(orders, channel, _main.build_parser)
"""

# Read by the parent from the child at most: the text and the data of a
# report, never the model.
_MAX_MESSAGES = 64 << 20
_MAX_LOG = 1 << 20

_SIGNALS: Dict[int, str] = {
    signal.SIGSEGV: "crashed (SIGSEGV, a bad memory access inside "
                    "TensorFlow)",
    signal.SIGBUS: "crashed (SIGBUS, a bad memory access inside TensorFlow)",
    signal.SIGILL: "crashed (SIGILL)",
    signal.SIGFPE: "crashed (SIGFPE, an arithmetic fault inside TensorFlow)",
    signal.SIGABRT: "aborted (SIGABRT: a check inside TensorFlow failed, or "
                    "memory ran out)",
    signal.SIGXCPU: "used up its CPU-time limit (SIGXCPU)",
    signal.SIGXFSZ: "tried to write a file (SIGXFSZ)",
    signal.SIGSYS: "made a system call the sandbox forbids (SIGSYS)",
}


@dataclasses.dataclass(frozen=True)
class ModelCommand:
  """A command that opens a model, in the parts the sandbox separates.

  Attributes:
    check: ``check(args)``, in the parent before anything runs: argument
      checks that need no TensorFlow.
    reads: ``reads(args)``, in the parent: the files and directories the
      child may read, the model first (then a checkpoint, a feed file).
    compute: ``compute(args) -> dict``, in the child: the work; what it
      prints is captured, what it returns must be JSON.
    finish: ``finish(args, outcome) -> int``, in the parent: shows
      ``outcome["text"]`` and writes the output files; returns the exit
      code.
  """
  check: Callable[[Any], None]
  reads: Callable[[Any], List[str]]
  compute: Callable[[Any], Dict[str, Any]]
  finish: Callable[[Any, Dict[str, Any]], int]


def default_memory() -> int:
  """``--memory``'s default: 8 GiB, or half the machine's memory if less."""
  try:
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  except (ValueError, OSError, AttributeError):
    physical = 16 << 30
  return int(min(8 << 30, physical // 2))


def add_flags(parser, runs_graph: bool) -> None:
  """The sandbox's flags, on a command that opens a model.

  Args:
    parser: the command's parser.
    runs_graph: whether the command runs the graph (``grads``) or only
      reads it (``inspect``).
  """
  memory = default_memory()
  parser.add_argument(
      "--memory", metavar="SIZE", type=_args.memory_size, default=memory,
      help=f"the most memory the sandboxed process may use, e.g. 4G or "
           f"512M (default {format_size(memory)}: 8G, or half the "
           f"machine's memory if less)")
  parser.add_argument(
      "--timeout", metavar="SECONDS", default=300.0,
      type=_args.positive_float,
      help="stop after this many seconds of wall-clock time, with exit "
           "code 2 (default 300): a saved graph can loop forever")
  parser.add_argument(
      "--no-sandbox", action="store_true",
      help="open the model in this process instead of a kernel-confined "
           "child process (Linux's Landlock and seccomp): only for a model "
           "you trust, or where the kernel lacks them")
  what = ("the op allowlist and the checks of sizes and recursion made "
          "before import" if runs_graph else
          "the checks of sizes and recursion made before import")
  parser.add_argument(
      "--no-checks", action="store_true",
      help=f"skip {what}: the sandbox alone confines the model (not "
           f"allowed with --no-sandbox)")


def format_size(size: int) -> str:
  """``8G``, ``512M`` or a byte count, as ``--memory`` takes it.

  Example:
    >>> format_size(8 << 30), format_size(3 << 29), format_size(1000)
    ('8G', '1536M', '1000')
  """
  for unit, scale in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20),
                      ("K", 1 << 10)):
    if size % scale == 0:
      return f"{size // scale}{unit}"
  return str(size)


def run(command: ModelCommand, args, argv: List[str]) -> int:
  """Runs ``command`` for the parsed ``args`` (from ``argv``).

  Returns:
    The exit code of ``command.finish``.

  Raises:
    CommandError: one line, for any ending of the child but a result.
  """
  if args.no_sandbox and args.no_checks:
    raise CommandError(
        "--no-checks and --no-sandbox: pass at most one; without the "
        "sandbox graphgrad's own checks are all that stands between the "
        "model and this process")
  args.memory_text = format_size(args.memory)
  command.check(args)
  _args.check_model(command.reads(args)[0], getattr(args, "signature", None))
  if args.no_sandbox:
    _args.quiet_tensorflow(getattr(args, "verbose", False))
    return _in_process(command, args)
  # This process imports no TensorFlow: the child does, once confined.
  _args.check_tensorflow()
  why = _confine.missing()
  if why:
    raise CommandError(
        f"cannot open an untrusted model safely: {why}. Pass --no-sandbox "
        f"to open it in this process, only if you trust it")
  outcome = _in_child(command, args, argv)
  return command.finish(args, outcome)


def _in_process(command: ModelCommand, args) -> int:
  from graphgrad.cli import _child  # pylint: disable=g-import-not-at-top
  timer = _stop_after(args.timeout, f"graphgrad {args.command}")
  try:
    outcome = _child.compute_here(args)
  finally:
    timer.cancel()
  return command.finish(args, outcome)


def _stop_after(seconds: float, prog: str) -> threading.Timer:
  """Ends this process with exit code 2 once ``seconds`` have passed.

  Only with ``--no-sandbox``: a ``Session.run`` of an endless ``while``
  loop ignores ``RunOptions(timeout_in_ms=...)``,
  ``operation_timeout_in_ms`` and a ``Session.close`` from another thread,
  so nothing short of ending the process stops it. The sandbox ends the
  child instead.
  """
  def expire():
    print(f"{prog}: error: --timeout {seconds:g}: the model ran for "
          f"{seconds:g} s without finishing, so {prog} stopped it (and this "
          f"process, since --no-sandbox runs it here); pass a larger "
          f"--timeout if it needs more time", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(2)  # pylint: disable=protected-access
  timer = threading.Timer(seconds, expire)
  timer.daemon = True
  timer.start()
  return timer


def read_paths(model_reads: List[str]) -> List[str]:
  """Everything the child may read: ``model_reads`` and the installation.

  The installation is Python's prefixes, every directory on ``sys.path``
  (site-packages, and a checkout graphgrad runs from), the system's shared
  libraries, and the kernel's read-only facts TensorFlow asks for at start
  (the CPU count, this process's own ``/proc`` entries). Not the user's
  home, ``/etc``, ``/tmp`` or the working directory.
  """
  paths = [sys.prefix, sys.base_prefix, sys.exec_prefix,
           sys.base_exec_prefix, _ROOT]
  # Not the working directory, which ``python -m`` puts on sys.path.
  cwd = os.getcwd()
  paths += [p for p in sys.path if p and os.path.isabs(p)
            and os.path.abspath(p) != cwd]
  paths += ["/lib", "/lib32", "/lib64", "/usr/lib", "/usr/lib64",
            "/usr/local/lib", "/etc/ld.so.cache", "/proc/self",
            "/proc/stat", "/proc/cpuinfo", "/proc/meminfo",
            "/sys/devices/system/cpu", "/sys/fs/cgroup", "/dev/urandom"]
  paths += model_reads
  seen, out = set(), []
  for p in paths:
    p = os.path.abspath(p)
    if p not in seen and os.path.exists(p):
      seen.add(p)
      out.append(p)
  return out


def _unreadable(paths: List[str]) -> str:
  """A file that exists and that the child may not read, for its
  self-test."""
  for candidate in ("/etc/passwd", "/etc/hostname", "/etc/os-release"):
    inside = any(candidate == p or candidate.startswith(p.rstrip("/") + "/")
                 for p in paths)
    if os.path.isfile(candidate) and not inside:
      return candidate
  raise CommandError("cannot find a file outside the model for the "
                     "sandbox's self-test; pass --no-sandbox only if you "
                     "trust the model")


def orders(command: ModelCommand, args, argv: List[str]) -> Dict[str, Any]:
  """What the parent sends the child on its standard input."""
  reads = [os.path.abspath(p) for p in command.reads(args)]
  paths = read_paths(reads)
  model = os.path.abspath(reads[0]) if reads else os.getcwd()
  return {
      "argv": list(argv),
      "read": paths,
      # Finding the temporary directory writes a file: the parent does it.
      "probe_dirs": [model if os.path.isdir(model)
                     else os.path.dirname(model), tempfile.gettempdir()],
      "unreadable": _unreadable(paths),
      "memory_bytes": args.memory,
      "memory_text": args.memory_text,
      "cpu_seconds": cpu_seconds(args.timeout),
      "confine": os.path.join(_HERE, "_confine.py"),
      "root": _ROOT,
  }


def cpu_seconds(timeout: float) -> int:
  """The child's CPU-time limit: every core busy for the whole
  ``--timeout``, and a little more (the wall clock ends it first)."""
  return int(math.ceil(timeout * (os.cpu_count() or 1))) + 10


def _environment(verbose: bool) -> Dict[str, str]:
  env = dict(os.environ)
  for key in ("PYTHONPATH", "PYTHONSTARTUP", "PYTHONHOME"):
    env.pop(key, None)
  if not verbose:
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  # Keras reads ~/.keras/keras.json at import when it exists; the child may
  # not read the home directory, so it gets a home that does not exist.
  env["KERAS_HOME"] = os.path.join(tempfile.gettempdir(),
                                   f"graphgrad-sandbox-{os.getpid()}-keras")
  env["MPLBACKEND"] = "Agg"
  return env


class _Child:
  """The running child: its process, its two pipes and what they said."""

  def __init__(self, argv_orders: Dict[str, Any], verbose: bool):
    channel_r, channel_w = os.pipe()
    argv_orders = dict(argv_orders, channel_fd=channel_w)
    self.proc = subprocess.Popen(  # noqa: S603 - our own interpreter
        [sys.executable, "-I", "-B", "-c", BOOT],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, pass_fds=(channel_w,),
        env=_environment(verbose), start_new_session=True)
    os.close(channel_w)
    self.channel = channel_r
    self.messages: List[Dict[str, Any]] = []
    self.log = bytearray()
    self.buffer = bytearray()
    self.received = 0
    self.verbose = verbose
    assert self.proc.stdin is not None
    try:
      self.proc.stdin.write(json.dumps(argv_orders).encode())
      self.proc.stdin.close()
    except BrokenPipeError:
      pass

  def kill(self) -> None:
    try:
      os.killpg(self.proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
      pass

  def read_until_done(self, deadline: float) -> bool:
    """Reads both pipes until both close; False if ``deadline`` came."""
    sel = selectors.DefaultSelector()
    assert self.proc.stdout is not None
    sel.register(self.channel, selectors.EVENT_READ, "channel")
    sel.register(self.proc.stdout.fileno(), selectors.EVENT_READ, "log")
    try:
      while sel.get_map():
        left = deadline - time.monotonic()
        if left <= 0:
          return False
        for key, _ in sel.select(timeout=min(left, 1.0)):
          chunk = os.read(key.fd, 1 << 16)
          if not chunk:
            sel.unregister(key.fd)
          elif key.data == "channel":
            self._take(chunk)
          else:
            self._log(chunk)
      return True
    finally:
      sel.close()
      os.close(self.channel)

  def _take(self, chunk: bytes) -> None:
    self.received += len(chunk)
    if self.received > _MAX_MESSAGES:
      self.kill()
      raise CommandError(
          f"the sandboxed process sent more than {_MAX_MESSAGES >> 20} MiB "
          f"of results, so graphgrad stopped it")
    self.buffer += chunk
    while b"\n" in self.buffer:
      line, _, rest = bytes(self.buffer).partition(b"\n")
      self.buffer = bytearray(rest)
      try:
        message = json.loads(line.decode("utf-8"))
      except (UnicodeDecodeError, ValueError):
        continue
      if isinstance(message, dict) and isinstance(message.get("kind"), str):
        self.messages.append(message)

  def _log(self, chunk: bytes) -> None:
    if self.verbose:
      sys.stderr.write(chunk.decode("utf-8", "replace"))
      sys.stderr.flush()
    if len(self.log) < _MAX_LOG:
      self.log += chunk[:_MAX_LOG - len(self.log)]

  def last(self, kind: str) -> Optional[Dict[str, Any]]:
    found = [m for m in self.messages if m["kind"] == kind]
    return found[-1] if found else None


def _in_child(command: ModelCommand, args, argv: List[str]
              ) -> Dict[str, Any]:
  prog = f"graphgrad {args.command}"
  try:
    child = _Child(orders(command, args, argv),
                   getattr(args, "verbose", False))
  except OSError as e:
    raise CommandError(
        f"cannot start the sandboxed process ({e}); pass --no-sandbox to "
        f"open the model in this process, only if you trust it") from None
  deadline = time.monotonic() + args.timeout
  try:
    finished = child.read_until_done(deadline)
    if finished:
      try:
        child.proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
      except subprocess.TimeoutExpired:
        finished = False
  except BaseException:
    child.kill()
    child.proc.wait()
    raise
  if not finished:
    child.kill()
    child.proc.wait()
    raise CommandError(
        f"--timeout {args.timeout:g}: the model ran for {args.timeout:g} s "
        f"without finishing ({_doing(child)}), so {prog} stopped it; pass "
        f"a larger --timeout if it needs more time")
  child.kill()  # anything the child left in its process group
  return _outcome(child, args)


def _doing(child: _Child) -> str:
  phase = child.last("phase")
  if phase is None:
    return "while starting"
  return f"while {phase.get('phase', 'working')}"


def _outcome(child: _Child, args) -> Dict[str, Any]:
  """The child's result, or the one line that says how it ended."""
  result, error = child.last("result"), child.last("error")
  sandbox = child.last("sandbox")
  if sandbox is not None:
    raise CommandError(
        f"the sandbox could not be set up: {_text(sandbox.get('message'))}. "
        f"Pass --no-sandbox to open the model in this process, only if "
        f"you trust it")
  if error is not None:
    raise CommandError(_text(error.get("message")))
  code = child.proc.returncode
  if result is not None and code == 0 and isinstance(result.get("outcome"),
                                                       dict):
    return result["outcome"]
  if code is not None and code < 0:
    if -code == signal.SIGKILL:
      what = ("was killed (SIGKILL), most likely by the kernel for running "
              f"out of memory (--memory {args.memory_text})")
    else:
      what = _SIGNALS.get(-code, f"ended on signal {_signal_name(-code)}")
    check = _tensorflow_check(child.log)
    raise CommandError(
        f"the sandboxed process {what} {_doing(child)}"
        + (f" ({check})" if check else "")
        + "; nothing outside it was touched")
  if child.last("confined") is None:
    raise CommandError(
        f"the sandboxed process ended with exit status {code} before it "
        f"was confined: {_last_log_line(child.log)}. Pass --no-sandbox to "
        f"open the model in this process, only if you trust it")
  raise CommandError(
      f"the sandboxed process ended with exit status {code} {_doing(child)} "
      f"without a result")


def _signal_name(number: int) -> str:
  try:
    return signal.Signals(number).name
  except ValueError:
    return str(number)


def _tensorflow_check(log: bytearray) -> str:
  """TensorFlow's ``Check failed`` line before an abort, shortened."""
  for line in reversed(bytes(log).decode("utf-8", "replace").splitlines()):
    if "Check failed" in line or "terminate called" in line:
      return _text(line.split("] ", 1)[-1])[:160]
  return ""


def _last_log_line(log: bytearray) -> str:
  lines = bytes(log).decode("utf-8", "replace").strip().splitlines()
  return _text(lines[-1])[:200] if lines else "(it printed nothing)"


def _text(value: Any) -> str:
  """A string from the child, without control characters."""
  text = value if isinstance(value, str) else repr(value)
  return "".join(c if c.isprintable() or c in "\n\t" else "?" for c in text)
