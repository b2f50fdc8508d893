"""What is installed, learnt without importing TensorFlow.

Importing TensorFlow takes seconds, so the ``graphgrad`` command line
answers ``--help``, ``--version`` and every bad argument without it, and
the parent of a sandboxed command never imports it at all. What they need
to know is here: TensorFlow's installed version (from its distribution's
metadata), the range graphgrad is tested with and its check, and whether an
optional package such as matplotlib can be imported. This module imports no
TensorFlow; :mod:`graphgrad._compat` holds what needs it.
"""

import importlib
import importlib.metadata
import logging
import re
import sys
from typing import Optional, Tuple

log = logging.getLogger("graphgrad")

# Oldest and newest tested (major, minor); the README and setup.cfg agree.
OLDEST = (2, 15)
NEWEST = (2, 21)

# The distributions that install the ``tensorflow`` module, most usual first.
_DISTRIBUTIONS = ("tensorflow", "tensorflow-cpu", "tf-nightly",
                  "tf-nightly-cpu", "tensorflow-macos", "tensorflow-intel")


def parse_version(version: str) -> Tuple[int, int]:
  """``"2.15.1"`` or ``"2.16.0rc0"`` -> ``(2, 15)`` / ``(2, 16)``.

  Example:
    >>> parse_version("2.21.0-dev20251101")
    (2, 21)
  """
  m = re.match(r"(\d+)\.(\d+)", version)
  return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def tensorflow_version() -> Optional[str]:
  """TensorFlow's version, without importing it; ``None`` when none is
  installed.

  Once TensorFlow is imported its own ``__version__`` answers; before, the
  metadata of the first installed distribution of :data:`_DISTRIBUTIONS`.

  Example:
    >>> tensorflow_version() is not None
    True
  """
  tf = sys.modules.get("tensorflow")
  if tf is not None and isinstance(getattr(tf, "__version__", None), str):
    return tf.__version__
  for name in _DISTRIBUTIONS:
    try:
      return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      continue
  return None


def check_tensorflow(version: Optional[str] = None) -> bool:
  """Logs a warning when TensorFlow is outside the tested range.

  Args:
    version: the version to check; ``None`` for the installed one
      (:func:`tensorflow_version`). Without a TensorFlow nothing is logged.

  Returns:
    True when the version is supported.

  Example:
    >>> check_tensorflow("2.18.0")
    True
  """
  if version is None:
    version = tensorflow_version()
    if version is None:
      return False
  v = parse_version(version)
  if OLDEST <= v <= NEWEST:
    return True
  log.warning(
      "graphgrad is tested with TensorFlow %d.%d to %d.%d; found %s. "
      "tf.compat.v1 behaviour may differ: install a tested version, e.g. "
      "pip install 'tensorflow>=%d.%d,<%d.%d'.", *OLDEST, *NEWEST, version,
      *OLDEST, NEWEST[0], NEWEST[1] + 1)
  return False


def has_module(name: str) -> bool:
  """True when the optional package ``name`` can be imported.

  Example:
    >>> has_module("networkx")
    True
  """
  try:
    importlib.import_module(name)
  except ImportError:
    return False
  return True
