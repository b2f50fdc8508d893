"""Everything that depends on the TensorFlow version, in one place.

graphgrad supports TensorFlow 2.15 (the last release that bundles Keras 2)
through 2.21; within that range the ``tf.compat.v1`` graph API it builds on
is the same. The range and its check live in :mod:`graphgrad._installed`,
which the command line reads before it imports TensorFlow; this module
checks the imported version once, at import. It holds every private
TensorFlow or Keras API graphgrad uses (:data:`PRIVATE_APIS`): why each is
needed, a self-test run once at first use that proves on this TensorFlow the
behaviour graphgrad relies on (for a replaced lookup, that ``tf.gradients``
really calls the replacement), and the public fallback taken, with one
logged warning, when the self-test fails (:func:`usable`). Tests change
its state through functions, never its globals (:func:`as_at_import`).
"""

import collections
import contextlib
import dataclasses
import functools
import importlib
import logging
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

import numpy as np
import tensorflow as tf

from graphgrad import _installed, _startup

log = logging.getLogger("graphgrad")

TF_VERSION = _installed.parse_version(tf.__version__)

if not _startup.is_command_line():  # the command line checks after its args
  _installed.check_tensorflow(tf.__version__)


# --------------------------------------------------------------------------
# The registry of private APIs, their self-tests and fallbacks
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PrivateApi:
  """One private TensorFlow or Keras API that graphgrad uses.

  Attributes:
    name: the API, as TensorFlow or Keras spells it.
    symbols: the private names graphgrad's source reads for it (a private
      module, or an ``_``-prefixed attribute).
    why: what graphgrad needs it for.
    self_test: what :attr:`check` proves on this TensorFlow.
    fallback: the public behaviour used when the self-test fails.
    check: runs the self-test; raises when the behaviour does not hold.
  """
  name: str
  symbols: Tuple[str, ...]
  why: str
  self_test: str
  fallback: str
  check: Callable[..., None] = dataclasses.field(repr=False)


class SelfTestError(Exception):
  """A private API does not behave as graphgrad relies on."""


_results: Dict[Tuple[str, str], bool] = {}
_warned: Set[str] = set()
_lock = threading.RLock()


def usable(key: str, variant: str = "") -> bool:
  """True when the self-test of ``PRIVATE_APIS[key]`` passed on this TF.

  The self-test runs once per process (and per ``variant``, the Keras
  package for ``"flatten_layers"``). When it fails, one warning is logged
  and the caller must take the API's fallback.
  """
  cached = _results.get((key, variant))
  if cached is not None:
    return cached
  with _lock:
    if (key, variant) not in _results:
      api = PRIVATE_APIS[key]
      try:
        with observed_walks(None):
          api.check(variant) if variant else api.check()
        _results[(key, variant)] = True
      except Exception as e:  # pylint: disable=broad-except
        # Whatever broke, the behaviour graphgrad relies on is not there.
        _results[(key, variant)] = False
        _warn(key, f"{type(e).__name__}: {e}")
  return _results[(key, variant)]


def _warn(key: str, reason: str) -> None:
  if key in _warned:
    return
  _warned.add(key)
  api = PRIVATE_APIS[key]
  log.warning("TensorFlow %s fails graphgrad's self-test of the private %s "
              "(%s); graphgrad uses %s instead.", tf.__version__, api.name,
              reason, api.fallback)


def reset() -> None:
  """Forgets every self-test result and warning, to run them again.

  For tests that change TensorFlow after graphgrad has used it.
  """
  with _lock:
    _results.clear()
    _warned.clear()


