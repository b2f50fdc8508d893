"""The gradient-flow report of a Keras model, run in a ``tf.function``.

:func:`gradient_report` measures the figures of ``core._report_figures``
for every layer that holds variables of its own (nested layers each get a
row), in the model's layer order. One traced step per batch shape takes the
plain gradients under a ``tf.GradientTape``, reading each call's outputs of
those layers; with a :class:`~graphgrad.KerasPlan` it takes the plan's step
as well, whose parameter gradients and trace (the gradient after each
upstream rewrite) are the ``after`` figures. For the flags, one layer
feeds another when an output of the one reaches an input of the other
through ops of no such layer, in the traced graph. Variables a step
updates (batch-norm statistics, a method's state) get their values back.
"""

import collections
import contextlib
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import tensorflow as tf

from graphgrad import _errors
from graphgrad.core._gradients import is_float
from graphgrad.core._report_figures import (
  GradientReport,
  check_counts,
  flag,
  layer_row,
)
from graphgrad.keras._layer_index import (
  CallPatches,
  LayerIndex,
  direct_variables,
  tf_variable,
)
from graphgrad.keras._tape_vjp import TapeVJP


def gradient_report(model, loss: Callable, feed: Any = None, plan=None,
                    batches: int = 1, threshold: float = 2.0
                    ) -> GradientReport:
  """The report of ``loss`` (a callable that runs ``model``); see
  ``gg.gradient_report``."""
  _check_args(model, loss, plan)
  check_counts(batches, threshold)
  items = _batches(feed, batches)
  index = LayerIndex(model)
  rows = [p for p in index.paths if _own(index[p])]
  if not rows:
    raise _errors.GraphGradError(
        f"gradient_report: the model {model.name} has no layer with "
        f"trainable variables, so there is nothing to measure. Build the "
        f"model (call it once) before the report.")
  step = _Step(index, rows, loss, plan)
  with _restored(model, plan):
    runs = [step(item) for item in items]
  layers = [layer_row(p, sum(int(v.shape.num_elements() or 0)
                             for v in _own(index[p])),
                      [r[p] for r in runs]) for p in rows]
  feeds = step.feeds
  flag(layers, lambda p: feeds.get(p, set()), threshold)
  return GradientReport(_loss_name(loss), layers, batches, threshold,
                        plan is not None)


@contextlib.contextmanager
def _restored(model, plan):
  """Puts back the values of the variables a step may update: the model's
  non-trainable ones (batch-norm statistics, with ``training=True``) and
  the plan's method state."""
  state = [tf_variable(v) for v in model.non_trainable_weights]
  if plan is not None:
    state += list(plan.method_variables.variables)
  saved = [(v, tf.identity(v)) for v in state if v is not None]
  try:
    yield
  finally:
    for v, value in saved:
      v.assign(value)


def _own(layer) -> List[tf.Variable]:
  """The trainable variables ``layer`` holds directly."""
  trainable = {u.ref() for u in map(tf_variable, layer.trainable_weights)
               if u is not None}
  return [v for v in direct_variables(layer) if v.ref() in trainable]


def _loss_name(loss: Callable) -> str:
  return getattr(loss, "__name__", type(loss).__name__)


def _check_args(model, loss, plan) -> None:
  if not callable(loss):
    raise _errors.GraphGradError(
        f"gradient_report: for a Keras model the second argument must be "
        f"the loss, a callable that runs the model on a batch and returns a "
        f"scalar (loss(x, y) for a feed of (x, y) batches); got "
        f"{type(loss).__name__}.")
  if plan is not None and getattr(plan, "model", None) is not model:
    raise _errors.GraphGradError(
        f"gradient_report: `plan` must be a gg.KerasPlan on the model "
        f"{model.name}; got {plan!r}. Pass gg.KerasPlan(model) with your "
        f"declarations, or None.")
  if not getattr(model, "built", True):
    raise _errors.GraphGradError(
        f"gradient_report: the model {model.name} has no weights yet. Build "
        f"it (call it once on a batch) before the report.")


def _batches(feed, batches: int) -> List[Tuple]:
  """Per batch, the arguments of ``loss``: a tuple batch is unpacked, any
  other item passed alone, ``None`` passes none."""
  if callable(feed) and not tf.is_tensor(feed):
    items = [feed(i) for i in range(batches)]
  elif isinstance(feed, list):
    if len(feed) != batches:
      raise _errors.GraphGradError(
          f"gradient_report: a list `feed` must hold `batches`={batches} "
          f"batches; got {len(feed)}. Pass batches={len(feed)}, or one batch "
          f"(a tuple such as (x, y)) for every batch.")
    items = list(feed)
  else:
    items = [feed] * batches
  return [() if b is None else (tuple(b) if isinstance(b, tuple) else (b,))
          for b in items]


