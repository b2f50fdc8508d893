"""Layer interception: what a plan tape does while the forward pass runs.

While the tape is open, the ``call`` of every layer the plan names is
replaced, on that layer instance only, by a wrapper that counts its calls:

* a layer whose one rule is ``c * dy`` and whose call reads only its own
  variables runs as it is on inputs whose gradient is weighted by ``c``
  (:func:`scaled_input`); an identity on each output hands the gradient
  there to core's step (:func:`observed`): a fused VJP;
* any other rewritten layer runs inside ``tf.custom_gradient`` under an
  inner tape, whose gradient hands ``dy`` to ``_tape_backward``;
* the lower layer of an edge starts a *glue tape* on its outputs, which
  records only variable-free ops after it (``_tape_backward.edge_grads``);
* under ``plan.recompute``, top-level calls are replayed
  (``_tape_recompute``), a rewritten one on the replay's VJP.
"""

import collections
import contextlib
import logging
import weakref
from typing import Callable, Dict, List, Optional

import tensorflow as tf

from graphgrad.core._gradients import is_float, is_zero, weigh
from graphgrad.core._layer_step import BackwardPass, FusedSite
from graphgrad.core._rules import Mode
from graphgrad.keras import _tape_recompute
from graphgrad.keras._layer_index import (
  CallPatches,
  float_inputs,
  holds_variables,
  tf_variable,
)
from graphgrad.keras._tape_backward import backward_of_call, edge_grads
from graphgrad.keras._tape_vjp import TapeVJP

log = logging.getLogger("graphgrad")


# layer -> whether its call reads only the layer's own variables.
_READS_OWN: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def reads_only_own(layer, call: Callable, args, kwargs, own) -> bool:
  """Whether ``call(*args, **kwargs)`` reads no variable but ``own``.

  Traced once per layer, the first time it is asked, in a graph of its own
  (``tf.function(call).get_concrete_function``): no op runs, and the graph
  being built is untouched, but Python side effects in ``call`` happen once
  more. The answer is kept per layer object: a layer that starts reading
  another layer's variable after that is not traced again. A call that
  cannot be traced alone counts as reading others, so the layer takes the
  general path.
  """
  known = _READS_OWN.get(layer)
  if known is None:
    mine = {v.ref() for v in own}
    try:
      traced = tf.function(call).get_concrete_function(*args, **kwargs)
      known = all(v.ref() in mine for v in traced.variables)
    except Exception as e:  # pylint: disable=broad-except
      log.debug("graphgrad: %s cannot be traced alone (%s); it takes the "
                "general path", getattr(layer, "name", layer), e)
      known = False
    _READS_OWN[layer] = known
  return known


def scaled_input(t: tf.Tensor, factor, plain: Callable[[], bool]):
  """``t``, whose gradient is ``factor`` times what reaches it.

  ``plain()`` is read when the gradient is built: while a plan computes
  task gradients (plain backpropagation) the identity passes them as they
  are. A factor of 0 sends nothing below.
  """
  @tf.custom_gradient
  def scaled(x):
    def grad(dy):
      if plain():
        return dy
      return None if is_zero(factor) else weigh(dy, factor)
    return tf.identity(x), grad
  return scaled(t)


def observed(t: tf.Tensor, record: Callable) -> tf.Tensor:
  """``t`` through an identity whose gradient is what reaches it, handed
  to ``record(t, dy)`` on the way (a Keras mask stays on the output)."""
  @tf.custom_gradient
  def seen(x):
    def grad(dy):
      record(t, dy)
      return dy
    return tf.identity(x), grad
  out = seen(t)
  mask = getattr(t, "_keras_mask", None)
  if mask is not None:
    try:
      out._keras_mask = mask  # pylint: disable=protected-access
    except AttributeError:
      pass
  return out


