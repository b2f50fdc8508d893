"""Gaussian gradient noise, constant or annealed with the global step."""

import zlib
from typing import Optional

import tensorflow as tf

from graphgrad import _errors
from graphgrad.transforms import _validate
from graphgrad.transforms._transforms import Transform, cast_like


class _AddNoise(Transform):
  name = "add_noise"

  def __init__(self, stddev, seed, eta=None, gamma=None):
    self.stddev = stddev
    self.seed = seed
    self.eta = eta
    self.gamma = gamma

  @property
  def reads_global_step(self):
    return self.eta is not None

  def _stddev(self, grad, context):
    if self.eta is None:
      return cast_like(self.stddev, grad)
    step = context.global_step
    if step is None:
      raise _errors.GraphGradError(
          f"add_noise(eta={self.eta!r}, gamma={self.gamma!r}) anneals with "
          f"the global step, but the tf.Graph has none when the plan is built. "
          f"Create it before building the plan: "
          f"`step = tf.compat.v1.train.get_or_create_global_step()`; the "
          f"plan's apply_gradients then increments it.")
    t = tf.cast(step, grad.dtype)
    variance = cast_like(self.eta, grad) / tf.pow(
        1 + t, cast_like(self.gamma, grad))
    return tf.sqrt(variance, name="stddev")

  def apply_dense(self, grad, context):
    seed = self.seed
    if seed is not None and context.tensor is not None:
      # One seed per transformed tensor: equal seeds on two random ops of the
      # same shape would draw the same noise.
      seed = (seed + zlib.crc32(context.tensor.name.encode())) % (2**31 - 1)
    stddev = self._stddev(grad, context)
    noise = tf.random.normal(tf.shape(grad), stddev=1.0, dtype=grad.dtype,
                             seed=seed)
    return grad + stddev * noise

  def __repr__(self):
    if self.eta is not None:
      return (f"add_noise(eta={self.eta!r}, gamma={self.gamma!r}, "
              f"seed={self.seed!r})")
    return f"add_noise({self.stddev!r}, seed={self.seed!r})"


def add_noise(stddev=None, seed: Optional[int] = None, *, eta=None,
              gamma=0.55) -> Transform:
  """Adds Gaussian noise to the gradient: constant or annealed.

  Two forms, told apart by keyword:

  * ``add_noise(stddev)``: constant noise, ``g + stddev * n`` with
    ``n ~ N(0, 1)``.
  * ``add_noise(eta=eta, gamma=0.55)``: annealed noise (Neelakantan et al.,
    2015, "Adding Gradient Noise Improves Learning for Very Deep Networks"),
    ``g + sigma_t * n`` with variance

        sigma_t^2 = eta / (1 + t)^gamma,

    where ``t`` is the tf.Graph's global step
    (``tf.compat.v1.train.get_global_step()``) read when the plan is built.
    The paper uses ``eta`` in {0.01, 0.3, 1.0} and ``gamma = 0.55``. The
    global step must exist before the plan is built; the plan's
    ``apply_gradients`` increments it when no other ``global_step`` is
    passed, so that ``t`` counts training steps.

  Args:
    stddev: standard deviation of constant noise. Give it, or ``eta``.
    seed: op-level seed. With a graph-level seed set, the noise is repeatable;
      each transformed tensor derives its own seed from it.
    eta: keyword only; the variance at step 0 of annealed noise.
    gamma: keyword only; the annealing exponent of annealed noise.

  Returns:
    A transform adding the noise.

  Raises:
    GraphGradError: if both or neither of ``stddev`` and ``eta`` are given,
      a hyperparameter is not a number (or scalar tensor), is NaN, infinite
      or negative, or ``seed`` is not an int; when applied, for annealed
      noise in a tf.Graph without a global step.

  Example:
    >>> add_noise(0.01, seed=1)
    add_noise(0.01, seed=1)
    >>> add_noise(eta=0.3, gamma=0.55)
    add_noise(eta=0.3, gamma=0.55, seed=None)
  """
  if (stddev is None) == (eta is None):
    raise _errors.GraphGradError(
        f"add_noise: give exactly one of `stddev` (constant noise) and `eta` "
        f"(annealed noise, variance eta / (1 + t)^gamma); got stddev="
        f"{stddev!r}, eta={eta!r}. Use add_noise(0.01) or "
        f"add_noise(eta=0.3, gamma=0.55).")
  seed = _validate.seed("add_noise", seed)
  given = [("stddev", stddev)] if eta is None else [("eta", eta),
                                                    ("gamma", gamma)]
  for arg, value in given:
    _validate.number("add_noise", arg, value, what="non-negative", low=0.0,
                     fix="Pass e.g. add_noise(0.01) or "
                     "add_noise(eta=0.3, gamma=0.55).")
  if eta is None:
    return _AddNoise(stddev, seed)
  return _AddNoise(None, seed, eta=eta, gamma=gamma)
