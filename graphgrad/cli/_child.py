"""The work of a command on a model, in the sandboxed child or in-process.

The child starts as :data:`graphgrad.cli._sandbox.BOOT`, confines itself
while it still has one thread (:func:`graphgrad.cli._confine.enter`), then
calls :func:`run`, which imports TensorFlow. It speaks JSON lines on the
descriptor the parent passed: ``confined`` (or ``sandbox`` and why not),
``phase`` as the work goes on (a crash is named with it), then one
``result`` (the printed text and the data the parent writes files from) or
one ``error`` line for the person. Its standard output and error reach the
person only with ``--verbose``. :func:`compute_here` runs the same work in
the command line's own process for ``--no-sandbox``.
"""

import contextlib
import io
from typing import Optional

from graphgrad.cli import _args


def _first_line(e: BaseException, limit: int = 200) -> str:
  text = str(getattr(e, "message", None) or e).strip()
  return (text.splitlines() or [""])[0][:limit]


def _op_error(e) -> str:
  """``op 'w': /tmp/x; Permission denied``: where a TensorFlow op failed
  and TensorFlow's own reason (the last line of its message that is not
  the node's description)."""
  lines = [l.strip() for l in str(e.message).splitlines()]
  lines = [l for l in lines if l and not l.startswith("[[")
           and not l.startswith("Node:") and not l.endswith(":")]
  reason = (lines[-1] if lines else type(e).__name__)[:200]
  return f"op {e.op.name!r}: {reason}" if e.op is not None else reason


def describe(e: BaseException, phase: str, memory: Optional[str]) -> str:
  """One line for an exception that ended ``phase`` in the child.

  Args:
    e: the exception.
    phase: what the child was doing.
    memory: the sandbox's memory limit (``"8G"``); ``None`` outside the
      sandbox, where a refused permission is the system's, not the
      sandbox's.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  from graphgrad import _errors  # pylint: disable=g-import-not-at-top
  if isinstance(e, (_args.CommandError, _errors.GraphGradError)):
    return str(e)
  if isinstance(e, (MemoryError, tf.errors.ResourceExhaustedError)):
    if memory is None:
      return (f"the graph ran out of memory while {phase} (in this "
              f"process: --no-sandbox sets no limit)")
    return (f"the graph ran out of memory while {phase}: the sandbox allows "
            f"--memory {memory}; pass a larger --memory if the model needs "
            f"it")
  if memory is not None and (
      isinstance(e, tf.errors.PermissionDeniedError) or (
          isinstance(e, OSError) and getattr(e, "errno", None) in (1, 13))):
    what = _op_error(e) if isinstance(e, tf.errors.OpError) else \
        _first_line(e)
    return (f"the sandbox refused what the graph tried while {phase} "
            f"({what}): a saved graph may not write files, read outside "
            f"its model, use the network or start programs")
  if isinstance(e, tf.errors.OpError):
    return f"{phase} failed at {_op_error(e)}"
  return f"{phase} failed ({type(e).__name__}: {_first_line(e)})"


class _Phases:
  """What the work is doing now (``now``); each change is also told to
  ``tell``, if given (the child's message to the parent)."""

  def __init__(self, tell=None):
    self.now = "starting TensorFlow"
    self.tell = tell

  def enter(self, text: str) -> None:
    self.now = text
    if self.tell is not None:
      self.tell(text)


def run(spec: dict, channel, build_parser) -> None:
  """Runs the command of ``spec["argv"]`` and reports on ``channel``.

  Args:
    spec: the parent's orders.
    channel: the message file.
    build_parser: the command line's parser factory.

  Never raises: every ending is a message.
  """
  from graphgrad.cli import _confine  # pylint: disable=g-import-not-at-top

  phases = _Phases(lambda text: _confine.send(channel, "phase", phase=text))
  try:
    _args.set_phase_listener(phases.enter)
    phases.enter(phases.now)
    # Imported here, confined, with its start-up lines on the log the
    # parent shows with --verbose: quiet_tensorflow then has nothing to
    # silence (which takes a temporary file, and the child may write none).
    import tensorflow  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
    args = build_parser().parse_args(spec["argv"])
    outcome = compute(args)
  except BaseException as e:  # pylint: disable=broad-except
    try:
      message = describe(e, phases.now, spec["memory_text"])
    except BaseException:  # pylint: disable=broad-except
      message = f"{phases.now} failed ({type(e).__name__})"
    _confine.send(channel, "error", message=message)
    return
  _confine.send(channel, "result", outcome=outcome)


def compute(args) -> dict:
  """The command's work, its printed text captured: ``{"text": ..., ...}``.

  The same call runs in the child and, with ``--no-sandbox``, in the
  command line's own process.
  """
  buffer = io.StringIO()
  with contextlib.redirect_stdout(buffer):
    outcome = dict(args.command_spec.compute(args))
  outcome["text"] = buffer.getvalue()
  return outcome


def compute_here(args) -> dict:
  """:func:`compute` in the command line's own process (``--no-sandbox``):
  an error is one line, as it is from the child.

  Raises:
    CommandError: for any exception of the work.
  """
  phases = _Phases()
  _args.set_phase_listener(phases.enter)
  try:
    return compute(args)
  except (KeyboardInterrupt, SystemExit):
    raise
  except BaseException as e:  # pylint: disable=broad-except
    raise _args.CommandError(describe(e, phases.now, None)) from None
  finally:
    _args.set_phase_listener(None)
