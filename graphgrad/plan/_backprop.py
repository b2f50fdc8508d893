"""The TF1 executor's VJP: how one ``tf.gradients`` call is made, and summed.

:class:`GraphVJP` is the one place where a ``GradientPlan`` differentiates
(``core._vjp.VJP``): segment calls, task VJPs, a replacement's
``context.vjp``, ``privatize``'s calls. Each call takes the plan's options;
in it, this thread's gradient lookup gives an overridden op the plan's
function, and a hooked op (a span's fused VJP, ``_engine``) its function
weighted and read (:func:`hooked`); its reachability walk is bounded to the
ops between ``xs`` and ``ys`` (:func:`behind`), not the whole forward cone
of ``xs``, which made a plan quadratic in depth. Both are private TF
functions (``graphgrad._compat``): where a self-test fails, the engine cuts
at every layer, or keeps TF's walk (the same graph, built more slowly).
Under ``plan.recompute`` a call is split into pieces, each on a copy of its
ops (``_recompute``). :class:`Backprop` sums a pass's contributions.
"""

import collections
import contextlib
import dataclasses
import re
from typing import (
  Callable,
  Dict,
  Iterable,
  List,
  Optional,
  Sequence,
  Set,
  Tuple,
)

import tensorflow as tf

from graphgrad import _compat, _errors
from graphgrad._types import Gradient
from graphgrad.analysis import _graph_util
from graphgrad.core._gradients import aggregate
from graphgrad.plan._recompute import Recompute, Split

__all__ = ["Backprop", "GraphVJP", "Hook", "behind", "can_bound", "hooked",
           "hooks_available"]


class GraphVJP:
  """The VJP of a ``GradientPlan``: every gradient it builds comes from here.

  Args:
    options: keyword arguments of every call's ``tf.gradients`` (the
      plan's ``gate_gradients``, ``aggregation_method`` and
      ``colocate_gradients_with_ops``).
    overrides: op name -> the gradient function substituted for the
      registered one in every call (see :func:`hooked`).
    recompute: ``plan.recompute``'s option: every call recomputes the
      forward ops it crosses, keeping the kept tensors.
    seed: ``target -> the gradient it is backpropagated with`` (``None``
      for ones): the plan's loss is backpropagated with the loss scale
      ``S`` under a loss scale. :meth:`task_vjps` reads it.
  """

  def __init__(self, options: Optional[dict] = None,
               overrides: Optional[Dict[str, Callable]] = None,
               recompute: Optional[Recompute] = None,
               seed: Optional[Callable[[tf.Tensor], Optional[Gradient]]]
               = None):
    self.options = dict(options or {})
    self.overrides = dict(overrides or {})
    self.recompute = recompute
    self._seed = seed or (lambda target: None)

  # -- the VJP protocol (core._vjp) ------------------------------------------

  def vjp(self, ys: Sequence, xs: Sequence,
          grads: Optional[Sequence] = None,
          stop: Sequence = ()) -> List[Gradient]:
    """The gradients of ``ys`` for ``xs`` with ``grads`` at ``ys``.

    ``grads`` entries that are ``None`` send nothing; ``grads=None`` is
    ones at every ``ys`` entry (``tf.gradients``' own seed). Under
    recompute, the call's pieces add up in a :class:`Backprop` of their
    own.
    """
    return Backprop(self).differentiate(ys, grads, xs, stop)

  def task_vjps(self, target: tf.Tensor, losses: Sequence, xs: Sequence
                ) -> List[List[Gradient]]:
    """Per task loss ``l_i``: ``d target / d l_i * d l_i / d xs``.

    One call from ``target`` (with its seed) to the task losses gives the
    weights; then one call per task loss, to ``xs`` only.
    """
    seed = self._seed(target)
    weights = self.vjp([target], list(losses),
                       None if seed is None else [seed])
    return [self.vjp([l], xs, [w]) if w is not None else [None] * len(xs)
            for l, w in zip(losses, weights)]

  def per_example(self, ys: Sequence, xs: Sequence, grads: Sequence,
                  batch) -> List[Gradient]:
    """Per-example gradients of ``xs``, each ``[batch, *x.shape]``.

    One masked call per example, in ``tf.vectorized_map``: ``grads`` with
    every row but row ``i`` zeroed. The plan's overrides apply; the call
    takes none of the plan's options and recomputes nothing (it crosses
    the ops that read a variable, whose inputs the caller reads anyway).
    ``None`` for an ``x`` that no ``ys`` entry reaches.
    """
    ys, xs = list(ys), list(xs)
    grads = [tf.convert_to_tensor(g) for g in grads]
    found: List[int] = []

    def one(i):
      masked = [g * tf.reshape(tf.one_hot(i, batch, dtype=g.dtype),
                               [-1] + [1] * (g.shape.rank - 1))
                for g in grads]
      parts = self.gradients(ys, masked, xs, (), options={})
      found[:] = [j for j, p in enumerate(parts) if p is not None]
      return [tf.convert_to_tensor(parts[j]) for j in found]

    stacked = tf.vectorized_map(one, tf.range(batch))
    out: List[Gradient] = [None] * len(xs)
    for j, s in zip(found, stacked):
      out[j] = s
    return out

  # -- the one call ----------------------------------------------------------

  def gradients(self, ys: List, grad_ys: Optional[List], xs: List,
                stops: Sequence, hooks: Optional[Dict] = None,
                allowed: Optional[Set[tf.Operation]] = None,
                options: Optional[dict] = None) -> List:
    """One ``tf.gradients`` call, with the plan's overrides.

    Args:
      ys, grad_ys, xs: as ``tf.gradients``' (``grad_ys=None``: ones).
      stops: its ``stop_gradients``.
      hooks: op -> what to do around its gradient function (:class:`Hook`).
      allowed: the ops its reachability walk may mark (:func:`behind`), or
        ``None`` for TF's own walk.
      options: its other keyword arguments; ``None`` for the plan's.
    """
    kwargs = self.options if options is None else options
    with hooked(hooks or {}, self.overrides), _compat.bounded_walk(allowed):
      try:
        return tf.compat.v1.gradients(ys, xs, grad_ys=grad_ys,
                                      stop_gradients=list(stops), **kwargs)
      except tf.errors.InvalidArgumentError as e:
        clear = _rewritten_twice(e)
        if clear is None:
          raise
        raise clear from e


