"""The Keras tape's VJPs (``graphgrad.core._vjp``): where it differentiates.

Nothing else in ``graphgrad.keras`` asks a ``tf.GradientTape`` for a
gradient. :class:`TapeVJP` is the protocol on one tape, made three ways:

* :meth:`TapeVJP.record`, the layer VJP: a persistent tape that records one
  layer call (a rewritten call, whose replacement records on it too; a
  recomputed call that keeps its activations; an activation under
  ``privatize``); made with the call alone (:meth:`TapeVJP.of_call`), it
  runs the call once per example (:meth:`TapeVJP.per_example`);
* :meth:`TapeVJP.outer`, the outer-tape VJP: the plan tape's own tape over
  the step (the plan's gradient, task gradients, ``privatize``'s passes),
  or an edge's glue tape;
* :meth:`TapeVJP.replay`, the replay VJP: a recomputed call run again from
  its inputs in the backward pass.
"""

import logging
import re
from typing import Any, Callable, List, Optional, Sequence, Tuple

import tensorflow as tf

from graphgrad import _errors
from graphgrad._types import Gradient

log = logging.getLogger("graphgrad")

_NONE = tf.UnconnectedGradients.NONE
_warned: set = set()


class TapeVJP:
  """Vector-Jacobian products by one ``tf.GradientTape``.

  Made by :meth:`record`, :meth:`outer`, :meth:`replay` or :meth:`of_call`.

  Args:
    tape: the tape, or ``None`` (:meth:`of_call`).
    call: what the tape recorded, as a function of ``inputs``, or ``None``.
    inputs: the tensors ``call`` was run on.
    gate: in a graph, every gradient of one :meth:`vjp` is computed before
      any of them is used (as ``tf.gradients``' ``gate_gradients``).
  """

  def __init__(self, tape: Optional[tf.GradientTape],
               call: Optional[Callable] = None, inputs: Sequence = (),
               gate: bool = False):
    self.tape: Any = tape
    self.call = call
    self.inputs = list(inputs)
    self.gate = gate

  # -- the three kinds -----------------------------------------------------

  @classmethod
  def record(cls, call: Callable, inputs: Sequence,
             watch: Optional[Sequence] = None, persistent: bool = True,
             gate: bool = False
             ) -> Tuple["TapeVJP", Any]:
    """The layer VJP: ``call(*inputs)`` under a new tape.

    Args:
      call: the layer call, a function of ``inputs``.
      inputs: the tensors ``call`` takes.
      watch: what the tape watches (besides the trainable variables the
        call reads): ``inputs`` for ``None``.
      persistent: whether the tape answers more than one :meth:`vjp`.
      gate: as for the class.

    Returns:
      ``(the VJP, what call returned)``.
    """
    inputs = list(inputs)
    with tf.GradientTape(persistent=persistent) as tape:
      tape.watch(inputs if watch is None else list(watch))
      out = call(*inputs)
    return cls(tape, call, inputs, gate), out

  @classmethod
  def outer(cls, tape: tf.GradientTape) -> "TapeVJP":
    """The outer-tape VJP: ``tape``, which recorded the whole step (a plan
    tape's own tape) or the ops after a layer's outputs (a glue tape)."""
    return cls(tape)

  @classmethod
  def replay(cls, call: Callable, inputs: Sequence, after: Sequence = (),
             state: Sequence = (), snapshot: Sequence = ()
             ) -> Tuple["TapeVJP", list]:
    """The replay VJP: ``call`` run again, in the backward pass.

    Args:
      call: the recomputed call, a function of its inputs.
      inputs: its inputs (the forward pass' or replayed ones).
      after: the gradient that reached the call: the replay waits for it,
        so that it runs in the backward pass, not with the forward one.
      state: variables the call updates (batch-norm statistics, seeds).
      snapshot: their values when the forward call ran; the replay reads
        them, and the values the forward pass left are restored after it.

    Returns:
      ``(the gated VJP, the replayed flat outputs)``.
    """
    wait = [d for d in after if isinstance(d, tf.Tensor)]
    with tf.control_dependencies(wait):
      xs = [tf.identity(x) for x in inputs]
    now = [tf.identity(v.read_value()) for v in state]
    for v, s in zip(state, snapshot):
      v.assign(s)
    vjp, out = cls.record(call, xs, gate=True)
    for v, s in zip(state, now):
      v.assign(s)
    return vjp, tf.nest.flatten(out)

  @classmethod
  def of_call(cls, call: Callable, inputs: Sequence) -> "TapeVJP":
    """A call that ran on ``inputs`` under another tape, for
    :meth:`per_example`; it records nothing of its own."""
    return cls(None, call, inputs)

  # -- recording on the tape -----------------------------------------------

  def recording(self):
    """A context in which the tape records again (a replacement's ops)."""
    return self.tape

  def paused(self):
    """A context in which the tape does not record."""
    return self.tape.stop_recording()

  def watch(self, t) -> None:
    self.tape.watch(t)

  # -- the protocol ----------------------------------------------------------

  def vjp(self, ys: Sequence, xs: Sequence,
          grads: Optional[Sequence] = None, stop: Sequence = (),
          unconnected: tf.UnconnectedGradients = _NONE) -> List[Gradient]:
    """The gradients of ``ys`` for ``xs`` with ``grads`` at ``ys``.

    Args:
      ys: the tensors differentiated.
      xs: tensors or variables; one gradient (or ``None``) each.
      grads: one gradient per ``ys`` entry (``None``: nothing flows from
        it), or ``None`` for ones at every entry.
      stop: tensors no gradient flows back through: the tape can stop only
        where it recorded nothing behind (the watched inputs, leaves),
        which the callers check.
      unconnected: as ``GradientTape.gradient``'s.
    """
    del stop  # a leaf of the tape stops by itself
    xs = list(xs)
    ys = list(ys)
    if grads is not None:
      pairs = [(y, g) for y, g in zip(ys, grads) if g is not None]
      ys, grads = [y for y, _ in pairs], [g for _, g in pairs]
    if not ys or not xs:
      return [None] * len(xs)
    out = list(self.tape.gradient(ys, xs, output_gradients=grads,
                                  unconnected_gradients=unconnected))
    if self.gate and not tf.executing_eagerly():
      at = [i for i, g in enumerate(out) if isinstance(g, tf.Tensor)]
      for i, g in zip(at, tf.tuple([out[i] for i in at]) if at else []):
        out[i] = g
    return out

  def backprop(self, target, sources, output_gradients=None,
               unconnected: tf.UnconnectedGradients = _NONE):
    """``GradientTape.gradient`` itself: nested ``target`` and ``sources``,
    ``output_gradients`` as the tape takes them (the plan's own gradient)."""
    return self.tape.gradient(target, sources, output_gradients, unconnected)

  def task_vjps(self, target, losses: Sequence, xs: Sequence
                ) -> List[List[Gradient]]:
    """Per task loss ``l_i``: ``d target / d l_i * d l_i / d xs``; raises
    for a task loss that ``target`` does not depend on."""
    weights = self.vjp([target], losses)
    if all(w is None for w in weights):
      # The sum of task losses that the tape recorded depends on each of
      # them: none reached means the tape missed the loss or the losses.
      raise _errors.NotConnectedError(
          f"tape.gradient: the loss depends on none of `task_losses` as "
          f"this tape recorded them; got {len(losses)} task losses "
          f"({', '.join(_described(l) for l in losses)}). The loss, or the "
          f"task losses, were computed outside the tape: compute the task "
          f"losses, and the loss from them, inside `with plan.tape() as "
          f"tape:`.")
    for i, w in enumerate(weights):
      if w is None:
        raise _errors.NotConnectedError(
            f"tape.gradient: the loss does not depend on `task_losses[{i}]`. "
            f"List the task losses whose (weighted) sum is the loss.")
    return [self.vjp([l], xs, [w]) for l, w in zip(losses, weights)]

  def per_example(self, ys: Sequence, xs: Sequence, grads: Sequence,
                  batch, loop: bool = False, name: str = "a call"
                  ) -> List[tf.Tensor]:
    """Per-example gradients of ``xs``, each ``[batch, *x.shape]``.

    The call runs once per example (``tf.vectorized_map``, or with
    ``loop`` ``tf.map_fn``: a call whose ops ``vectorized_map`` cannot
    convert, such as tf-keras' fused recurrent loops), on row ``i``
    of each of its inputs (the tensors of examples; the call holds the
    others), and is differentiated with row ``i`` of ``grads``: exact for a
    call that treats each example alone. ``ys`` are its outputs, a nested
    structure whose flattened tensors ``grads`` match one to one (``None``:
    nothing flows from that one); a variable the call does not reach gets
    zeros. A traced call with a loop, a branch or a tensor list between its
    inputs and ``ys`` runs in ``tf.map_fn`` (``vectorized_map`` converts
    them into ops that can fail when run), and so does a call that
    ``vectorized_map`` fails to convert, or (eagerly) to run: ``name``
    then says which in a warning, logged once.
    """
    del batch  # the inputs' rows are the examples
    if self.call is None:
      raise ValueError("per_example needs the call (TapeVJP.of_call)")
    xs = list(xs)
    at = [i for i, g in enumerate(grads) if g is not None]
    loop = loop or _has_control_flow(ys, self.inputs)
    del ys  # its structure is the call's: read again from each example's

    def one(elems):
      rows, gs = elems
      vjp, yi = TapeVJP.record(lambda *a: self.call(*a),
                               [r[None] for r in rows], watch=xs,
                               persistent=False)
      flat = tf.nest.flatten(yi)
      got = vjp.vjp([flat[i] for i in at], xs, [g[None] for g in gs])
      return [tf.zeros(x.shape, x.dtype) if g is None else
              tf.convert_to_tensor(g) for g, x in zip(got, xs)]

    elems = (list(self.inputs), [tf.convert_to_tensor(grads[i]) for i in at])
    if not loop:
      try:
        # Without the fallback, an op pfor cannot convert fails here, while
        # tracing, not as a while loop that may fail when run.
        return tf.vectorized_map(one, elems, fallback_to_while_loop=False)
      except (ValueError, TypeError, NotImplementedError,
              tf.errors.OpError) as e:
        if name not in _warned:
          _warned.add(name)
          log.warning("privatize: tf.vectorized_map cannot run the "
                      "per-example gradients of %s (%s: %s); they are "
                      "computed one example at a time in tf.map_fn.",
                      name, type(e).__name__, error_line(e))
    return tf.map_fn(one, elems, fn_output_signature=[
        tf.TensorSpec(x.shape, x.dtype) for x in xs])


