"""Argument checks and a quiet TensorFlow for the ``graphgrad`` command line.

Every bad argument ends as one line on stderr and exit code 2, never a
traceback: argparse's own errors go through :class:`Parser`, the value checks
here raise ``argparse.ArgumentTypeError`` (which argparse reports as
``argument --steps: ...``), and :func:`check_output` and :func:`check_model`
refuse a path before any work starts. Nothing here imports TensorFlow but
:func:`quiet_tensorflow`, so all of that, ``--help`` and ``--version``
answer at once.
"""

import argparse
import math
import os
import sys
import warnings
from typing import Optional

from graphgrad import _installed, _startup


class CommandError(Exception):
  """A user error: printed as one line, exit code 2."""


class UsageError(Exception):
  """A bad command line: ``prog`` and the message, printed as one line."""

  def __init__(self, prog: str, message: str):
    super().__init__(message)
    self.prog = prog


class Parser(argparse.ArgumentParser):
  """An ArgumentParser whose errors are one line, reported by ``main``.

  argparse prints the usage and the error on two lines and exits; the
  command line prints ``graphgrad demo: error: ...`` alone and returns 2.
  """

  def error(self, message):
    raise UsageError(self.prog, message)


def _number(text: str, kind, what: str):
  try:
    value = kind(text)
  except (TypeError, ValueError):
    raise argparse.ArgumentTypeError(
        f"expected {what}; got {text!r}") from None
  if kind is float and not math.isfinite(value):
    raise argparse.ArgumentTypeError(f"expected {what}; got {text!r}")
  return value


def _bounded(text: str, kind, what: str, bound: str, ok):
  """``text`` as a ``kind`` for which ``ok`` holds, else ArgumentTypeError."""
  value = _number(text, kind, what)
  if not ok(value):
    raise argparse.ArgumentTypeError(f"expected {what} ({bound}); got {text!r}")
  return value


def positive_int(text: str) -> int:
  """An int of at least 1, for ``--steps`` and ``--batch-size``.

  Example:
    >>> positive_int("3")
    3
  """
  return _bounded(text, int, "a positive integer", "1 or more",
                  lambda v: v >= 1)


def non_negative_int(text: str) -> int:
  """An int of at least 0, for ``--seed``."""
  return _bounded(text, int, "a non-negative integer", "0 or more",
                  lambda v: v >= 0)


def positive_float(text: str) -> float:
  """A finite float above 0, for ``--lr``.

  Example:
    >>> positive_float("1e-3")
    0.001
  """
  return _bounded(text, float, "a positive finite number", "above 0",
                  lambda v: v > 0)


def non_negative_float(text: str) -> float:
  """A finite float of at least 0, for ``--noise``."""
  return _bounded(text, float, "a non-negative finite number", "0 or more",
                  lambda v: v >= 0)


def check_output(flag: str, path: str) -> None:
  """Refuses an output file that cannot be written, before any work.

  A typo in a directory then costs no training run. Writing can still fail
  later (a full disk); the caller reports that ``OSError`` too.

  Raises:
    CommandError: naming ``flag``, the path and the reason.
  """
  folder = os.path.dirname(os.path.abspath(path))
  if os.path.isdir(path):
    raise CommandError(f"{flag} {path!r} is a directory; pass a file name")
  if not os.path.isdir(folder):
    raise CommandError(
        f"{flag} {path!r}: the directory {folder!r} does not exist")
  if not os.access(folder, os.W_OK):
    raise CommandError(
        f"{flag} {path!r}: the directory {folder!r} is not writable")


def add_saved_model_flags(parser: argparse.ArgumentParser) -> None:
  """``--signature`` and ``--tag``: which part of a SavedModel ``inspect``
  and ``grads`` open."""
  parser.add_argument("--signature", metavar="KEY",
                      help="the signature of a TF2 SavedModel to open "
                           "(default: serving_default)")
  parser.add_argument("--tag", default="serve",
                      help="tag of the SavedModel MetaGraph to load "
                           "(default: serve)")