def _rewritten_twice(error: tf.errors.InvalidArgumentError
                     ) -> Optional[Exception]:
  """A clear error for TensorFlow's refusal of a second ``_rewritten``.

  The gradient of a functional ``While`` or ``If`` adds the forward
  function again, with more outputs, as ``<its name>_rewritten``, to the
  process-wide function library as well as the graph's. Two imports of one
  saved graph hold functions of the same names, so differentiating both
  in one process (under other name scopes, or other ``xs``) gives two
  different functions of one name, which TensorFlow refuses.
  """
  match = re.search(r"duplicate function with name: (\S+_rewritten)\b",
                    error.message)
  if match is None:
    return None
  name = match.group(1)
  return _errors.UnsupportedGraphError(
      f"differentiating the functional While/If whose function is "
      f"{name[:-len('_rewritten')]!r} adds {name!r} to TensorFlow's "
      f"process-wide function library, which already holds another "
      f"{name!r}: another import of the same saved graph was "
      f"differentiated in this process. Differentiate one import per "
      f"process (e.g. run `graphgrad grads MODEL` in its own process), or "
      f"build every gradient in the graph that was differentiated first.")


# -- the gradient lookup of one call ------------------------------------------
# A chain of layers with linear upstream rewrites needs no cut between them:
# what layer L passes below is c times the plain backpropagation through L, so
# one call covers the chain if each gradient L's ops hand below L is
# multiplied by c. Nothing is registered and no op changes.


@dataclasses.dataclass
class Hook:
  """What to do around one op's gradient function in one call.

  Attributes:
    scale: ``(input index, weigh)`` pairs: ``weigh(grad)`` replaces the
      gradient of that input.
    read: ``(output index, record)`` pairs: ``record(grad)`` receives the
      gradient of that output (``None`` when it has none).
  """
  scale: List[Tuple[int, Callable]] = dataclasses.field(default_factory=list)
  read: List[Tuple[int, Callable]] = dataclasses.field(default_factory=list)


def hooks_available() -> bool:
  """True when ``tf.gradients`` calls a replaced lookup on this TensorFlow.

  This is the self-test of ``_compat.PRIVATE_APIS["gradient_lookup"]``;
  when it fails, one warning is logged and the engine cuts at every layer.
  """
  return _compat.usable("gradient_lookup")


def _wrap(fn: Callable, hook: Hook) -> Callable:
  def hooked_grad(op, *out_grads):
    for i, record in hook.read:
      record(out_grads[i])
    grads = fn(op, *out_grads)
    if not hook.scale:
      return grads
    single = not isinstance(grads, (list, tuple))
    grads = [grads] if single else list(grads)
    for i, weigh in hook.scale:
      grads[i] = weigh(grads[i])
    return grads[0] if single else grads
  return hooked_grad


