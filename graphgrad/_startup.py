"""Keeps TensorFlow's C++ start-up lines off the ``graphgrad`` terminal.

TensorFlow's libraries write ``absl::InitializeLog``, oneDNN and CUDA lines
straight to file descriptor 2 while they load, before
``TF_CPP_MIN_LOG_LEVEL`` is read. ``import graphgrad`` loads no TensorFlow;
the first public name that needs it does (the package's ``__getattr__``),
inside :func:`quiet_when_command_line`: in the command line without
``--verbose`` the descriptor goes to a temporary file for the import; in any
other program (a notebook, a training script) nothing changes. The command
line's own commands import TensorFlow the same way, through
``graphgrad.cli._args.quiet_tensorflow``. This module imports no TensorFlow.
"""

import contextlib
import os
import sys
import tempfile


def is_command_line() -> bool:
  """True in the ``graphgrad`` script and in ``python -m graphgrad``."""
  if sys.argv and os.path.basename(sys.argv[0]) in ("graphgrad",
                                                    "graphgrad.exe"):
    return True
  orig = list(getattr(sys, "orig_argv", ()))
  return any(a == "-m" and b in ("graphgrad", "graphgrad.cli._main")
             for a, b in zip(orig, orig[1:]))


def verbose() -> bool:
  """True when the command line asks for TensorFlow's logs."""
  return "--verbose" in sys.argv[1:]


@contextlib.contextmanager
def quiet_when_command_line():
  """Silences descriptor 2 for the block in a non-verbose command line."""
  if "tensorflow" in sys.modules or not is_command_line() or verbose():
    yield
    return
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  with stderr_silenced():
    yield


@contextlib.contextmanager
def stderr_silenced():
  """Sends file descriptor 2 to a temporary file; replays it on an error.

  TensorFlow's C++ start-up lines (``absl::InitializeLog``, oneDNN, CUDA)
  are written to the descriptor while its libraries load, before
  ``TF_CPP_MIN_LOG_LEVEL`` is consulted, so only a redirect keeps them off
  the terminal.
  """
  try:
    saved = os.dup(2)
  except OSError:  # no real stderr descriptor (an embedding host)
    yield
    return
  with tempfile.TemporaryFile() as sink:
    sys.stderr.flush()
    os.dup2(sink.fileno(), 2)
    try:
      yield
    except BaseException:
      os.dup2(saved, 2)
      sink.seek(0)
      sys.stderr.write(sink.read().decode("utf-8", "replace"))
      raise
    finally:
      os.dup2(saved, 2)
      os.close(saved)