class BackwardStep(BackwardPass):
  """One backward pass under a plan tape: core's pass
  (``core._layer_step.BackwardPass``), with what the tape reads of it.

  The tape makes one per ``tape.gradient`` call (and one, ``plain``, for
  the task gradients before it) and reads its results afterwards.

  Attributes:
    task_deltas: layer -> per call, per output ``combine(g_i) - sum_i g_i``.
    edges_run: edges whose upper layer was backpropagated.
    edges_fed: edges along which a gradient reached the lower layer.
    pairs: the final ``(gradient, variable)`` pairs, once the step is done.
    raw: the pairs before the parameter transforms (this replica's).
    finished: the step's gradient was taken.
  """

  def __init__(self, global_step=None, resources=None, scale=None,
               plain: bool = False, labels=None,
               task_deltas: Optional[Dict[str, List[list]]] = None):
    super().__init__(global_step, resources, scale=scale, plain=plain,
                     labels=labels)
    self.task_deltas = dict(task_deltas or {})
    self.edges_run: set = set()
    self.edges_fed: set = set()
    self.pairs: List[tuple] = []
    self.raw: List[tuple] = []
    self.finished = False

  def finish(self, sources: list, raw: list, grads: list) -> None:
    """Keeps the step's final ``(gradient, variable)`` pairs (sources that
    are no variable left out) and those before the parameter transforms
    (``raw``); both carry the pass's loss scale."""
    variables = [tf_variable(s) for s in sources]
    self.pairs = [(g, v) for v, g in zip(variables, grads) if v is not None]
    self.raw = [(g, v) for v, g in zip(variables, raw) if v is not None]
    self.finished = True