@contextlib.contextmanager
def hooked(hooks: Dict[tf.Operation, Hook],
           overrides: Optional[Dict[str, Callable]] = None):
  """Within the block, this thread's ``tf.gradients`` substitutes and hooks.

  For an overridden op the lookup returns the plan's function instead of
  the registered one (or of none), so an override acts in every call that
  crosses its op and nothing is cut there; for a hooked op, that function
  followed by the hook's ``scale`` and ``read``.

  Args:
    hooks: op -> what to do around its gradient function.
    overrides: op name -> the gradient function that replaces the
      registered one, ``fn(op, *output_grads) -> input grads``.

  Yields:
    Nothing.

  Raises:
    RuntimeError: if asked for where :func:`hooks_available` is False.
  """
  if not hooks and not overrides:
    yield
    return
  if not hooks_available():
    raise RuntimeError("gradient hooks need ops.get_gradient_function")
  overrides = overrides or {}

  def wrap(op, fn):
    fn = overrides.get(op.name, fn)
    hook = hooks.get(op)
    return fn if hook is None or fn is None else _wrap(fn, hook)

  with _compat.wrapped_gradients(wrap):
    yield


# -- the bounded walk of one call ----------------------------------------------
# tf.gradients(ys, xs) first marks every op reachable forward from xs, then
# keeps those behind ys. The bound hands the walk the ops behind ys created no
# earlier than the oldest op of xs: TF builds the same gradient ops, in the
# same order, with the same names. It rests on creation order being a
# topological order, which a tf.compat.v1 while loop breaks.

_LOOP_OPS = frozenset({"NextIteration", "RefNextIteration"})


def can_bound(forward_ops: Iterable[tf.Operation]) -> bool:
  """True when creation order is a topological order of ``forward_ops``
  and the walk's self-test passed."""
  if not _compat.usable("reached_walk"):
    return False
  for op in forward_ops:
    if op.type in _LOOP_OPS:
      return False
    if any(_graph_util.op_id(t.op) > _graph_util.op_id(op) for t in op.inputs):
      return False
  return True


def behind(ys: Iterable[tf.Tensor], xs: Iterable) -> Set[tf.Operation]:
  """Ops that ``ys`` depend on, created no earlier than the oldest of ``xs``.

  ``xs`` holds tensors or variables (whose op is the variable's own). Within
  ``_compat.bounded_walk(behind(ys, xs))`` a call walks only those.
  """
  floor = min(_graph_util.op_id(x.op) for x in xs)
  return _graph_util.ops_behind([y.op for y in ys], floor)


def _bounded(ys, xs) -> Optional[Set[tf.Operation]]:
  """The walk bound of one call, where the ops behind ``ys`` allow one."""
  ops = _graph_util.ops_behind([y.op for y in ys], -1)
  return behind(ys, xs) if xs and can_bound(ops) else None