@contextlib.contextmanager
def as_at_import() -> Iterator[None]:
  """Within the block, the functions graphgrad replaces are read again.

  For tests that change TensorFlow: ``ops.get_gradient_function`` and
  ``gradients_util._MarkReachedOps`` are read as at import, and the
  self-tests run again; after the block, graphgrad uses the functions it
  used before and runs them again. Other seams for tests:
  :func:`original_function`, :func:`walk_bound`, :func:`observed_walks`.
  """
  global _ORIGINAL_LOOKUP, _ORIGINAL_WALK
  with _lock:
    before = _ORIGINAL_LOOKUP, _ORIGINAL_WALK
    _ORIGINAL_LOOKUP = _tf_function(_tf_ops, "get_gradient_function", before[0])
    _ORIGINAL_WALK = _tf_function(_gradients_util, "_MarkReachedOps", before[1])
    reset()
  try:
    yield
  finally:
    with _lock:
      _ORIGINAL_LOOKUP, _ORIGINAL_WALK = before
      reset()


def original_function(key: str) -> Optional[Callable]:
  """TensorFlow's function graphgrad replaces for ``PRIVATE_APIS[key]``."""
  return {"gradient_lookup": _ORIGINAL_LOOKUP,
          "reached_walk": _ORIGINAL_WALK}[key]


def _tf_function(module, name: str, replaced):
  """``module.<name>``, or ``replaced`` where graphgrad's replacement is."""
  found = getattr(module, name, None)
  return replaced if getattr(found, "__module__", None) == __name__ else found


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


# -- tensorflow.python.framework.ops.get_gradient_function -------------------

try:
  from tensorflow.python.framework import ops as _tf_ops  # pylint: disable=g-direct-tensorflow-import
except ImportError:  # a TensorFlow that moved it: the self-test fails
  _tf_ops = None

_ORIGINAL_LOOKUP = _tf_function(_tf_ops, "get_gradient_function", None)

GradientWrap = Callable[[tf.Operation, Optional[Callable]],
                        Optional[Callable]]


def _lookup(op):
  wrap = _LOOKUP.value()
  if wrap is None:
    return _ORIGINAL_LOOKUP(op)  # type: ignore[misc]
  try:
    fn = _ORIGINAL_LOOKUP(op)  # type: ignore[misc]
  except LookupError:
    # No registered gradient: the wrap may substitute one, else TF's
    # LookupError stands.
    found = wrap(op, None)
    if found is None:
      raise
    return found
  return wrap(op, fn)


_LOOKUP = ThreadPatch("get_gradient_function", _lookup)


def registered_gradient(op: tf.Operation) -> Optional[Callable]:
  """``op``'s registered gradient function; ``None`` if none or unknown."""
  if not usable("gradient_lookup"):
    return None
  try:
    return _ORIGINAL_LOOKUP(op)  # type: ignore[misc]
  except LookupError:
    return None


def gradient_named(name: str) -> Tuple[bool, Optional[Callable]]:
  """Whether a gradient is registered under ``name``, and its function.

  The function is ``None`` for a name registered as not differentiable.
  Without a usable lookup no name counts as registered.

  Example:
    >>> gradient_named("Mul")[0], gradient_named("graphgrad/NoSuchGradient")
    (True, (False, None))
  """
  if not usable("gradient_lookup"):
    return False, None
  try:
    return True, _tf_ops.gradient_registry.lookup(name)
  except LookupError:
    return False, None


def has_gradient_function(op: tf.Operation) -> bool:
  """False when ``tf.gradients`` would raise ``LookupError`` at ``op``.

  Without a usable lookup every op is taken to have one, and
  ``tf.gradients`` reports a missing one itself.

  Example:
    >>> with tf.Graph().as_default():
    ...   has_gradient_function(tf.square(tf.constant(2.0)).op)
    True
  """
  if not usable("gradient_lookup"):
    return True
  try:
    _ORIGINAL_LOOKUP(op)  # type: ignore[misc]
  except LookupError:
    return False
  return True


@contextlib.contextmanager
def wrapped_gradients(wrap: GradientWrap) -> Iterator[None]:
  """Within the block, this thread's ``tf.gradients`` uses ``wrap(op, fn)``.

  ``fn`` is ``op``'s registered gradient function, or ``None`` where it has
  none: a not-differentiable op, or one with no registered gradient. For
  the latter a ``None`` from ``wrap`` keeps TensorFlow's ``LookupError``.
  Other threads and calls outside the block see ``fn`` itself.

  Raises:
    RuntimeError: when :func:`usable` says the lookup cannot be replaced;
      callers check it first and take the fallback.
  """
  if not usable("gradient_lookup"):
    raise RuntimeError("graphgrad cannot replace ops.get_gradient_function "
                       "on this TensorFlow; check usable('gradient_lookup') "
                       "and take its fallback")
  with _LOOKUP.active(_tf_ops, wrap):
    yield