class Interceptor:
  """What a plan tape does to the forward pass, and the backward steps."""

  def __init__(self, plan, labels=None):
    self.plan = plan
    self.labels = labels
    rules = plan.rules
    self.edges = dict(rules.edges)
    # Layers whose backward pass is their own.
    self.custom = {p for p, r in rules.layers.items() if r.cut}
    # Layers whose one rule is a linear upstream rewrite: they may run
    # uninterrupted on inputs scaled in the backward pass (scaled_input).
    self.light = {p: r.factor for p, r in rules.layers.items()
                  if r.mode is Mode.LINEAR and not r.special}
    self.calls: collections.Counter = collections.Counter()
    self.outputs: Dict[str, List[list]] = collections.defaultdict(list)
    # The backward pass under way: custom gradients run inside TF's own
    # backward pass, which cannot hand them an argument.
    self._step = self.step()
    self._patches = CallPatches()
    self._glue: List[tf.GradientTape] = []
    self._lower_outputs: Dict[str, List[tuple]] = collections.defaultdict(list)
    self._pause_depth = 0
    self._paused: Optional[contextlib.ExitStack] = None
    self._no_pause: set = set()
    self.recomputed = self._recomputed_layers()
    self._recomputer = (None if rules.recompute is None else
                        _tape_recompute.Recomputer(rules.recompute.keep,
                                                   plan.name))

  @property
  def kept(self) -> Optional[List]:
    """Under ``plan.recompute``, the tensors the step keeps (see
    ``Recomputer.kept``); else ``None``."""
    return None if self._recomputer is None else self._recomputer.kept

  def step(self, plain: bool = False,
           task_deltas: Optional[Dict[str, List[list]]] = None,
           scale=None) -> BackwardStep:
    """A new backward pass of this tape, under the loss scale ``scale``."""
    return BackwardStep(self.plan.step_tensor(), self.plan.resources,
                        scale=scale, plain=plain,
                        labels=self.labels, task_deltas=task_deltas)

  @contextlib.contextmanager
  def backward(self, step: BackwardStep):
    """Runs the backward passes built inside the block with ``step``."""
    before, self._step = self._step, step
    try:
      yield step
    finally:
      self._step = before

  def _recomputed_layers(self) -> List[str]:
    """Top-level layers recomputed under ``plan.recompute``: those that
    hold no layer the plan rewrites or reads, and are either named by no
    declaration or rewritten themselves (not an edge's end)."""
    if self.plan.rules.recompute is None:
      return []
    ends = {p for k in self.edges for p in k}
    named = list(self.plan.rules.named) + list(ends)
    return [p for p in self.plan.layer_names if "/" not in p
            and not any(t.startswith(p + "/") for t in named)
            and (p not in named or (p in self.custom and p not in ends))]

  # -- patching ------------------------------------------------------------

  def patch(self) -> None:
    plan = self.plan
    paths = list(dict.fromkeys([*plan.rules.named, *self.recomputed]))
    if self.edges:
      # Every layer may have to pause glue tapes; ancestors of an edge's
      # ends must not, or the edge's own glue would be hidden.
      paths = list(dict.fromkeys(paths + list(plan.layer_names)))
      for lo, up in self.edges:
        for end in (lo, up):
          parts = end.split("/")
          self._no_pause |= {"/".join(parts[:k]) for k in range(1, len(parts))}
    for path in paths:
      layer = plan.layer(path)
      self._patches.replace(layer, self._wrapper(path, layer, layer.call))
    log.debug("graphgrad KerasPlan tape: intercepting %d layers of %s",
              len(paths), plan.model.name)

  def close(self) -> None:
    self._patches.restore()
    for glue in self._glue:
      glue.__exit__(None, None, None)

  def release(self) -> None:
    """Drops what the forward pass recorded for the backward pass (the
    glue tapes, the task layers' outputs), once it is done."""
    self._glue, self._lower_outputs = [], collections.defaultdict(list)
    self.outputs = collections.defaultdict(list)

  def _wrapper(self, path: str, layer, call):
    custom = path in self.custom
    lower = any(lo == path for lo, _ in self.edges)
    recomputed = path in self.recomputed

    def wrapped_call(*args, **kwargs):
      self.calls[path] += 1
      pause = (bool(self.edges) and path not in self._no_pause
               and holds_variables(layer))
      with self._pausing(pause):
        light = path in self.light and reads_only_own(
            layer, call, args, kwargs, self.plan.own_variables(path))
        if light:
          args, kwargs = self._scaled_inputs(path, args, kwargs)
        if custom and not light:
          out = self._custom_call(path, layer, call, args, kwargs)
        elif recomputed:
          out = self._recomputer.call(path, layer, call, args, kwargs)
        else:
          out = call(*args, **kwargs)
        if light:
          out = self._observed(path, out)
      if custom:
        self.outputs[path].append(tf.nest.flatten(out))
      if lower:
        self._start_glue(path, out)
      return out

    return wrapped_call

  @contextlib.contextmanager
  def _pausing(self, pause: bool):
    if not pause:
      yield
      return
    if self._pause_depth == 0:
      self._paused = contextlib.ExitStack()
      for glue in self._glue:
        self._paused.enter_context(glue.stop_recording())
    self._pause_depth += 1
    try:
      yield
    finally:
      self._pause_depth -= 1
      if self._pause_depth == 0:
        paused, self._paused = self._paused, None
        if paused is not None:
          paused.close()

  def _start_glue(self, path: str, out) -> None:
    outs = [t for t in tf.nest.flatten(out) if is_float(t)]
    glue = tf.GradientTape(persistent=True, watch_accessed_variables=False)
    glue.__enter__()
    glue.watch(outs)
    if self._paused is not None:
      self._paused.enter_context(glue.stop_recording())
    self._glue.append(glue)
    self._lower_outputs[path].append((outs, TapeVJP.outer(glue)))

  def _scaled_inputs(self, path: str, args, kwargs):
    """``(args, kwargs)`` whose gradient the factor weights: the layer runs
    as it is (or recomputed) on them."""
    factor = self.light[path]
    flat = [scaled_input(a, factor, lambda: self._step.plain)
            if is_float(a) else a for a in tf.nest.flatten((args, kwargs))]
    return tf.nest.pack_sequence_as((args, kwargs), flat)

  def _observed(self, path: str, out):
    """``out``, at whose tensors the layer takes core's step with a fused
    VJP (``core._layer_step.FusedSite``): the scaled inputs weight what it
    sends below, and the step records the gradient at its outputs, which
    an uncut layer never forms otherwise."""
    rule = self.plan.rules.rule(path)

    def record(t, dy):
      self._step.layer_backward(rule, FusedSite([t]), [dy])

    flat = [observed(t, record) if is_float(t) else t
            for t in tf.nest.flatten(out)]
    return tf.nest.pack_sequence_as(out, flat)

  def _custom_call(self, path: str, layer, call, args, kwargs):
    index = len(self.outputs[path])
    if path in self.recomputed and self._recomputer.takes(args, kwargs):
      # Recomputed: its backward pass runs on the VJP the recomputer hands
      # it (a recomputed layer is no edge's end).
      def backward(vjp, outs, dys, variables):
        step = self._step
        with tf.name_scope(self.plan.name):
          return backward_of_call(self, step, path, index, vjp, outs,
                                  list(dys), list(variables))

      return self._recomputer.call(path, layer, call, args, kwargs, backward)
    xs, run = float_inputs(call, args, kwargs)
    entries = [(rule, outs, glue)
               for (lo, up), rule in self.edges.items() if up == path
               for outs, glue in self._lower_outputs.get(lo, ())]
    extra = [t for _, outs, _ in entries for t in outs]
    n = len(xs)

    @tf.custom_gradient
    def layer_op(*inputs):
      inner, out = TapeVJP.record(run, list(inputs[:n]))

      def grad(*dys, variables=None):
        step = self._step
        with tf.name_scope(self.plan.name):
          dx, dv = backward_of_call(self, step, path, index, inner, out,
                                    list(dys), list(variables or []))
          if not step.plain:
            step.edges_run.update(k for k in self.edges if k[1] == path)
          return dx + edge_grads(step, entries, xs, dx), dv

      return out, grad

    return layer_op(*(xs + extra))
