"""Everything that depends on the TensorFlow version, in one place.

graphgrad supports TensorFlow 2.15 (the last release that bundles Keras 2)
through 2.21. Within that range the ``tf.compat.v1`` graph API it builds on
is the same, so the library needs no version switches; this module holds the
range, and the check that says so when TensorFlow is outside it.
"""

import logging
import re
from typing import Tuple

import tensorflow as tf

log = logging.getLogger("graphgrad")

# Oldest and newest tested (major, minor); the README and setup.cfg agree.
OLDEST = (2, 15)
NEWEST = (2, 21)


def parse_version(version: str) -> Tuple[int, int]:
  """``"2.15.1"`` or ``"2.16.0rc0"`` -> ``(2, 15)`` / ``(2, 16)``.

  Example:
    >>> parse_version("2.21.0-dev20251101")
    (2, 21)
  """
  m = re.match(r"(\d+)\.(\d+)", version)
  return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


TF_VERSION = parse_version(tf.__version__)


def check_tensorflow(version: str = tf.__version__) -> bool:
  """Logs a warning when TensorFlow is outside the tested range.

  Returns:
    True when the version is supported.

  Example:
    >>> check_tensorflow("2.18.0")
    True
  """
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
  import importlib  # pylint: disable=g-import-not-at-top
  try:
    importlib.import_module(name)
  except ImportError:
    return False
  return True