def _check_gradient_lookup() -> None:
  if not callable(_ORIGINAL_LOOKUP):
    raise SelfTestError("ops.get_gradient_function is missing")
  with tf.Graph().as_default() as g:
    x = tf.constant([1.0, 2.0])
    y = tf.reduce_sum(x * x)
    mul = y.op.inputs[0].op
    if not callable(_ORIGINAL_LOOKUP(mul)):
      raise SelfTestError("no gradient function found for Mul")
    by_name = getattr(getattr(_tf_ops, "gradient_registry", None), "lookup",
                      None)
    if by_name is None or by_name("Mul") is not _ORIGINAL_LOOKUP(mul):
      raise SelfTestError("ops.gradient_registry does not give Mul's "
                          "gradient function by name")
    with g.gradient_override_map({"Identity": "graphgrad/NoSuchGradient"}):
      unknown = tf.identity(x).op
    try:
      _ORIGINAL_LOOKUP(unknown)
      raise SelfTestError("an unregistered gradient raised no LookupError")
    except LookupError:
      pass
    try:
      by_name("graphgrad/NoSuchGradient")
      raise SelfTestError("ops.gradient_registry has an entry for an "
                          "unregistered name")
    except LookupError:
      pass
    stopped = tf.stop_gradient(x).op  # not differentiable: the lookup's None
    z = tf.reduce_sum(unknown.outputs[0] + 2.0 * stopped.outputs[0])
    called = []

    def wrap(op, fn):
      if op is unknown or op is stopped:
        # An op without a registered gradient, or a not-differentiable
        # one, gets the function given here: 5 times the gradient.
        return lambda op, grad: 5.0 * grad
      if op is not mul:
        return fn

      def tripled(op, grad):
        called.append(op)
        first, second = fn(op, grad)
        return 3.0 * first, second
      return tripled

    with _LOOKUP.active(_tf_ops, wrap):
      (hooked,) = tf.compat.v1.gradients(y, x)
    if not called:
      raise SelfTestError("tf.gradients did not call the replaced lookup")
    with _LOOKUP.active(_tf_ops, wrap):
      (substituted,) = tf.compat.v1.gradients(z, x)
    (plain,) = tf.compat.v1.gradients(y, x)
    try:
      tf.compat.v1.gradients(z, x)
      raise SelfTestError("outside the block, an op without a registered "
                          "gradient raised no LookupError")
    except LookupError:
      pass
    with tf.compat.v1.Session(graph=g) as sess:
      got, want, sub = sess.run([hooked, plain, substituted])
  if not (np.allclose(got, [4.0, 8.0]) and np.allclose(want, [2.0, 4.0])):
    raise SelfTestError(f"the replaced lookup gave {got.tolist()}, "
                        f"expected [4.0, 8.0]")
  if not np.allclose(sub, [15.0, 15.0]):
    raise SelfTestError(f"the functions substituted for ops without a "
                        f"gradient gave {sub.tolist()}, expected [15.0, 15.0]")


# -- tensorflow.python.ops.gradients_util._MarkReachedOps --------------------

try:
  from tensorflow.python.ops import gradients_util as _gradients_util  # pylint: disable=g-direct-tensorflow-import
except ImportError:  # a TensorFlow that moved it: the self-test fails
  _gradients_util = None

_ORIGINAL_WALK = _tf_function(_gradients_util, "_MarkReachedOps", None)

# Dtypes TF's walk follows, and those whose following depends on handle
# data it reads (variants) or on a flag (quantized): there the bounded walk
# hands over to TF's own.
_FOLLOWED = frozenset({tf.float16, tf.bfloat16, tf.float32, tf.float64,
                       tf.complex64, tf.complex128, tf.resource})