def error_line(e: Exception) -> str:
  """The line of a TensorFlow error that says what failed: an op's error
  ends with it (after the traceback of where the op was made, and before
  the arguments a Keras layer's call received), an error raised while
  tracing starts with it, or quotes it as ``ValueError: ...`` after the
  traceback of the user's code."""
  text = _NOISE.sub("", str(e))
  lines = [line.strip() for line in text.splitlines()]
  lines = [line for line in lines if line and not line.startswith(
      ("[[", "Arguments received by", "Call arguments received by",
       "\u2022"))]
  quoted = [m.group(1) for m in map(_QUOTED.match, lines) if m]
  if isinstance(e, tf.errors.OpError) and lines:
    line = lines[-1]
  else:
    line = quoted[-1] if quoted else lines[0] if lines else type(e).__name__
  return line if len(line) <= 200 else line[:197] + "..."


_QUOTED = re.compile(r"^[A-Za-z]*(?:Error|Exception): (.+)$")
# Terminal colours (Keras 3) and the function an eager op ran in.
_NOISE = re.compile(r"\x1b\[[0-9;]*m|\{\{function_node [^}]*\}\}\s*")


# Ops that vectorized_map converts into ones that can fail when run (a loop
# with a per-example trip count, its gradient's tensor lists).
_CONTROL_FLOW = ("While", "StatelessWhile", "If", "StatelessIf")


def _has_control_flow(ys, inputs: Sequence) -> bool:
  """Whether a traced call has a loop, a branch or a tensor list between
  ``inputs`` and its outputs ``ys`` (``False`` when executing eagerly)."""
  flat = [y for y in tf.nest.flatten(ys) if isinstance(y, tf.Tensor)]
  if tf.executing_eagerly() or not flat or not hasattr(flat[0], "op"):
    return False
  stop = {x.name for x in inputs if isinstance(x, tf.Tensor)}
  stack, seen = [y.op for y in flat if y.name not in stop], set()
  while stack:
    op = stack.pop()
    if op.name in seen:
      continue
    seen.add(op.name)
    if op.type in _CONTROL_FLOW or op.type.startswith("TensorList"):
      return True
    stack += [t.op for t in op.inputs if t.name not in stop]
  return False


def _described(tensor) -> str:
  """A tensor's name, or in eager mode (no names) its dtype and shape."""
  name = getattr(tensor, "name", None) if not tf.executing_eagerly() else None
  if name:
    return name
  dtype = getattr(tensor, "dtype", None)
  return (f"{dtype.name} {tuple(tensor.shape)}" if dtype is not None
          else type(tensor).__name__)
