"""Everything that depends on the TensorFlow version, in one place.

graphgrad supports TensorFlow 2.15 (the last release that bundles Keras 2)
through 2.21. Within that range the ``tf.compat.v1`` graph API it builds on
is the same, so the library needs no version switches; this module holds the
range, the check that says so when TensorFlow is outside it, and every use
of a private TensorFlow or Keras API, each with its fallback.

Private APIs graphgrad touches (:data:`PRIVATE_APIS`), and what happens
when a TensorFlow release drops or changes one:

* ``tf.Operation._id`` (creation order; :func:`op_id`): falls back to the
  op's position in ``graph.get_operations()``, which lists ops in creation
  order.
* ``tf.DType._is_ref_dtype`` (:func:`is_ref_dtype`): falls back to the
  dtype's name, which ends in ``_ref`` exactly for reference dtypes.
* ``tf.Operation._get_control_flow_context`` (``tf.compat.v1`` loops and
  conds; :func:`control_flow_context`): falls back to the while and cond
  contexts of the graph's ``WHILE_CONTEXT`` and ``COND_CONTEXT``
  collections, matched by name scope. It is exact for while loops and
  conservative for conds (a cond's ``Switch`` and ``Merge`` count as inside),
  so a boundary there is refused rather than cut wrongly.
* ``gradients_util._MarkReachedOps`` (the walk ``graphgrad.plan._reach``
  shortens): when it is missing or has another signature the plan keeps
  TensorFlow's own walk, which builds the same graph more slowly, and logs
  that once.
* ``tensorflow.python.framework.ops.get_gradient_function`` (does an op
  have a registered gradient; :func:`has_gradient_function`): falls back to
  taking every op to have one, so ``graphgrad inspect`` lists no op without
  a gradient and ``tf.gradients`` reports a missing one itself. The plan's
  engine replaces it, on first use, with a lookup that returns TensorFlow's
  own function everywhere except inside one of the engine's own
  ``tf.gradients`` calls, on that call's thread, where it wraps the
  functions of a few ops (``graphgrad.plan._hooks``: a chain of linearly
  rewritten layers in one call). Without it the engine makes one call per
  rewritten layer, which gives the same gradients with one more op per
  boundary, and logs that once.
* Keras ``Layer._flatten_layers`` (direct sublayers; :func:`sublayers`):
  falls back to ``model.layers``, then to the layers held in the object's
  attributes.
* Keras 3 ``Variable._value`` (``graphgrad.keras._tape.tf_variable``): the
  public ``Variable.value`` is tried first.
"""

import contextlib
import inspect
import logging
import re
import threading
from typing import Any, Dict, List, Optional, Set, Tuple

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


# --------------------------------------------------------------------------
# Private TensorFlow and Keras APIs, each with its fallback
# --------------------------------------------------------------------------


class ThreadPatch:
  """A module function replaced for good, acting only for threads that ask.

  :meth:`active` puts ``replacement`` in place of ``module.<name>`` the first
  time it is entered, and never puts the original back: another thread may
  be inside its own block at that moment. Within the block, :meth:`value` on
  this thread returns the value given; everywhere else it returns ``None``,
  and the replacement must then behave as the original.

  Example:
    >>> import types
    >>> mod = types.SimpleNamespace(f=lambda: "original")
    >>> patch = ThreadPatch("f", lambda: patch.value() or "original")
    >>> with patch.active(mod, "patched"):
    ...   inside = mod.f()
    >>> inside, mod.f()
    ('patched', 'original')
  """

  def __init__(self, name: str, replacement):
    self.name = name
    self.replacement = replacement
    self._local = threading.local()

  def value(self) -> Any:
    return getattr(self._local, "value", None)

  @contextlib.contextmanager
  def active(self, module, value):
    if getattr(module, self.name, None) is not self.replacement:
      setattr(module, self.name, self.replacement)
    previous = self.value()
    self._local.value = value
    try:
      yield
    finally:
      self._local.value = previous


PRIVATE_APIS = (
    "tf.Operation._id",
    "tf.DType._is_ref_dtype",
    "tf.Operation._get_control_flow_context",
    "tensorflow.python.ops.gradients_util._MarkReachedOps",
    "tensorflow.python.framework.ops.get_gradient_function",
    "keras Layer._flatten_layers",
    "keras 3 Variable._value",
)

_warned: Set[str] = set()


def warn_fallback(api: str, fallback: str) -> None:
  """Logs once per process that ``api`` is missing and ``fallback`` is used."""
  if api in _warned:
    return
  _warned.add(api)
  log.warning("TensorFlow %s has no usable %s; graphgrad uses %s instead.",
              tf.__version__, api, fallback)


_ORDER_CACHE: Dict[int, Tuple[int, Dict[str, int]]] = {}