_UNDECIDED = frozenset({tf.variant, tf.qint8, tf.qint16, tf.qint32,
                        tf.quint8, tf.quint16})


class _Undecided(Exception):
  pass


def _bounded_walk(allowed, from_ops, reached_ops) -> None:
  added = []
  queue = collections.deque(from_ops)
  try:
    while queue:
      op = queue.popleft()
      if op not in reached_ops:
        reached_ops.add(op)
        added.append(op)
        for output in op.outputs:
          dtype = output.dtype.base_dtype
          if dtype in _UNDECIDED:
            raise _Undecided()
          if dtype in _FOLLOWED:
            queue.extend(c for c in output.consumers() if c in allowed)
  except _Undecided:
    reached_ops.difference_update(added)
    _ORIGINAL_WALK(from_ops, reached_ops, [])  # type: ignore[misc]


_watch = threading.local()  # this thread's observed_walks


def _walk(from_ops, reached_ops, func_graphs):
  allowed = _WALK.value()
  observe = getattr(_watch, "observe", None)
  if observe is not None:
    observe(allowed)
  if allowed is None or func_graphs:
    return _ORIGINAL_WALK(from_ops, reached_ops, func_graphs)  # type: ignore[misc]
  # TF's walk, restricted to ``allowed`` (``from_ops`` are always marked).
  _bounded_walk(allowed, from_ops, reached_ops)
  return None


_WALK = ThreadPatch("_MarkReachedOps", _walk)


@contextlib.contextmanager
def bounded_walk(allowed: Optional[Set[tf.Operation]]) -> Iterator[None]:
  """Within the block, this thread's ``tf.gradients`` walks only ``allowed``.

  The forward walk from ``xs`` marks no op outside ``allowed``; ``None``,
  or a TensorFlow whose walk fails its self-test, leaves it unbounded.
  """
  if allowed is None or not usable("reached_walk"):
    yield
    return
  with _WALK.active(_gradients_util, allowed):
    yield


def walk_bound() -> Optional[Set[tf.Operation]]:
  """The ops this thread's ``tf.gradients`` walk is bounded to, or None."""
  return _WALK.value()


@contextlib.contextmanager
def observed_walks(observe: Optional[Callable[[Any], None]]
                   ) -> Iterator[None]:
  """Within the block, this thread's walks call ``observe(walk_bound())``.

  Each ``tf.gradients`` call that walks through graphgrad's replacement of
  ``_MarkReachedOps`` (installed by the first bounded walk) is observed,
  except the self-tests'. ``None`` observes nothing.

  Example:
    >>> bounded = []
    >>> with tf.Graph().as_default():
    ...   x = tf.constant(2.0); y = x * x
    ...   with observed_walks(lambda bound: bounded.append(bound is not None)):
    ...     with bounded_walk({x.op, y.op}):
    ...       inside = tf.compat.v1.gradients(y, x)
    ...     outside = tf.compat.v1.gradients(y, x)
    >>> bounded, walk_bound()
    ([True, False], None)
  """
  previous = getattr(_watch, "observe", None)
  _watch.observe = observe
  try:
    yield
  finally:
    _watch.observe = previous


def _check_reached_walk() -> None:
  if not callable(_ORIGINAL_WALK):
    raise SelfTestError("gradients_util._MarkReachedOps is missing")
  with tf.Graph().as_default() as g:
    x = tf.constant([1.0, 2.0])
    h = tf.square(x)
    y = tf.reduce_sum(h)
    side = tf.reduce_sum(tf.sin(x))  # reached from x, not behind y
    del side
    behind = {x.op, h.op, y.op}
    behind |= {t.op for t in y.op.inputs}
    with _WALK.active(_gradients_util, behind):
      (bounded,) = tf.compat.v1.gradients(y, x)
    with _WALK.active(_gradients_util, {x.op}):
      (cut,) = tf.compat.v1.gradients(y, x)
    if cut is not None:
      raise SelfTestError("tf.gradients did not use the bounded walk")
    (plain,) = tf.compat.v1.gradients(y, x)
    with tf.compat.v1.Session(graph=g) as sess:
      got, want = sess.run([bounded, plain])
  if not np.allclose(got, want):
    raise SelfTestError(f"the bounded walk gave {got.tolist()}, expected "
                        f"{want.tolist()}")


