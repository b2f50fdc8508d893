"""Recompute on the plan tape: layer calls replayed in the backward pass.

Under ``KerasPlan.recompute``, each call of a recomputed layer runs inside
``tf.custom_gradient``, whose gradient does not read the call's activations:
the first gradient to reach a *block* (the calls between two kept outputs)
replays the block's calls (``TapeVJP.replay``), and each call takes its VJP
from that replay (a rewritten call runs its declarations on it). In a traced
step the activations inside a block are freed after the forward pass.

A replayed call sees the non-trainable variables (batch-norm statistics,
Keras 3 seed generators) as its forward call saw them, and the values the
forward left are restored after it: state is updated once, a dropout mask is
not redrawn. A call whose forward ran another stateful op (tf-keras'
``Dropout``'s random op) keeps its activations, as every call does eagerly.
Which calls are kept and which ops may run again: ``core._recompute_policy``.
"""

import dataclasses
import logging
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import tensorflow as tf

from graphgrad import _errors
from graphgrad.core import _recompute_policy
from graphgrad.core._gradients import is_float
from graphgrad.keras._layer_index import float_inputs, tf_variable
from graphgrad.keras._tape_vjp import TapeVJP

log = logging.getLogger("graphgrad")

@dataclasses.dataclass
class _LayerCall:
  """One call of a recomputed layer in the forward pass."""
  path: str
  xs: list
  run: Callable  # the call, as a function of ``xs``
  outs: list = dataclasses.field(default_factory=list)
  state: List[tf.Variable] = dataclasses.field(default_factory=list)
  snapshot: list = dataclasses.field(default_factory=list)
  inner: Optional[TapeVJP] = None  # the forward call's layer VJP
  inner_outs: list = dataclasses.field(default_factory=list)
  whole: bool = False  # keeps its activations: its VJP is ``inner``
  block: int = -1
  # A rewritten call's backward pass, given its VJP (see Recomputer.call).
  backward: Optional[Callable] = None


def choose_kept(calls: Sequence[_LayerCall]) -> Set[int]:
  """Indices of the calls whose outputs are kept, for ``keep=None``.

  A call may end a block only when nothing computed before it is read after
  it except its own outputs (no skip connection jumps over it: core's
  ``articulations``). Among those calls, blocks are closed every
  ``total / sqrt(n)`` bytes of the calls' outputs, ``n`` the number of
  calls (core's ``spread_kept``): about ``sqrt(n)`` blocks.

  Args:
    calls: the step's recomputed calls, in forward order.

  Returns:
    The indices of the calls that end a block.
  """
  producer: Dict[Any, int] = {}
  for i, c in enumerate(calls):
    for t in c.outs:
      producer[t.ref()] = i
  # last[i]: the last call that reads an output of call i
  last = list(range(len(calls)))
  for j, c in enumerate(calls):
    for x in c.xs:
      k = producer.get(x.ref())
      if k is not None:
        last[k] = max(last[k], j)
  sizes = [sum(_recompute_policy.tensor_bytes(t) for t in c.outs)
           for c in calls]
  return set(_recompute_policy.spread_kept(
      sizes, _recompute_policy.articulations(last), len(calls)))


