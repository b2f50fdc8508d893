"""The accumulators of a segmented backward pass, and its segment calls.

:class:`Backprop` holds, while the engine builds, the gradient contributions
gathered at every cut tensor and every variable, makes each segment's
``tf.gradients`` call, and weights what a linear rewrite scales.
"""

import collections
from typing import Callable, Dict, List, Optional, Sequence, Set

import tensorflow as tf

from graphgrad.core._gradients import aggregate, weigh
from graphgrad.plan import _hooks, _reach


class Backprop:
  """Accumulators and segment calls of one build of the backward pass.

  Args:
    variables: variable op name -> differentiated variable.
    options: keyword arguments for ``tf.gradients``.
    bound: whether each call's reachability walk may be bounded.
    reduce: optional ``(var_names, grads) -> grads`` applied to the
      parameter gradients of each segment call.
    gradients_fn: what each segment calls instead of ``tf.gradients``,
      with the same arguments.
    overrides: op name -> the gradient function substituted for the
      registered one in every segment call (see ``_hooks``).
  """

  def __init__(self, variables: Dict[str, tf.Variable], options: dict,
               bound: bool, reduce: Optional[Callable] = None,
               gradients_fn: Optional[Callable] = None,
               overrides: Optional[Dict[str, Callable]] = None):
    self.gradients_fn = gradients_fn or tf.compat.v1.gradients
    self.overrides = dict(overrides or {})
    self.variables = variables
    self.options = options
    self.bound = bound
    self.reduce = reduce
    self.acc: Dict[str, List] = collections.defaultdict(list)
    self.var_grads: Dict[str, List] = collections.defaultdict(list)
    self.edge_grads: Dict[str, Dict[str, List]] = collections.defaultdict(
        lambda: collections.defaultdict(list))
    self.dropped: List[tf.Tensor] = []
    self.dropped_vars: Set[str] = set()
    self._consts: Dict = {}

  def total(self, ts: Sequence[tf.Tensor], store=None) -> List:
    store = self.acc if store is None else store
    return [aggregate(store.get(t.name, ()), like=t) for t in ts]

  def call(self, ys, grad_ys, targets, var_names, stops=None,
           hooks: Optional[Dict[tf.Operation, _hooks.Hook]] = None) -> List:
    """One segment: ``gradients_fn`` from ``ys`` to targets and variables.

    The overridden ops' functions, and ``hooks`` around those of the hooked
    ops, replace the registered ones in this call's gradient lookup.
    """
    pairs = [(y, gy) for y, gy in zip(ys, grad_ys) if gy is not None]
    xs = list(targets) + [self.variables[n] for n in var_names]
    if not pairs or not xs:
      return [None] * len(xs)
    stops = list(targets) if stops is None else list(stops)
    ys = [y for y, _ in pairs]
    allowed = _reach.behind(ys, xs) if self.bound else None
    with _hooks.hooked(hooks or {}, self.overrides), _reach.bounded(allowed):
      return self.gradients_fn(ys, xs, grad_ys=[gy for _, gy in pairs],
                               stop_gradients=stops, **self.options)

  def weigh(self, grad, factor: Optional[float]):
    """``factor * grad``, sparse kept sparse; no op for a factor of 1."""
    return weigh(grad, factor, self._constant)

  def _constant(self, factor, dtype) -> tf.Tensor:
    # One constant per factor and dtype, shared by every weighted gradient.
    if (factor, dtype) not in self._consts:
      self._consts[factor, dtype] = tf.constant(factor, dtype)
    return self._consts[factor, dtype]

  def add(self, t: tf.Tensor, grad, store=None) -> None:
    if grad is not None:
      (self.acc if store is None else store)[t.name].append(grad)

  def deposit(self, targets, var_names, results, store=None,
              factor: Optional[float] = None, plain: Sequence[str] = ()):
    """Adds one call's results; all but the ``plain`` variables weighted."""
    n = len(targets)
    for t, g in zip(targets, results[:n]):
      self.add(t, self.weigh(g, factor), store)
    unweighted = set(plain)
    found = [(name, g if name in unweighted else self.weigh(g, factor))
             for name, g in zip(var_names, results[n:]) if g is not None]
    if self.reduce is not None and found:
      found = list(zip([name for name, _ in found],
                       self.reduce([name for name, _ in found],
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