# -- tf.Operation._get_control_flow_context ----------------------------------


def control_flow_context(op: tf.Operation):
  """The ``tf.compat.v1`` while or cond context ``op`` was built in, or None.

  Contexts have ``name`` and ``outer_context``.
  """
  if usable("control_flow_context"):
    return op._get_control_flow_context()  # pylint: disable=protected-access
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


def in_xla_computation() -> bool:
  """True while ops are traced into an enclosing XLA computation: inside a
  ``tf.function(jit_compile=True)`` (``fit`` after ``compile(jit_compile=
  True)``), where XLA inlines the inner ``jit_compile`` functions and
  fuses them with everything else. False when that cannot be read.
  """
  if not usable("control_flow_context", "xla"):
    return False
  graph = tf.compat.v1.get_default_graph()
  while graph is not None:
    ctx = graph._get_control_flow_context()  # pylint: disable=protected-access
    while ctx is not None:
      if ctx.IsXLAContext():
        return True
      ctx = ctx.outer_context
    graph = getattr(graph, "outer_graph", None)
  return False


@contextlib.contextmanager
def _v1_control_flow() -> Iterator[None]:
  was_v2 = tf.compat.v1.control_flow_v2_enabled()
  if was_v2:
    tf.compat.v1.disable_control_flow_v2()
  try:
    yield
  finally:
    if was_v2:
      tf.compat.v1.enable_control_flow_v2()


def _check_control_flow_context(variant: str = "") -> None:
  if variant == "xla":
    _check_xla_context()
    return
  with tf.Graph().as_default():
    with _v1_control_flow():
      x = tf.constant(1.0)
      _, out = tf.compat.v1.while_loop(lambda i, h: i < 2,
                                       lambda i, h: (i + 1, tf.tanh(h)),
                                       (tf.constant(0), x))
    inside = [op for op in out.graph.get_operations() if op.type == "Tanh"]
    if x.op._get_control_flow_context() is not None:  # pylint: disable=protected-access
      raise SelfTestError("an op outside any loop has a context")
    if len(inside) != 1:
      raise SelfTestError("no v1 while loop was built")
    ctx = inside[0]._get_control_flow_context()  # pylint: disable=protected-access
    if ctx is None or ctx.outer_context is not None or ctx not in (
        out.graph.get_collection(tf.compat.v1.GraphKeys.WHILE_CONTEXT)):
      raise SelfTestError(f"an op inside a v1 while loop has context {ctx!r}")


def _check_xla_context() -> None:
  def contexts():
    found, graph = [], tf.compat.v1.get_default_graph()
    while graph is not None:
      ctx = graph._get_control_flow_context()  # pylint: disable=protected-access
      while ctx is not None:
        found.append(bool(ctx.IsXLAContext()))
        ctx = ctx.outer_context
      graph = getattr(graph, "outer_graph", None)
    return found

  seen = {}

  def probe(name):
    seen[name] = contexts()
    return tf.constant(0)

  # Each in a scratch graph: the first use may come while tracing a step.
  with tf.Graph().as_default():
    tf.function(lambda: probe("xla"), jit_compile=True, autograph=False)()
  with tf.Graph().as_default():
    tf.function(lambda: probe("function"), autograph=False)()
  with tf.Graph().as_default():
    probe("graph")
  if seen != {"xla": [True], "function": [], "graph": []}:
    raise SelfTestError(f"the XLA contexts of a jit_compile function, a "
                        f"tf.function and a tf.Graph are {seen}")


# -- tensorflow.python.framework.op_def_registry ----------------------------

try:
  from tensorflow.python.framework import op_def_registry as _op_def_registry  # pylint: disable=g-direct-tensorflow-import
except ImportError:  # a TensorFlow that moved it: the self-test fails
  _op_def_registry = None


