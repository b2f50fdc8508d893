"""``privatize`` under ``tf.compat.v1.train.SyncReplicasOptimizer``.

Each worker pushes its clipped sum ``S_k``, without noise; the accumulators
average ``R = replicas_to_aggregate`` pushes; on the chief, the
``gg.AfterAggregation`` it wraps takes ``R`` times that mean, adds one draw
of ``N(0, sigma^2 C^2 I)`` and divides by the global batch ``B``
(``expected_batch_size``, or ``R`` times the workers' static batch size),
before its transforms and the optimizer it wraps. The plan hands the noise
to that optimizer for the one ``SyncReplicasOptimizer.apply_gradients`` call
it makes (:func:`pending`): the wrapper has no public way to its inner
optimizer, and the user's ``gg.AfterAggregation`` says where the noise goes.
``R`` is read from the accumulator's take op, the gradient's own op.
"""

import contextlib
import dataclasses
import threading
from typing import Callable, Iterator, List, Optional

import tensorflow as tf

from graphgrad import _errors
from graphgrad._types import GradsAndVars
from graphgrad.core._privacy import Noise, NoiseCounter, Privacy

__all__ = ["SyncPrivacy", "check", "pending", "refuse_missing", "take"]

_TAKE_OPS = ("AccumulatorTakeGradient", "ResourceAccumulatorTakeGradient")
_FIX = ("Wrap the optimizer that SyncReplicasOptimizer aggregates for in "
        "gg.AfterAggregation: SyncReplicasOptimizer(gg.AfterAggregation("
        "tf.compat.v1.train.GradientDescentOptimizer(0.1), plan.net), "
        "replicas_to_aggregate=R)")


@dataclasses.dataclass(frozen=True)
class SyncPrivacy:
  """DP-SGD split between the workers and the chief.

  Each worker's backward pass builds its clipped sum (the plan's rules,
  compiled ``after_aggregation``); the chief adds the noise.

  Attributes:
    noise: the noise the chief adds (``PrivacyRule.after_aggregation``).
    batch: each worker's static batch size ``b`` (``B = R * b``), or
      ``None`` under ``expected_batch_size``.
  """
  noise: Noise
  batch: Optional[int] = None

  @property
  def privacy(self) -> Privacy:
    """What ``privatize`` declared."""
    return self.noise.privacy

  def noised(self, grads_and_vars: GradsAndVars,
             name: Optional[str] = None) -> GradsAndVars:
    """``(R * mean + noise) / B`` of each aggregated gradient, ``None`` kept.

    Built on the chief's update, where ``SyncReplicasOptimizer`` places it
    (the global step's device, a ps task under ``replica_device_setter``):
    the noise's step counter lives there and advances once per applied
    step.

    Raises:
      GraphGradError: for a gradient no ``SyncReplicasOptimizer``
        accumulator aggregated.
    """
    pairs = list(grads_and_vars)
    counts = [_replicas(g, v) for g, v in pairs if g is not None]
    if not counts:
      return pairs
    r = counts[0]  # one SyncReplicasOptimizer's replicas_to_aggregate
    divisor = (self.privacy.expected_batch_size if self.batch is None
               else r * self.batch)
    with tf.name_scope(name or "privatize_after_aggregation"):
      counter = NoiseCounter()
      sums = [None if g is None else g * tf.cast(r, g.dtype)
              for g, _ in pairs]
      out = self.noise.noised_mean(sums, divisor, counter)
    return [(g, v) for g, (_, v) in zip(out, pairs)]


def _replicas(g, v) -> int:
  """``replicas_to_aggregate``: the ``num_required`` of ``g``'s take op."""
  op = g.op
  count = (tf.get_static_value(op.inputs[1]) if op.type in _TAKE_OPS
           else None)
  if count is None:
    raise _errors.GraphGradError(
        f"privatize: the gradient of {v.name} reached gg.AfterAggregation "
        f"from the {op.type} op {op.name}, not from a SyncReplicasOptimizer "
        f"accumulator, so the plan's noise cannot be added after the "
        f"aggregation. {_FIX}, and apply the plan with that "
        f"SyncReplicasOptimizer.")
  return int(count)