def check_model(path: str, signature: Optional[str] = None) -> None:
  """Refuses a model path that does not exist, and a ``--signature`` for a
  file (only a SavedModel directory has signatures), before TensorFlow is
  imported.

  Raises:
    CommandError: naming the path and what to pass instead.
  """
  if not os.path.exists(path):
    raise CommandError(
        f"no such file: {path!r}. Pass the .meta file that "
        f"tf.compat.v1.train.Saver.save wrote next to the checkpoint, a "
        f"SavedModel directory, or a frozen .pb.")
  if signature is not None and not os.path.isdir(path):
    raise CommandError(
        f"--signature {signature!r}: {path!r} is a file, not a SavedModel "
        f"directory; its tensors are named with --loss or --output NAME, "
        f"and --signature chooses a TF2 SavedModel's signature. Leave it "
        f"out.")


class Version(argparse.Action):
  """``--version``: graphgrad's version and TensorFlow's, found when asked
  for and without importing TensorFlow."""

  def __init__(self, option_strings, dest=argparse.SUPPRESS,
               default=argparse.SUPPRESS,
               help="show program's version number and exit"):  # pylint: disable=redefined-builtin
    super().__init__(option_strings=option_strings, dest=dest,
                     default=default, nargs=0, help=help)

  def __call__(self, parser, namespace, values, option_string=None):
    import graphgrad  # pylint: disable=g-import-not-at-top
    found = _installed.tensorflow_version()
    tensorflow = f"TensorFlow {found}" if found else "TensorFlow not installed"
    print(f"graphgrad {graphgrad.__version__} ({tensorflow})")
    parser.exit()


def check_tensorflow() -> None:
  """In the command line, logs graphgrad's warning for a TensorFlow outside
  the tested range, reading its version without importing it.

  Here, not at import: a bad argument stays one line.
  """
  if _startup.is_command_line():
    _installed.check_tensorflow()


def quiet_tensorflow(verbose: bool) -> None:
  """Imports TensorFlow with its start-up and deprecation logs off.

  Also logs graphgrad's warning for a TensorFlow outside the tested range
  (:func:`check_tensorflow`; ``graphgrad._compat`` leaves it to the command
  line, so that a bad argument is still reported as one line). With
  ``verbose`` nothing is hidden. Otherwise ``TF_CPP_MIN_LOG_LEVEL``
  defaults to 3, the C++ start-up lines are dropped, and the Python loggers
  of TensorFlow and absl and TensorFlow's warnings show errors only.
  """
  check_tensorflow()
  if verbose:
    return
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  if "tensorflow" not in sys.modules:
    with _startup.stderr_silenced():
      import tensorflow  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  import logging  # pylint: disable=g-import-not-at-top
  logging.getLogger("tensorflow").setLevel(logging.ERROR)
  try:
    from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
    absl_logging.set_verbosity(absl_logging.ERROR)
  except ImportError:  # absl comes with TensorFlow; be safe anyway
    pass
  warnings.filterwarnings(
      "ignore", module=r"(tensorflow|tf_keras|keras)(\.|$)")


_phase_listener = None


def set_phase_listener(listener) -> None:
  """Calls ``listener(text)`` at each :func:`phase` (the sandboxed child
  reports them to the parent); ``None`` stops it."""
  global _phase_listener
  _phase_listener = listener


def phase(text: str) -> None:
  """Says what a command is doing now, e.g. ``"reading the model"``: a
  crash of the sandboxed child is named with it."""
  if _phase_listener is not None:
    _phase_listener(text)


_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def memory_size(text: str) -> int:
  """A size in bytes from ``"8G"``, ``"512M"``, ``"1.5G"`` or ``"1000000"``.

  Example:
    >>> memory_size("512M")
    536870912
  """
  body = text.strip().upper().removesuffix("B").removesuffix("I")
  unit = body[-1:] if body[-1:] in _SIZE_UNITS and body[-1:] else ""
  try:
    value = float(body[:-1] if unit else body)
  except ValueError:
    value = float("nan")
  if not math.isfinite(value) or value * _SIZE_UNITS[unit] < (64 << 20):
    raise argparse.ArgumentTypeError(
        f"expected a memory size of at least 64M, such as 4G or 512M; got "
        f"{text!r}")
  return int(value * _SIZE_UNITS[unit])