def op_def(op_type: str):
  """The ``OpDef`` TensorFlow registers for ``op_type``, or ``None``.

  ``None`` too for a function's name or a custom op this process has not
  loaded, and for every op type when the registry cannot be read.

  Example:
    >>> [arg.name for arg in op_def("Fill").input_arg], op_def("NoSuchOp")
    (['dims', 'value'], None)
  """
  if not usable("op_def_registry"):
    return None
  return _op_def_registry.get(op_type)


def _check_op_def_registry() -> None:
  get = getattr(_op_def_registry, "get", None)
  if not callable(get):
    raise SelfTestError("op_def_registry.get is missing")
  with tf.Graph().as_default():
    fill = tf.fill([2], 1.0).op
  if get("Fill") != fill.op_def:
    raise SelfTestError("op_def_registry.get('Fill') is not the op_def of a "
                        "Fill op")
  if get("graphgrad/NoSuchOp") is not None:
    raise SelfTestError("an unknown op type has an OpDef")


# -- Keras Layer._flatten_layers ---------------------------------------------


def _keras_package(layer) -> str:
  """``"keras"`` or ``"tf_keras"``: the package of ``layer``'s base class."""
  for cls in type(layer).__mro__:
    root = cls.__module__.split(".", 1)[0]
    if root in ("keras", "tf_keras"):
      return root
  return "keras"


def is_keras3(package: str) -> bool:
  """True when the installed Keras package ``package`` is Keras 3.

  ``"keras"`` is Keras 3 from TensorFlow 2.16 on; TensorFlow 2.15 bundles
  Keras 2 under that name, with tf-keras' API (its ``train_step``, no
  ``keras.tree``). ``"tf_keras"`` is always Keras 2.

  Example:
    >>> is_keras3("tf_keras")
    False
  """
  return package == "keras" and _keras_major() >= 3


@functools.lru_cache(maxsize=None)
def _keras_major() -> int:
  keras: Any = importlib.import_module("keras")
  return int(str(keras.__version__).split(".", 1)[0])


def has_sublayers_api(layer) -> bool:
  """True for an object that :func:`sublayers` can list: a Keras layer."""
  return callable(getattr(layer, "_flatten_layers", None)) or _is_layer(layer)


def _is_layer(obj) -> bool:
  return (callable(obj) and hasattr(obj, "trainable_weights")
          and hasattr(obj, "name"))


def sublayers(layer) -> List[Any]:
  """The direct sublayers of a Keras 3 or tf-keras layer, in order."""
  if usable("flatten_layers", _keras_package(layer)):
    flatten = getattr(layer, "_flatten_layers", None)
    if callable(flatten):
      return list(flatten(include_self=False, recursive=False))
  return layers_in_attributes(layer)


def layers_in_attributes(layer) -> List[Any]:
  """``model.layers``, or else the layers held in ``layer``'s attributes."""
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


def _check_flatten_layers(package: str) -> None:
  keras: Any = importlib.import_module(package)
  base: Any = keras.layers.Layer

  class Pair(base):

    def __init__(self):
      super().__init__()
      self.first = keras.layers.Dense(1)
      self.rest = [keras.layers.Dense(1), keras.layers.Dense(1)]

  pair = Pair()
  got = list(pair._flatten_layers(include_self=False, recursive=False))  # pylint: disable=protected-access
  want = [pair.first, *pair.rest]
  if len(got) != len(want) or any(a is not b for a, b in zip(got, want)):
    raise SelfTestError(f"{package} listed {[l.name for l in got]} for "
                        f"sublayers {[l.name for l in want]}")