def read_keep(model, layers: Dict[str, Any], item) -> Tuple[str, Any]:
  """Reads one item of ``KerasPlan.recompute(keep=...)``.

  A symbolic Keras tensor (``layer.output`` of a functional model) stands
  for the top-level layer whose call made it (a shared layer's first call:
  every call of the layer, as its name does); anything else but a tensor
  is a layer reference.

  Args:
    model: the plan's model (for messages).
    layers: its top-level layers, by path.
    item: the item.

  Returns:
    ``("layer", ref)``: the layer reference the item is or stands for.

  Raises:
    GraphGradError: for a tensor name, a ``tf.Tensor`` (eager or of a
      traced step) or a Keras tensor that no top-level layer's call made.
  """
  tops = ", ".join(layers)
  kind = _recompute_policy.keep_item_kind(item)
  if kind == "tensor name":
    raise _errors.GraphGradError(
          f"recompute: `keep` got the tensor name {item!r}, but a KerasPlan "
          f"keeps layer calls, whose tensors have new names in each traced "
          f"step. Pass the layer's name or, for a functional model, its "
          f"symbolic output (layer.output); top-level layers: {tops}.")
  if kind in ("eager tensor", "graph tensor"):
    what = ("an eager tensor" if kind == "eager tensor"
            else f"the tf.Tensor {item.name} of a tf.Graph or traced step")
    raise _errors.GraphGradError(
        f"recompute: `keep` got {what}, which names no call of "
        f"{model.name}. Pass the layer's name or, for a functional model, "
        f"its symbolic output (layer.output); top-level layers: {tops}.")
  if kind != "symbolic":
    return "layer", item  # a name or a layer
  for path, layer in layers.items():
    if type(layer).__name__ == "InputLayer":
      continue  # its output is the model's input: no call makes it
    try:
      outs = tf.nest.flatten(layer.output)
    except (AttributeError, ValueError, RuntimeError):
      continue  # not called, or called more than once
    if any(o is item for o in outs):
      return "layer", path
  raise _errors.GraphGradError(
      f"recompute: `keep` got the symbolic tensor {item!r}, which is "
      f"layer.output of no top-level layer of {model.name} (a model input, "
      f"a nested layer's output, another model's tensor, or a shared "
      f"layer's second call). Pass layer.output of a layer {model.name} "
      f"calls directly, or a layer name; top-level layers: {tops}.")