def check(privacy: Privacy, loss: tf.Tensor, built: bool,
          transforms: int, reduces: bool = False) -> Optional[int]:
  """Checks a private plan applied by a ``SyncReplicasOptimizer``; returns
  each worker's static batch size (:attr:`SyncPrivacy.batch`).

  Args:
    privacy: the plan's declaration.
    loss: the plan's per-example loss.
    built: the plan was already built for one device.
    transforms: how many parameter transforms the plan declares.
    reduces: the plan has a ``reduce_fn``.

  Raises:
    GraphGradError: for a plan with a ``reduce_fn`` (a second
      aggregation), a plan already built with its noise on each
      worker, parameter transforms (they would act on each worker's sum
      before the noise), or a batch without a static size and no
      ``expected_batch_size``.
  """
  if reduces:
    raise _errors.GraphGradError(
        "privatize: the plan has a `reduce_fn` and `optimizer` is a "
        "SyncReplicasOptimizer: the gradients would be aggregated twice, "
        "and its noise drawn for the wrong batch. Use one of them: "
        "gg.GradientPlan(loss) under SyncReplicasOptimizer, or reduce_fn "
        "with a plain optimizer.")
  if built:
    raise _errors.GraphGradError(
        "privatize: compute_gradients() (or summaries(), a report) already "
        "built this private plan with its noise on each worker, which "
        "SyncReplicasOptimizer would then average. Call apply_gradients("
        "sync_optimizer, global_step=...) before anything else builds the "
        "plan.")
  if transforms:
    raise _errors.GraphGradError(
        "privatize: under SyncReplicasOptimizer the plan's "
        "transform_gradients would act on each worker's clipped sum, "
        "before the noise is added on the chief. Declare them on the "
        "gg.AfterAggregation the SyncReplicasOptimizer wraps "
        "(gg.AfterAggregation(optimizer, plan.net).transform_gradients("
        "layer, fn)): it applies them after the noise.")
  if privacy.expected_batch_size is not None:
    return None
  batch = tf.compat.dimension_value(loss.shape[0])
  if batch is None:
    raise _errors.GraphGradError(
        f"privatize: under SyncReplicasOptimizer the global batch size "
        f"divides the aggregated sum, but the loss {loss.name} has shape "
        f"{loss.shape}, whose batch size is known only at run time. Give "
        f"each worker batches of one static size b (the global batch is "
        f"then replicas_to_aggregate * b), or declare it: "
        f"plan.privatize(l2_norm_clip, noise_multiplier, "
        f"expected_batch_size=...).")
  return batch


_pending = threading.local()


@contextlib.contextmanager
def pending(sync: SyncPrivacy) -> Iterator[Callable[[], bool]]:
  """Within the block, this thread's next :func:`take` gives ``sync``.

  Yields a function that tells whether it was taken.
  """
  taken: List[bool] = []
  previous = getattr(_pending, "value", None)
  _pending.value = (sync, taken)
  try:
    yield lambda: bool(taken)
  finally:
    _pending.value = previous


def take() -> Optional[SyncPrivacy]:
  """The :class:`SyncPrivacy` a plan is applying, once; else ``None``."""
  value = getattr(_pending, "value", None)
  if value is None or value[1]:
    return None
  value[1].append(True)
  return value[0]


def refuse_missing() -> None:
  """Raises: the optimizer under ``SyncReplicasOptimizer`` added no noise.

  Raises:
    GraphGradError: always, with the fix.
  """
  raise _errors.GraphGradError(
      f"privatize: the optimizer that `optimizer` (a SyncReplicasOptimizer) "
      f"wraps is not a gg.AfterAggregation, so nothing adds the plan's "
      f"noise after the workers' clipped sums are aggregated. {_FIX}: it "
      f"adds one noise draw per applied step, on the chief.")
