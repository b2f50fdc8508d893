"""The VJP protocol: the one way an executor differentiates.

Each executor has one implementation, in one module, and nothing else in it
calls ``tf.gradients`` or ``GradientTape.gradient``: the TF1 engine's segment
calls (with the plan's op overrides, its hooks and, under ``recompute``, the
recomputed forward ops), and the Keras tape's (a layer call's inner tape, the
outer tape of the step, the replay of recomputed calls). Task combinations,
parameter transforms, the loss scale and ``privatize`` are written once, in
``core/``, against this protocol.
"""

from typing import List, Optional, Protocol, Sequence

from graphgrad._types import Gradient


class VJP(Protocol):
  """Vector-Jacobian products of one backward pass."""

  def vjp(self, ys: Sequence, xs: Sequence, grads: Optional[Sequence] = None,
          stop: Sequence = ()) -> List[Gradient]:
    """The gradients of ``ys`` for ``xs`` with ``grads`` at ``ys``.

    The argument order is the public ``BackwardContext.vjp``'s, the one
    contract of every VJP in graphgrad.

    Args:
      ys: the tensors differentiated.
      xs: tensors or variables; one gradient (or ``None``) each.
      grads: one gradient per ``ys`` entry (``None``: nothing flows from
        it), or ``None`` for ones at every entry.
      stop: tensors no gradient flows back through.
    """

  def task_vjps(self, target, losses: Sequence, xs: Sequence
                ) -> List[List[Gradient]]:
    """Per task loss ``l_i``: ``d target / d l_i * d l_i / d xs``.

    The weights come from ``target`` as it is backpropagated (the plan's
    loss, scaled under a loss scale), so each task's gradients are in the
    units of the plan's own.
    """

  def per_example(self, ys: Sequence, xs: Sequence, grads: Sequence,
                  batch) -> List[Gradient]:
    """Per-example gradients of ``xs``, each ``[batch, *x.shape]``.

    Example ``i``'s gradient is the VJP of ``grads`` with every row but row
    ``i`` zeroed: ``privatize``'s exact fallback for ops whose per-example
    norms have no cheaper form.
    """
