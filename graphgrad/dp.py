"""Privacy accounting for ``plan.privatize``: ``gg.dp``.

:func:`epsilon` gives the epsilon of DP-SGD training and
:func:`noise_multiplier` the noise for a target epsilon, from
``dp-accounting`` (``pip install graphgrad[dp]``), RDP or PLD.
:func:`epsilon_callback` reports it during Keras ``fit``, :class:`EpsilonHook`
in a Session loop. The bound assumes Poisson sampling, which
:class:`PoissonSampling` makes for a ``tf.data`` pipeline and accounts for;
fixed-size shuffled batches can have a larger true epsilon
(docs/privacy.md).

Example:
  >>> import graphgrad as gg
  >>> round(gg.dp.epsilon(1.1, 256, 60000, epochs=60, delta=1e-5), 2)
  2.6
"""

import logging
import math
import secrets
from typing import Any, Optional

import tensorflow as tf

from graphgrad import _errors

log = logging.getLogger("graphgrad")

__all__ = ["EpsilonHook", "PoissonSampling", "epsilon", "epsilon_callback",
           "noise_multiplier"]

_ACCOUNTANTS = ("rdp", "pld")


def _dp_accounting():
  try:
    import dp_accounting  # pylint: disable=g-import-not-at-top
  except ImportError as e:  # pragma: no cover - the extra is installed in CI
    raise _errors.GraphGradError(
        "gg.dp needs the dp-accounting package: pip install "
        "'graphgrad[dp]' (or pip install 'dp-accounting>=0.4').") from e
  return dp_accounting


def _check(batch_size, dataset_size, delta, accountant, caller,
           name: str = "batch_size") -> None:
  """Refuses a bad argument; ``name`` is what the caller calls the batch
  size (``expected_batch_size`` for :class:`PoissonSampling`)."""
  if not isinstance(dataset_size, int) or dataset_size < 1:
    raise _errors.GraphGradError(
        f"{caller}: `dataset_size` must be a positive int, the number of "
        f"training examples; got {dataset_size!r}.")
  if (not isinstance(batch_size, int) or not 1 <= batch_size
      <= dataset_size):
    raise _errors.GraphGradError(
        f"{caller}: `{name}` must be an int from 1 to dataset_size "
        f"({dataset_size}), the expected batch of Poisson sampling; got "
        f"{batch_size!r}.")
  if not isinstance(delta, (int, float)) or not 0 < delta < 1:
    raise _errors.GraphGradError(
        f"{caller}: `delta` must be in (0, 1), typically below "
        f"1/dataset_size ({1 / dataset_size:.2g}); got {delta!r}.")
  if accountant not in _ACCOUNTANTS:
    raise _errors.GraphGradError(
        f"{caller}: `accountant` must be 'rdp' or 'pld'; got "
        f"{accountant!r}. 'pld' gives a tighter epsilon, 'rdp' is faster.")