PRIVATE_APIS: Dict[str, PrivateApi] = {
    "gradient_lookup": PrivateApi(
        name="tensorflow.python.framework.ops.get_gradient_function",
        symbols=("tensorflow.python.framework.ops",),
        why="graphgrad inspect lists ops without a registered gradient, "
        "and refuses a saved graph whose gradient override names a "
        "registered gradient written for another op; the "
        "TF1 engine replaces the lookup, for one tf.gradients call on one "
        "thread, to give overridden ops the plan's gradient function and to "
        "weight what the ops of a chain of linearly rewritten layers pass "
        "below (graphgrad.plan._backprop.hooked)",
        self_test="in a scratch graph the lookup finds Mul's gradient and "
        "raises LookupError for an unregistered one, and so does "
        "ops.gradient_registry by name; with the replacement "
        "installed, tf.compat.v1.gradients calls it and its tripled input "
        "gradient changes the result from 2x to 4x, and an op with no "
        "registered gradient and a not-differentiable one get the function "
        "it substitutes, while outside the block the first still raises "
        "LookupError",
        fallback="one tf.gradients call per rewritten layer (the same "
        "gradients, one more op per boundary), and taking every op to have "
        "a gradient; a GradientPlan with an overridden op raises "
        "GraphGradError",
        check=_check_gradient_lookup),
    "op_def_registry": PrivateApi(
        name="tensorflow.python.framework.op_def_registry",
        symbols=("tensorflow.python.framework.op_def_registry",),
        why="before a saved graph is imported, graphgrad reads each node's "
        "op signature (its input names, attr types and outputs) to find "
        "allocations sized by Const inputs or shape attrs, and whether a "
        "borrowed gradient fits its op (graphgrad.analysis._graph_limits); "
        "tf.Operation.op_def exists only once the graph is imported",
        self_test="get('Fill') is the op_def of a Fill op built in a "
        "scratch graph, and an unknown op type gives None",
        fallback="no op signatures before import: the checks that need one "
        "are skipped (recursion, call depth, constant sizes and the type of "
        "a gradient override are still checked), and the memory limit of "
        "the process that imports the graph bounds the rest",
        check=_check_op_def_registry),
    "reached_walk": PrivateApi(
        name="tensorflow.python.ops.gradients_util._MarkReachedOps",
        symbols=("tensorflow.python.ops.gradients_util", "_MarkReachedOps"),
        why="each segment call of the TF1 engine bounds TF's forward walk "
        "from its xs to the ops behind its ys "
        "(graphgrad.plan._backprop.behind), which keeps the build linear "
        "in depth",
        self_test="in a scratch graph tf.compat.v1.gradients calls the "
        "replaced walk: bounded to the ops behind y it gives TF's gradient; "
        "bounded to x alone it gives None",
        fallback="TensorFlow's unbounded walk (the same graph, a slower "
        "build)",
        check=_check_reached_walk),
    "control_flow_context": PrivateApi(
        name="tf.Operation._get_control_flow_context",
        symbols=("_get_control_flow_context",),
        why="finding the ops of tf.compat.v1 while loops and conds, which "
        "make one layer and whose gradients TF builds in the loop's context; "
        "and (variant 'xla', tf.Graph's method of the same name) whether "
        "privatize's noise is traced into an enclosing XLA computation, "
        "which would fuse its Philox kernel into the transform and run the "
        "rounds again for every value (18x the draw's time)",
        self_test="in a scratch graph an op outside a v1 while loop has no "
        "context, and an op in its body has the loop's outermost "
        "WhileContext; 'xla': tracing a tf.function(jit_compile=True) the "
        "default graph's contexts are one XLA context, tracing a "
        "tf.function or building a tf.Graph there is none",
        fallback="the contexts of the WHILE_CONTEXT and COND_CONTEXT "
        "collections, matched by name scope (exact for loops, conservative "
        "for conds); 'xla': the noise takes XLA's Philox fused with the "
        "transform everywhere (the same values, twice the draw's time)",
        check=_check_control_flow_context),
    "flatten_layers": PrivateApi(
        name="Keras Layer._flatten_layers",
        symbols=("_flatten_layers",),
        why="the direct sublayers of a Keras 3 or tf-keras layer, in order, "
        "for KerasPlan's layer paths",
        self_test="a layer holding one Dense in an attribute and two in a "
        "list lists exactly those three, in order",
        fallback="model.layers, or the layers held in the layer's attributes",
        check=_check_flatten_layers),
}