def op_id(op: tf.Operation) -> int:
  """The op's creation index in its graph (``op._id``, or its fallback).

  Example:
    >>> with tf.Graph().as_default():
    ...   a = tf.constant(1.0); b = a + 1.0
    ...   op_id(a.op) < op_id(b.op)
    True
  """
  try:
    return op._id  # pylint: disable=protected-access
  except AttributeError:
    warn_fallback("tf.Operation._id", "the order of graph.get_operations()")
  graph = op.graph
  version, order = _ORDER_CACHE.get(id(graph), (-1, {}))
  if version != graph.version or op.name not in order:
    order = {o.name: i for i, o in enumerate(graph.get_operations())}
    _ORDER_CACHE[id(graph)] = (graph.version, order)
  return order[op.name]


def is_ref_dtype(dtype: tf.DType) -> bool:
  """True for a reference dtype (``float32_ref``), a TF1 ref variable's.

  Example:
    >>> is_ref_dtype(tf.float32), is_ref_dtype(tf.float32._as_ref)
    (False, True)
  """
  try:
    return dtype._is_ref_dtype  # pylint: disable=protected-access
  except AttributeError:
    warn_fallback("tf.DType._is_ref_dtype", "the dtype's name")
  return dtype.name.endswith("_ref")


def control_flow_context(op: tf.Operation):
  """The ``tf.compat.v1`` while or cond context ``op`` was built in, or None.

  Contexts have ``name`` and ``outer_context``.
  """
  get = getattr(op, "_get_control_flow_context", None)
  if callable(get):
    return get()
  warn_fallback("tf.Operation._get_control_flow_context",
                "the WHILE_CONTEXT and COND_CONTEXT collections")
  return context_by_name(op)


def context_by_name(op: tf.Operation):
  """The innermost v1 context whose name scope holds ``op``'s name.

  A context named ``rnn/while/while_context`` holds the ops under
  ``rnn/while/``.
  """
  best, best_len = None, -1
  for key in (tf.compat.v1.GraphKeys.WHILE_CONTEXT,
              tf.compat.v1.GraphKeys.COND_CONTEXT):
    for ctx in op.graph.get_collection(key):
      prefix = ctx.name.rsplit("/", 1)[0] + "/" if "/" in ctx.name else ""
      if prefix and op.name.startswith(prefix) and len(prefix) > best_len:
        best, best_len = ctx, len(prefix)
  return best


_MARK_REACHED_PARAMS = ("from_ops", "reached_ops", "func_graphs")


def mark_reached_ops(fn, module) -> Optional[Any]:
  """``fn``, TF's ``_MarkReachedOps`` of ``module``, if it is usable.

  Returns None, and logs once, when ``fn`` is missing or takes other
  parameters, or ``module`` lacks the ``_PendingCount`` it pairs with: the
  caller then leaves TensorFlow's walk alone.
  """
  params = None
  if callable(fn):
    try:
      params = tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
      params = None
  if params == _MARK_REACHED_PARAMS and hasattr(module, "_PendingCount"):
    return fn
  warn_fallback("gradients_util._MarkReachedOps(from_ops, reached_ops, "
                "func_graphs)", "TensorFlow's unbounded walk (same graph, "
                "slower build)")
  return None


def _get_gradient_function():
  try:
    from tensorflow.python.framework import ops  # pylint: disable=g-direct-tensorflow-import,g-import-not-at-top
  except ImportError:
    return None
  fn = getattr(ops, "get_gradient_function", None)
  return fn if callable(fn) else None


def has_gradient_function(op: tf.Operation) -> bool:
  """False when ``tf.gradients`` would raise ``LookupError`` at ``op``.

  Example:
    >>> with tf.Graph().as_default():
    ...   has_gradient_function(tf.square(tf.constant(2.0)).op)
    True
  """
  fn = _get_gradient_function()
  if fn is None:
    warn_fallback("ops.get_gradient_function",
                  "taking every op to have a gradient")
    return True
  try:
    fn(op)
  except LookupError:
    return False
  return True


def has_sublayers_api(layer) -> bool:
  """True for an object that :func:`sublayers` can list: a Keras layer."""
  return callable(getattr(layer, "_flatten_layers", None)) or _is_layer(layer)


def _is_layer(obj) -> bool:
  return (callable(obj) and hasattr(obj, "trainable_weights")
          and hasattr(obj, "name"))


def sublayers(layer) -> List[Any]:
  """The direct sublayers of a Keras 3 or tf-keras layer, in order."""
  flatten = getattr(layer, "_flatten_layers", None)
  if callable(flatten):
    return list(flatten(include_self=False, recursive=False))
  warn_fallback("keras Layer._flatten_layers",
                "model.layers and the layers held in attributes")
  listed = getattr(layer, "layers", None)
  if isinstance(listed, (list, tuple)):
    return list(listed)
  found, seen = [], set()
  for value in vars(layer).values():
    items = value if isinstance(value, (list, tuple)) else [value]
    for item in items:
      if item is not layer and id(item) not in seen and _is_layer(item):
        seen.add(id(item))
        found.append(item)
  return found