def _steps(epochs, steps, batch_size, dataset_size, caller,
           drop_remainder: bool = False) -> int:
  """The steps of ``epochs`` as ``fit`` takes them: ``ceil(N / B)`` batches
  an epoch, the last one partial (``floor(N / B)`` with
  ``drop_remainder``), and a fraction of an epoch rounded up; or
  ``steps``."""
  if not isinstance(drop_remainder, bool):
    raise _errors.GraphGradError(
        f"{caller}: `drop_remainder` must be a bool, whether each epoch "
        f"drops its last partial batch; got {drop_remainder!r}.")
  if (epochs is None) == (steps is None):
    raise _errors.GraphGradError(
        f"{caller}: pass exactly one of `epochs` and `steps`; got "
        f"epochs={epochs!r}, steps={steps!r}.")
  if steps is not None:
    if not isinstance(steps, int) or steps < 0:
      raise _errors.GraphGradError(
          f"{caller}: `steps` must be an int >= 0; got {steps!r}.")
    return steps
  if not isinstance(epochs, (int, float)) or epochs < 0:
    raise _errors.GraphGradError(
        f"{caller}: `epochs` must be a number >= 0; got {epochs!r}.")
  per_epoch = (dataset_size // batch_size if drop_remainder
               else -(-dataset_size // batch_size))
  return int(math.ceil(epochs * per_epoch))


def _event(sigma: float, q: float, steps: int):
  dpa = _dp_accounting()
  return dpa.SelfComposedDpEvent(
      dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), steps)


def _accountant(name: str):
  dpa = _dp_accounting()
  return dpa.rdp.RdpAccountant() if name == "rdp" else dpa.pld.PLDAccountant()


def epsilon(noise_multiplier: float, batch_size: int, dataset_size: int,
            epochs: Optional[float] = None, delta: float = 1e-5, *,
            accountant: str = "rdp", steps: Optional[int] = None,
            drop_remainder: bool = False) -> float:
  """The epsilon of DP-SGD with Poisson sampling, at ``delta``.

  Each step samples each example with probability ``q = batch_size /
  dataset_size`` and adds Gaussian noise of multiplier ``noise_multiplier``
  (``plan.privatize``'s ``sigma``). ``epochs`` count the steps ``fit``
  takes: ``epochs * ceil(dataset_size / batch_size)`` (the last batch of
  each epoch partial), or ``epochs * floor(dataset_size / batch_size)``
  with ``drop_remainder``; a fraction of an epoch is rounded up.

  Args:
    noise_multiplier: ``sigma``.
    batch_size: the expected batch size.
    dataset_size: the number of training examples.
    epochs: passes over the data (or give ``steps``).
    delta: the ``delta`` of ``(epsilon, delta)``-DP.
    accountant: ``"rdp"`` (Renyi DP, Mironov 2017) or ``"pld"`` (privacy
      loss distributions, tighter).
    steps: the number of steps, instead of ``epochs``.
    drop_remainder: whether each epoch drops its last partial batch (a
      dataset batched with ``drop_remainder=True``).

  Returns:
    epsilon (``inf`` for ``noise_multiplier == 0``).

  Example:
    >>> import graphgrad as gg  # 4 epochs of 35 examples in batches of 16
    >>> gg.dp.epsilon(1.1, 16, 35, epochs=4) == gg.dp.epsilon(
    ...     1.1, 16, 35, steps=12)  # 3 batches an epoch, as fit takes them
    True

  Raises:
    GraphGradError: for a bad argument, or without dp-accounting.
  """
  caller = "gg.dp.epsilon"
  _check(batch_size, dataset_size, delta, accountant, caller)
  n = _steps(epochs, steps, batch_size, dataset_size, caller, drop_remainder)
  if not isinstance(noise_multiplier, (int, float)) or noise_multiplier < 0:
    raise _errors.GraphGradError(
        f"{caller}: `noise_multiplier` must be a number >= 0; got "
        f"{noise_multiplier!r}.")
  if n == 0:
    return 0.0
  if noise_multiplier == 0:
    return math.inf
  acc = _accountant(accountant)
  acc.compose(_event(float(noise_multiplier), batch_size / dataset_size, n))
  return float(acc.get_epsilon(delta))


def noise_multiplier(target_epsilon: float, batch_size: int,
                     dataset_size: int, epochs: Optional[float] = None,
                     delta: float = 1e-5, *, accountant: str = "rdp",
                     steps: Optional[int] = None,
                     drop_remainder: bool = False) -> float:
  """The smallest noise multiplier whose :func:`epsilon` is at most
  ``target_epsilon`` (``dp_accounting.calibrate_dp_mechanism``).

  Args:
    target_epsilon: the budget.
    batch_size: as for :func:`epsilon`.
    dataset_size: as for :func:`epsilon`.
    epochs: as for :func:`epsilon`.
    delta: as for :func:`epsilon`.
    accountant: as for :func:`epsilon`.
    steps: as for :func:`epsilon`.
    drop_remainder: as for :func:`epsilon`.

  Returns:
    ``sigma`` for ``plan.privatize``.

  Raises:
    GraphGradError: for a bad argument, or without dp-accounting.

  Example:
    >>> import graphgrad as gg
    >>> sigma = gg.dp.noise_multiplier(3.0, 256, 60000, epochs=60)
    >>> round(sigma, 2), gg.dp.epsilon(sigma, 256, 60000, epochs=60) <= 3.0
    (1.01, True)
  """
  caller = "gg.dp.noise_multiplier"
  _check(batch_size, dataset_size, delta, accountant, caller)
  n = _steps(epochs, steps, batch_size, dataset_size, caller, drop_remainder)
  if not isinstance(target_epsilon, (int, float)) or target_epsilon <= 0:
    raise _errors.GraphGradError(
        f"{caller}: `target_epsilon` must be a number > 0; got "
        f"{target_epsilon!r}.")
  dpa = _dp_accounting()
  q = batch_size / dataset_size
  return float(dpa.calibrate_dp_mechanism(
      lambda: _accountant(accountant), lambda s: _event(s, q, n),
      float(target_epsilon), float(delta),
      dpa.LowerEndpointAndGuess(0.0, 1.0)))


class PoissonSampling:
  """Poisson-sampled batches, and the epsilon of exactly that sampling.

  Each batch takes every example independently with probability ``q =
  expected_batch_size / dataset_size``, the sampling the accounting of
  :func:`epsilon` assumes (Abadi et al. 2016; Opacus'
  ``UniformWithReplacementSampler``). A batch's size is random, possibly
  0, so the plan must divide by the expected size: pass
  ``expected_batch_size=sampling.expected_batch_size`` to
  ``plan.privatize``. An epoch is ``ceil(1 / q)`` batches.

  Batch ``t`` is drawn from a stateless generator keyed by ``(key, t)``; the
  key is 62 bits from the operating system's entropy unless ``seed`` is
  given (for tests: a known seed makes the batches predictable).

  Args:
    dataset_size: the number of training examples ``N``.
    expected_batch_size: ``q N``, an int from 1 to ``N``.
    seed: for tests only; ``None`` draws the key from ``secrets``.

  Raises:
    GraphGradError: for a bad argument.

  Example:
    >>> import numpy as np, graphgrad as gg
    >>> sampling = gg.dp.PoissonSampling(1000, 100, seed=0)
    >>> sampling.sampling_rate, sampling.steps_per_epoch
    (0.1, 10)
    >>> x = np.arange(1000.0, dtype=np.float32)
    >>> sizes = [int(b.shape[0]) for b in sampling.batches(x, epochs=2)]
    >>> len(sizes), 60 < min(sizes) and max(sizes) < 140
    (20, True)
  """

  def __init__(self, dataset_size: int, expected_batch_size: int,
               seed: Optional[int] = None):
    _check(expected_batch_size, dataset_size, 0.5, "rdp",
           "gg.dp.PoissonSampling", name="expected_batch_size")
    if seed is not None and (not isinstance(seed, int)
                             or isinstance(seed, bool)):
      raise _errors.GraphGradError(
          f"gg.dp.PoissonSampling: `seed` must be an int or None; got "
          f"{seed!r}. Leave it None outside tests.")
    self.dataset_size = dataset_size
    self.expected_batch_size = expected_batch_size
    self._key = secrets.randbits(62) if seed is None else seed

  @property
  def sampling_rate(self) -> float:
    """``q``, each example's probability of joining a batch."""
    return self.expected_batch_size / self.dataset_size

  @property
  def steps_per_epoch(self) -> int:
    """``ceil(N / expected_batch_size)``: batches per epoch."""
    return int(math.ceil(self.dataset_size / self.expected_batch_size))

  def batches(self, data, epochs: Optional[float] = None) -> tf.data.Dataset:
    """A ``tf.data.Dataset`` of Poisson-sampled batches of ``data``.

    Args:
      data: what ``tf.data.Dataset.from_tensor_slices`` takes: a tensor,
        an array, or a nested structure of them, each with ``N`` rows.
      epochs: how many epochs of batches (``ceil(epochs * ceil(N / B))``,
        as :func:`epsilon` counts steps); ``None`` for an endless dataset.

    Returns:
      The batches, each the rows of ``data`` an independent draw kept.

    Raises:
      GraphGradError: if ``data``'s leading sizes are not ``N``, or for a
        bad ``epochs``.
    """
    caller = "gg.dp.PoissonSampling.batches"
    flat = [tf.convert_to_tensor(t) for t in tf.nest.flatten(data)]
    rows = {int(t.shape[0]) if t.shape.rank else None for t in flat}
    if rows != {self.dataset_size}:
      raise _errors.GraphGradError(
          f"{caller}: every tensor of `data` must have dataset_size "
          f"({self.dataset_size}) rows; got leading sizes "
          f"{sorted(map(str, rows))}. Pass the whole training set, one row "
          f"per example.")
    counter = (tf.data.Dataset.counter() if epochs is None
               else tf.data.Dataset.range(_steps(
                   epochs, None, self.expected_batch_size, self.dataset_size,
                   caller)))
    tensors = tf.nest.pack_sequence_as(data, flat)
    n, q, key = self.dataset_size, self.sampling_rate, self._key

    def batch(t):
      u = tf.random.stateless_uniform(
          [n], tf.stack([tf.constant(key, tf.int64), t]), dtype=tf.float64)
      keep = tf.reshape(tf.where(u < q), [-1])
      return tf.nest.map_structure(lambda x: tf.gather(x, keep), tensors)

    return counter.map(batch)

  def epsilon(self, noise_multiplier: float, epochs: Optional[float] = None,
              delta: float = 1e-5, *, accountant: str = "rdp",
              steps: Optional[int] = None) -> float:
    """:func:`epsilon` of this sampling's rate, after ``epochs`` (or
    ``steps``) of its batches."""
    return epsilon(noise_multiplier, self.expected_batch_size,
                   self.dataset_size, epochs, delta, accountant=accountant,
                   steps=steps)

  def __repr__(self) -> str:
    return (f"PoissonSampling(dataset_size={self.dataset_size}, "
            f"expected_batch_size={self.expected_batch_size})")


class _Reporter:
  """The arguments of :func:`epsilon` but the steps, checked once."""

  def __init__(self, noise_multiplier, batch_size, dataset_size, delta,
               accountant, caller):
    _check(batch_size, dataset_size, delta, accountant, caller)
    epsilon(noise_multiplier, batch_size, dataset_size, steps=0,
            delta=delta)  # checks noise_multiplier
    self.args = dict(noise_multiplier=noise_multiplier, batch_size=batch_size,
                     dataset_size=dataset_size, delta=delta,
                     accountant=accountant)

  def __call__(self, steps: int) -> float:
    return epsilon(steps=int(steps), **self.args)


def epsilon_callback(noise_multiplier: float, batch_size: int,
                     dataset_size: int, delta: float = 1e-5, *,
                     accountant: str = "rdp", keras: Any = None):
  """A Keras callback that reports epsilon after each epoch of ``fit``.

  It counts the training steps (the optimizer's ``iterations``, which
  ``steps_per_execution`` does not hide; the batches where the model has
  no optimizer) and, at the end of each epoch, writes
  ``logs["epsilon"]`` (so ``History`` holds it) and logs it on the
  ``graphgrad`` logger; ``callback.epsilon`` holds the last value.

  Args:
    noise_multiplier: as for :func:`epsilon`.
    batch_size: as for :func:`epsilon`.
    dataset_size: as for :func:`epsilon`.
    delta: as for :func:`epsilon`.
    accountant: as for :func:`epsilon`.
    keras: the Keras module whose ``callbacks.Callback`` the callback
      subclasses (``keras`` for Keras 3, ``tf_keras``); ``tf.keras`` when
      ``None``.

  Returns:
    The callback, for ``model.fit(..., callbacks=[...])``.

  Raises:
    GraphGradError: for a bad argument, or without dp-accounting.
  """
  report = _Reporter(noise_multiplier, batch_size, dataset_size, delta,
                     accountant, "gg.dp.epsilon_callback")
  base = (keras or tf.keras).callbacks.Callback

  class EpsilonCallback(base):  # type: ignore[valid-type,misc]
    """Reports epsilon after each epoch."""

    def __init__(self):
      super().__init__()
      self.steps = 0
      self.epsilon = 0.0
      self._base = None

    def _iterations(self):
      """The optimizer's step count: with ``steps_per_execution`` fit calls
      the batch hooks once per execution, not once per step."""
      it = getattr(getattr(self.model, "optimizer", None), "iterations",
                   None)
      return None if it is None else int(tf.convert_to_tensor(it))

    def on_train_begin(self, logs=None):
      it = self._iterations()
      self._base = None if it is None else self.steps - it

    def on_train_batch_end(self, batch, logs=None):
      if self._base is None:
        self.steps += 1

    def on_epoch_end(self, epoch, logs=None):
      if self._base is not None:
        self.steps = self._base + self._iterations()
      self.epsilon = report(self.steps)
      if logs is not None:
        logs["epsilon"] = self.epsilon
      log.info("graphgrad dp: epoch %d, %d steps, epsilon %.4g at delta %g",
               epoch + 1, self.steps, self.epsilon, delta)

  return EpsilonCallback()


class EpsilonHook(tf.compat.v1.train.SessionRunHook):
  """A ``SessionRunHook`` that reports epsilon during a Session loop.

  It reads the global step when the session starts, counts the ``run``
  calls after it and, every ``every_n_steps`` steps, computes epsilon for
  that many steps, logs it on the ``graphgrad`` logger and keeps it in
  :attr:`epsilon`; at the end it reads the global step again. Use it with
  ``tf.compat.v1.train.MonitoredTrainingSession(hooks=[...])``; the train op
  must increment the global step (``plan.apply_gradients(opt,
  global_step=...)``).

  Args:
    noise_multiplier: as for :func:`epsilon`.
    batch_size: as for :func:`epsilon`.
    dataset_size: as for :func:`epsilon`.
    delta: as for :func:`epsilon`.
    accountant: as for :func:`epsilon`.
    every_n_steps: how often to compute epsilon.

  Raises:
    GraphGradError: for a bad argument, without dp-accounting, or (in
      ``begin``) when the graph has no global step.
  """

  def __init__(self, noise_multiplier: float, batch_size: int,
               dataset_size: int, delta: float = 1e-5, *,
               accountant: str = "rdp", every_n_steps: int = 100):
    self._report = _Reporter(noise_multiplier, batch_size, dataset_size,
                             delta, accountant, "gg.dp.EpsilonHook")
    if not isinstance(every_n_steps, int) or every_n_steps < 1:
      raise _errors.GraphGradError(
          f"gg.dp.EpsilonHook: `every_n_steps` must be an int >= 1; got "
          f"{every_n_steps!r}.")
    self._every = every_n_steps
    self._delta = delta
    self._step = None
    self.epsilon = 0.0
    self.steps = 0

  def begin(self):
    self._step = tf.compat.v1.train.get_global_step()
    if self._step is None:
      raise _errors.GraphGradError(
          "gg.dp.EpsilonHook: the graph has no global step to count the "
          "steps by. Create one with tf.compat.v1.train."
          "get_or_create_global_step() and pass it to apply_gradients.")

  def after_create_session(self, session, coord):
    self.steps = int(session.run(self._step))

  def after_run(self, run_context, run_values):
    # Counted, not fetched: a fetch of the global step beside the train op
    # may read it before or after the increment.
    self.steps += 1
    if self.steps % self._every == 0:
      self.epsilon = self._report(self.steps)
      log.info("graphgrad dp: %d steps, epsilon %.4g at delta %g",
               self.steps, self.epsilon, self._delta)

  def end(self, session):
    step = int(session.run(self._step))
    self.steps, self.epsilon = step, self._report(step)