class Backprop:
  """Accumulators and calls of one backward pass, through one VJP.

  Args:
    vjp: the plan's VJP.
    variables: variable op name -> differentiated variable.
    bound: whether each call's reachability walk may be bounded.
    reduce: optional ``(variables, grads) -> grads`` applied to the
      parameter gradients of each segment call.
  """

  def __init__(self, vjp: GraphVJP,
               variables: Optional[Dict[str, tf.Variable]] = None,
               bound: bool = False, reduce: Optional[Callable] = None):
    self.vjp = vjp
    self.variables = dict(variables or {})
    self.bound = bound
    self.reduce = reduce
    self.acc: Dict[str, List] = collections.defaultdict(list)
    self.var_grads: Dict[str, List] = collections.defaultdict(list)
    self.edge_grads: Dict[str, Dict[str, List]] = collections.defaultdict(
        lambda: collections.defaultdict(list))
    self.dropped: List[tf.Tensor] = []
    self.dropped_vars: Set[str] = set()

  def total(self, ts: Sequence, store=None) -> List:
    store = self.acc if store is None else store
    return [aggregate(store.get(t.name, ()), like=t) for t in ts]

  def call(self, ys, grad_ys, targets, var_names, stops=None,
           hooks: Optional[Dict[tf.Operation, "Hook"]] = None) -> List:
    """One segment: the VJP from ``ys`` to targets and variables.

    The overridden ops' functions, and ``hooks`` around those of the hooked
    ops, replace the registered ones in this call's gradient lookup.
    """
    xs = list(targets) + [self.variables[n] for n in var_names]
    stops = list(targets) if stops is None else list(stops)
    return self.differentiate(ys, grad_ys, xs, stops, hooks)

  def differentiate(self, ys: Sequence, grads: Optional[Sequence],
                    xs: Sequence, stops: Sequence = (),
                    hooks: Optional[Dict] = None) -> List:
    """One call of the VJP: one gradient (or ``None``) per ``xs`` entry.

    ``ys`` whose ``grads`` entry is ``None`` are left out; ``grads=None``
    is ones at every ``ys`` entry. Under recompute the call is split at
    the kept tensors, and its pieces deposit here (:meth:`_recomputed`).
    """
    ys, xs = list(ys), list(xs)
    if grads is not None:
      pairs = [(y, g) for y, g in zip(ys, grads) if g is not None]
      ys, grads = [y for y, _ in pairs], [g for _, g in pairs]
    if not ys or not xs:
      return [None] * len(xs)
    recompute = self.vjp.recompute
    if recompute is None:
      allowed = behind(ys, xs) if self.bound else None
      return self.vjp.gradients(ys, grads, xs, stops, hooks, allowed)
    if grads is None:
      grads = [tf.ones_like(y) for y in ys]
    return self._recomputed(Split(recompute, ys, xs, stops), list(grads),
                            hooks)

  def _recomputed(self, split: Split, grads: List,
                  hooks: Optional[Dict]) -> List:
    """The pieces of one call, from the top down, each with the sum of
    what the pieces above deposited at its outputs; then one call from the
    ``ys`` that no piece computes. The call's own contributions are kept
    apart from the pass's (another call may cross the same tensors with
    another gradient), under their tensors' names as ever."""
    store: Dict[str, List] = collections.defaultdict(list)
    for y, g in zip(split.ys, grads):
      self.add(y, g, store)
    exact: Dict[int, Gradient] = {}
    for piece in split.pieces():
      outs = [(t, g) for t, g in zip(piece.outputs,
                                     self.total(piece.outputs, store))
              if g is not None]
      if not outs:
        continue
      gs = [g for _, g in outs]
      ys, xs, stops = split.call(piece, [t for t, _ in outs], gs)
      res = self.vjp.gradients(ys, gs, xs, stops, hooks, _bounded(ys, xs))
      below = piece.boundary + [split.xs[i] for i in piece.external]
      for t, g in zip(below, res):
        self.add(t, g, store)
      k = len(below)
      exact.update(zip(piece.inner, res[k:k + len(piece.inner)]))
      for i, g in zip(piece.variables, res[k + len(piece.inner):]):
        self.add(split.xs[i], g, store)
    if split.leftover:
      ys = [split.ys[i] for i in split.leftover]
      res = self.vjp.gradients(ys, [grads[i] for i in split.leftover],
                               split.xs, split.stops, hooks,
                               _bounded(ys, split.xs))
      for x, g in zip(split.xs, res):
        self.add(x, g, store)
    return [exact[i] if i in exact else self.total([x], store)[0]
            for i, x in enumerate(split.xs)]

  def add(self, t, grad, store=None) -> None:
    if grad is not None:
      (self.acc if store is None else store)[t.name].append(grad)

  def deposit(self, targets, var_names, results, store=None):
    """Adds one call's results, the parameter gradients reduced."""
    n = len(targets)
    for t, g in zip(targets, results[:n]):
      self.add(t, g, store)
    found = [(name, g) for name, g in zip(var_names, results[n:])
             if g is not None]
    if self.reduce is not None and found:
      names = [name for name, _ in found]
      found = list(zip(names, self.reduce([self.variables[m] for m in names],
                                          [g for _, g in found])))
    for name, g in found:
      self.var_grads[name].append(g)

  def drop(self, targets: Sequence[tf.Tensor],
           var_names: Sequence[str] = ()) -> None:
    """Records gradients a zero factor removed; nothing is built for them."""
    self.dropped += list(targets)
    self.dropped_vars |= set(var_names)

  def fill_zeros(self, below: Callable[[Sequence[tf.Tensor]], Set[str]]):
    """Zero gradients for variables reached only through dropped gradients.

    Backpropagating a zero cotangent gives zeros, not ``None``: optimizers
    with momentum or decay still step such a variable.
    """
    if not (self.dropped or self.dropped_vars):
      return
    empty = [n for n in self.variables if not self.var_grads.get(n)]
    if not empty:
      return
    reached = below(self.dropped) if self.dropped else set()
    for name in empty:
      if name in self.dropped_vars or name in reached:
        v = self.variables[name]
        self.var_grads[name].append(
            tf.zeros(v.shape, v.dtype.base_dtype) if v.shape.is_fully_defined()
            else tf.zeros_like(v))