class Recomputer:
  """The recomputed calls of one plan tape, and their replays."""

  def __init__(self, keep: Optional[Tuple[str, ...]], name: str):
    # The paths of the layers whose outputs are kept, or None to choose
    # calls from the step's activation bytes (choose_kept).
    self._keep = keep
    self._name = name
    # Calls traced in another graph (tf-keras builds a Sequential model in
    # a scratch graph on its first call) run as they are.
    self._graph = (None if tf.executing_eagerly()
                   else tf.compat.v1.get_default_graph())
    self.calls: List[_LayerCall] = []
    self._blocks_of: Optional[int] = None  # len(calls) when blocks were set
    self._ends: Set[int] = set()  # the calls whose outputs are kept
    self._replays: Dict[int, Dict[int, tuple]] = {}

  def takes(self, args, kwargs) -> bool:
    """Whether a call on ``args`` and ``kwargs`` is recomputed: not an
    embedding's lookup (nothing to replay it from), nor in a scratch graph."""
    if not any(is_float(a) for a in tf.nest.flatten((args, kwargs))):
      return False
    return (tf.executing_eagerly()
            or tf.compat.v1.get_default_graph() is self._graph)

  def call(self, path: str, layer, call: Callable, args, kwargs,
           backward: Optional[Callable] = None):
    """Runs ``call`` as a recomputed layer call; returns its output.

    Args:
      path: the layer's path.
      layer: the layer.
      call: its ``call``.
      args: the call's positional arguments.
      kwargs: its keyword arguments.
      backward: for a call the plan rewrites: ``backward(vjp, outs, dys,
        variables) -> (input grads, variable grads)``, the call's backward
        pass given its VJP (the replay's, or the forward call's for a call
        that keeps its activations), its flat outputs and their gradients.
        ``None``: the VJP of the gradients.
    """
    if not self.takes(args, kwargs):
      return call(*args, **kwargs)
    xs, run = float_inputs(call, args, kwargs)
    eager = tf.executing_eagerly()
    rec = _LayerCall(path, xs, run, whole=eager, backward=backward)
    if not eager:
      rec.state = [u for u in map(tf_variable, layer.non_trainable_variables)
                   if u is not None]
      rec.snapshot = [tf.identity(v.read_value()) for v in rec.state]
    index = len(self.calls)
    self.calls.append(rec)

    @tf.custom_gradient
    def recomputed(*inputs):
      graph = None if eager else tf.compat.v1.get_default_graph()
      first = len(graph.get_operations()) if graph is not None else 0
      rec.inner, out = TapeVJP.record(run, inputs, gate=True)
      rec.inner_outs = tf.nest.flatten(out)
      if graph is not None and _stateful(graph.get_operations()[first:]):
        rec.whole = True

      def grad(*dys, variables=None):
        with tf.name_scope(f"{self._name}/recompute"):
          return self._vjp(index, list(dys), list(variables or []))

      return out, grad

    out = recomputed(*rec.xs)
    rec.outs = tf.nest.flatten(out)
    return out

  @property
  def kept(self) -> List[tf.Tensor]:
    """The outputs of the calls that end a block (declared or chosen), in
    forward order: what the backward pass keeps."""
    self._set_blocks()
    return [t for i in sorted(self._ends) for t in self.calls[i].outs]

  # -- the backward pass ---------------------------------------------------

  def _vjp(self, index: int, dys: list, variables: list):
    rec = self.calls[index]
    if rec.whole and rec.inner is not None:
      vjp, outs = rec.inner, rec.inner_outs
    else:
      vjp, outs = self._replayed(index, dys)
    if rec.backward is not None:
      return rec.backward(vjp, outs, dys, variables)
    xs = vjp.inputs
    dys = [tf.zeros_like(o) if d is None else d for o, d in zip(outs, dys)]
    pairs = [(o, d) for o, d in zip(outs, dys) if is_float(o)]
    # Gated: every gradient of the call is computed before any of them is
    # used, so the calls below are not replayed while this call's
    # activations wait for a parameter gradient.
    grads = vjp.vjp([o for o, _ in pairs], xs + variables,
                    [d for _, d in pairs])
    return grads[:len(xs)], grads[len(xs):]

  def _replayed(self, index: int, dys: list):
    """The replayed (layer VJP, outputs) of call ``index``."""
    self._set_blocks()
    block = self.calls[index].block
    if block not in self._replays or index not in self._replays[block]:
      self._replays[block] = self._replay(block, dys)
    return self._replays[block].pop(index)

  def _set_blocks(self) -> None:
    if self._blocks_of == len(self.calls):
      return
    self._blocks_of = len(self.calls)
    if self._keep is None:
      ends = choose_kept(self.calls)
    else:
      ends = {i for i, c in enumerate(self.calls) if c.path in self._keep}
    self._ends = ends
    block = 0
    for i, c in enumerate(self.calls):
      if c.whole:  # its own block: what it reads and makes is kept
        block += 1
        c.block = block
        block += 1
        continue
      c.block = block
      if i in ends:
        block += 1
    log.debug("graphgrad KerasPlan recompute: %d calls in %d blocks",
              len(self.calls), block + 1)

  def _replay(self, block: int, dys: list) -> Dict[int, tuple]:
    """Replays the calls of ``block`` after the gradient ``dys`` exists."""
    replayed: Dict[Any, tf.Tensor] = {}
    out: Dict[int, tuple] = {}
    for j, c in enumerate(self.calls):
      if c.block != block:
        continue
      vjp, outs = TapeVJP.replay(c.run, [replayed.get(x.ref(), x)
                                         for x in c.xs],
                                 after=dys, state=c.state,
                                 snapshot=c.snapshot)
      for fwd, new in zip(c.outs, outs):
        replayed[fwd.ref()] = new
      out[j] = (vjp, outs)
    return out


def _stateful(ops) -> bool:
  """True when ``ops`` hold an op that may not run again: a stateful op
  other than a variable read or write (the replay restores the variables
  the forward left; core's ``reruns``)."""
  return any(op.op_def is not None and not _recompute_policy.reruns(
      op.type, op.op_def.is_stateful, restores_state=True) for op in ops)