class _Calls:
  """While open, records the inputs and outputs of every call of the
  ``rows`` layers (their ``call`` patched on the instance)."""

  def __init__(self, index: LayerIndex, rows: List[str]):
    self.index, self.rows = index, rows
    self.inputs: Dict[str, List[tf.Tensor]] = collections.defaultdict(list)
    self.outputs: Dict[str, List[tf.Tensor]] = collections.defaultdict(list)
    self._patches = CallPatches()

  def __enter__(self):
    for path in self.rows:
      layer = self.index[path]
      self._patches.replace(layer, self._recording(path, layer.call))
    return self

  def __exit__(self, *exc):
    self._patches.restore()

  def _recording(self, path: str, call):
    def recorded(*args, **kwargs):
      self.inputs[path] += [t for t in tf.nest.flatten((args, kwargs))
                            if is_float(t)]
      out = call(*args, **kwargs)
      self.outputs[path] += [t for t in tf.nest.flatten(out) if is_float(t)]
      return out
    return recorded


class _Step:
  """The traced measuring step of one report (one trace per batch shape)."""

  def __init__(self, index: LayerIndex, rows: List[str], loss: Callable,
               plan):
    self.index, self.rows, self.loss, self.plan = index, rows, loss, plan
    self.feeds: Dict[str, Set[str]] = {}
    self._fn = tf.function(self._measure)

  def __call__(self, args: Tuple) -> Dict[str, Dict[str, Any]]:
    return self._fn(*args)

  def _measure(self, *args):
    index, rows = self.index, self.rows
    variables = {p: _own(index[p]) for p in rows}
    with _Calls(index, rows) as calls, tf.GradientTape() as tape:
      value = _total(self.loss(*args))
    outs = {p: calls.outputs[p] for p in rows}
    flat_v = [v for p in rows for v in variables[p]]
    flat_o = [t for p in rows for t in outs[p]]
    grads = TapeVJP.outer(tape).backprop(value, flat_v + flat_o)
    by_var = dict(zip([v.ref() for v in flat_v], grads[:len(flat_v)]))
    by_out = grads[len(flat_v):]
    self.feeds = _feeds(rows, calls)
    after: Optional[Tuple[Dict, Dict]] = None
    if self.plan is not None:
      after = self._planned(args)
    none = tf.zeros([0])
    out, start = {}, 0
    for p in rows:
      n = len(outs[p])
      entry = {"weights": [v.read_value() for v in variables[p]],
               "grads": [_or(by_var[v.ref()], none) for v in variables[p]],
               "upstream": [_or(g, none) for g in by_out[start:start + n]]}
      start += n
      if after is not None:
        grads_after, upstream_after = after
        entry["grads_after"] = [_or(grads_after.get(v.ref()), none)
                                for v in variables[p]]
        entry["upstream_after"] = [_or(g, none)
                                   for g in upstream_after.get(p, [])]
      out[p] = entry
    return out

  def _planned(self, args) -> Tuple[Dict, Dict]:
    """The plan's step: variable -> its gradient; layer -> the gradients
    its upstream rewrite sends below (unscaled)."""
    with self.plan.tape() as tape:
      value = self.loss(*args)
      total = _total(value)
    tasks = self.plan.rules.has_tasks
    if tasks and not isinstance(value, (list, tuple)):
      raise _errors.GraphGradError(
          "gradient_report: the plan combines task gradients, whose task "
          "losses only the loss function knows. Return them from `loss` as "
          "a list, [loss_a, loss_b]: the report's loss is their sum.")
    tape.grads_and_vars(total, task_losses=list(value) if tasks else None)
    step = tape.last_step
    grads = {v.ref(): g for g, v in step.pairs}
    upstream: Dict[str, list] = collections.defaultdict(list)
    for record in step.trace:
      ctx = record.context
      if ctx.role == "upstream" and record.after is not None:
        upstream[ctx.layer].append(record.after)
    return grads, upstream


def _total(value):
  """The loss: ``value``, or the sum of a list of task losses."""
  return tf.add_n(list(value)) if isinstance(value, (list, tuple)) else value


def _or(g, none):
  return none if g is None else g


def _feeds(rows: List[str], calls: _Calls) -> Dict[str, Set[str]]:
  """Row -> the rows whose inputs its outputs reach through ops of no row
  (in the traced graph)."""
  made_by = {}
  for p in rows:
    for t in calls.outputs[p]:
      made_by[t.ref()] = p
  memo: Dict[Any, Set[str]] = {}

  def sources(t) -> Set[str]:
    todo, found, seen = [t], set(), set()
    while todo:
      u = todo.pop()
      if u.ref() in seen:
        continue
      seen.add(u.ref())
      if u.ref() in made_by:
        found.add(made_by[u.ref()])
      elif u.ref() in memo:
        found |= memo[u.ref()]
      else:
        todo += list(u.op.inputs)
    memo[t.ref()] = found
    return found

  feeds: Dict[str, Set[str]] = {p: set() for p in rows}
  for p in rows:
    for x in calls.inputs[p]:
      if not tf.is_symbolic_tensor(x):
        continue
      for q in sources(x) - {p}:
        feeds[q].add(p)
  return feeds
