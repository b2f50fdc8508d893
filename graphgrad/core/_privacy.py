"""Differential privacy: the ``privatize`` declaration and DP-SGD, once.

DP-SGD (Abadi et al. 2016) clips each example's whole gradient to L2 norm
``C``, sums, adds ``N(0, sigma^2 C^2 I)`` and divides by the batch size.
Each executor finds where its variables meet the examples (the TF1 op
graph, the Keras layer calls) as its :class:`Uses`; :func:`private_gradients`
is the algorithm for both: one VJP to the uses, the per-example norms, clip
factors and clipped sums of :mod:`graphgrad.core._clipping`, the reduction
across replicas, and :class:`Noise` with the executor's :class:`NoiseCounter`.
"""

import dataclasses
import logging
import math
import secrets
import sys
from typing import (
  Any,
  Callable,
  Dict,
  Hashable,
  List,
  Mapping,
  Optional,
  Protocol,
  Sequence,
)

import tensorflow as tf

from graphgrad import _compat, _errors
from graphgrad._types import Gradient
from graphgrad.analysis import _example_axis
from graphgrad.core._clipping import (
  clip_factors,
  clipped_sum,
  example_norms,
  unscaled_forms,
)
from graphgrad.core._forms import norm_dtype

log = logging.getLogger("graphgrad")

__all__ = ["LARGE", "Noise", "NoiseCounter", "Privacy", "Reduction", "Uses",
           "check_per_example_loss", "check_privacy", "gaussian",
           "philox_words", "private_gradients", "refuse_declarations"]


@dataclasses.dataclass(frozen=True)
class Privacy:
  """What ``plan.privatize`` declared.

  Attributes:
    l2_norm_clip: ``C``, the bound on each example's gradient norm.
    noise_multiplier: ``sigma``; the noise's standard deviation is
      ``sigma * C`` before the division by the batch size.
    seed: the noise's seed, or ``None`` for a key drawn from the operating
      system's entropy when the noise is built (the seed is for tests).
    expected_batch_size: the divisor of the noised sum when given (the
      expected batch size of Poisson sampling); ``None`` divides by the
      executor's fixed batch size (``fit``'s) or else the realized global
      batch size.
  """
  l2_norm_clip: float
  noise_multiplier: float
  seed: Optional[int] = None
  expected_batch_size: Optional[float] = None


def check_privacy(l2_norm_clip, noise_multiplier, seed, caller: str,
                  expected_batch_size=None) -> Privacy:
  """The checked :class:`Privacy` of a ``privatize`` call.

  Raises:
    GraphGradError: for a clip that is not a positive finite number, a
      negative noise multiplier, a seed that is not an int, or an expected
      batch size that is not a positive finite number.
  """
  def number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool)

  if not number(l2_norm_clip) or not 0 < l2_norm_clip < float("inf"):
    raise _errors.GraphGradError(
        f"{caller}: `l2_norm_clip` must be a positive finite number, the "
        f"bound C on each example's gradient norm; got {l2_norm_clip!r}. "
        f"Pass e.g. l2_norm_clip=1.0.")
  if (not number(noise_multiplier) or not
      0 <= noise_multiplier < float("inf")):
    raise _errors.GraphGradError(
        f"{caller}: `noise_multiplier` must be a finite number >= 0 (sigma; "
        f"the noise's stddev is sigma * l2_norm_clip); got "
        f"{noise_multiplier!r}. Pass e.g. noise_multiplier=1.1, or "
        f"gg.dp.noise_multiplier(target_epsilon, ...) for a target budget.")
  if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
    raise _errors.GraphGradError(
        f"{caller}: `seed` must be an int or None; got "
        f"{type(seed).__name__} {seed!r}. Leave it None outside tests: a "
        f"known seed makes the noise predictable.")
  if expected_batch_size is not None and (
      not number(expected_batch_size)
      or not 0 < expected_batch_size < float("inf")):
    raise _errors.GraphGradError(
        f"{caller}: `expected_batch_size` must be a positive finite number "
        f"or None; got {expected_batch_size!r}. Under Poisson sampling pass "
        f"the sampling rate times the dataset size, e.g. "
        f"expected_batch_size=256 (gg.dp.PoissonSampling gives it).")
  return Privacy(float(l2_norm_clip), float(noise_multiplier), seed,
                 None if expected_batch_size is None
                 else float(expected_batch_size))


def check_per_example_loss(loss, caller: str) -> None:
  """Refuses a loss that is not a vector of per-example losses.

  Raises:
    GraphGradError: unless ``loss`` has rank 1.
  """
  rank = loss.shape.rank
  if rank != 1:
    shape = "unknown rank" if rank is None else f"shape {loss.shape}"
    raise _errors.GraphGradError(
        f"{caller}: privatize needs the loss to be the vector of per-example "
        f"losses, shape [batch]; got {getattr(loss, 'name', 'the loss')} "
        f"with {shape}. Pass the unreduced loss, e.g. "
        f"tf.keras.losses.sparse_categorical_crossentropy(y, logits) or "
        f"tf.reduce_sum(tf.square(pred - y), axis=1), not its mean.")


def refuse_declarations(declarations) -> None:
  """Refuses a declaration that acts before the clip, with the reason its
  kind gives (``Declaration.before_clip``).

  Raises:
    GraphGradError: for a task combination (its weights come from the whole
      batch), an upstream or edge transform, a backward replacement or an
      op override (they rewrite the backward pass the norms are taken
      from). Parameter transforms act after the noise and are allowed.
  """
  for d in declarations:
    if d.before_clip is not None:
      where = f" on {d.layer!r}" if d.layer else ""
      raise _errors.GraphGradError(
          f"privatize cannot be combined with {d.kind.value} declarations"
          f"{where}: {d.before_clip}. Declare it without privatize, or use "
          f"transform_gradients, which acts after the noise "
          f"(post-processing keeps the privacy guarantee).")


# -- DP-SGD, written once for both executors -----------------------------------


class Uses(Protocol):
  """Where an executor's variables meet the examples.

  The TF1 plan reads them from the op graph (the ops that consume each
  variable), the Keras tape from the layer calls it recorded.
  """

  def outputs(self) -> List[tf.Tensor]:
    """The tensors whose gradient the forms of the uses need."""

  def forms(self, grads: Sequence[Gradient], batch
            ) -> Mapping[Any, list]:
    """``key(variable) -> forms`` of its uses (:func:`combined_sq_norms`),
    from the gradient of ``sum_i l_i`` at each of :meth:`outputs`.

    Raises:
      NotConnectedError: when no variable has a use on the way to the loss.
    """

  def key(self, variable) -> Optional[Hashable]:
    """The key of ``variable`` in :meth:`forms`, ``None`` for a source
    that is not a variable."""

  def refuse_outside(self, variable) -> None:
    """Raises for ``variable``, which reaches the loss other than through
    the uses :meth:`forms` knows."""


@dataclasses.dataclass(frozen=True)
class Reduction:
  """A linear cross-replica reduction in the TF1 plan (its ``reduce_fn``).

  Attributes:
    reduce: ``(variables, tensors) -> reduced tensors``, in order; on every
      replica it returns ``alpha * sum_k x_k`` over the replicas ``k``,
      with ``alpha`` 1 (a sum) or ``1 / replicas`` (a mean).
    replicas: the number of replicas it reduces over.
  """
  reduce: Callable[[Sequence, Sequence[tf.Tensor]], Sequence[Gradient]]
  replicas: int


def private_gradients(vjp, loss: tf.Tensor, variables: Sequence,
                      uses: Uses, noise: "Noise", counter: "NoiseCounter",
                      reduction: Optional[Reduction] = None,
                      scale=None, seed=None,
                      batch_size: Optional[float] = None
                      ) -> List[Gradient]:
  """DP-SGD's gradient of each of ``variables``: ``(1/B)(sum_i
  clip_C(grad_i) + noise)``, ``None`` for those the loss does not reach.

  One call of the executor's VJP from ``sum_i l_i`` gives the gradient at
  every use's output; the uses' boundary tensors give the per-example
  squared norms over ``variables`` (the gradient that is released), the
  clip factors ``c_i`` and, by book-keeping (Bu et al. 2023), each
  variable's clipped sum ``sum_i c_i grad_i``, with no second backward
  pass. A variable the loss reaches other than through a known use is
  refused: its per-example gradient would be unknown. A graph loss (a
  ``tf.Graph``, or traced in a ``tf.function``) is first checked for ops
  that mix examples (:mod:`graphgrad.analysis._example_axis`).

  Args:
    vjp: the executor's VJP (:class:`graphgrad.core._vjp.VJP`).
    loss: the per-example losses, shape ``[B]`` (checked by the caller).
    variables: the variables (or sources) of the gradient.
    uses: the executor's :class:`Uses`.
    noise: the plan's :class:`Noise` (``PlanRules.privacy.noise``).
    counter: the executor's :class:`NoiseCounter` for it.
    reduction: the cross-replica reduction of the clipped sums, or
      ``None`` (:func:`_across_replicas`).
    scale: the loss scale ``S`` the backward pass carries (mixed precision),
      or ``None``. The boundary gradients are then ``S`` times the true
      ones: :func:`unscaled_forms` divides them by ``S`` in float32 before
      the norms and sums, and the result is ``S`` times DP-SGD's gradient,
      as a loss-scaled backward pass gives it, for the loss-scale
      optimizer to unscale once. A non-finite backward pass (an overflow)
      makes every result NaN, so that the optimizer skips the step.
    seed: what ``loss`` is backpropagated with; ``None`` for ones (a loss
      already scaled by ``S``), ``S`` where ``loss`` is not.
    batch_size: the divisor ``B`` when the plan declares no
      ``expected_batch_size`` (``fit``'s batch size), the same every step;
      ``None`` divides by the realized global batch size.
  """
  if not tf.executing_eagerly():
    _example_axis.refuse_mixing(loss)
  with tf.name_scope("privatize"):
    batch = tf.shape(loss)[0]
    outputs = uses.outputs()
    forms = uses.forms(
        vjp.vjp([loss], outputs,
                [tf.ones_like(loss) if seed is None else seed])
        if outputs else [],
        batch)
    if scale is not None:
      forms = {k: unscaled_forms(f, scale) for k, f in forms.items()}
    keys = [uses.key(v) for v in variables]
    known = [(k, v) for k, v in zip(keys, variables) if k in forms]
    missing = [v for k, v in zip(keys, variables) if k not in forms]
    if missing:
      for v, g in zip(missing, vjp.vjp([loss], missing,
                                       [tf.ones_like(loss)])):
        if g is not None:
          uses.refuse_outside(v)
    if not known:
      return [None] * len(keys)
    # A non-finite norm (an overflow of the backward pass under a loss
    # scale, a NaN example) makes every clip factor NaN: no factor hides it.
    norms = example_norms([forms[k] for k, _ in known],
                          [v.shape for _, v in known],
                          [norm_dtype(v.dtype) for _, v in known], batch,
                          noise.privacy.l2_norm_clip)
    c = clip_factors(norms, noise.privacy.l2_norm_clip,
                     norm_dtype(loss.dtype))
    if reduction is None:  # the mean's division folded into c: [B] values
      expected = noise.privacy.expected_batch_size
      divisor, first = _global_batch(
          batch, batch_size if expected is None else expected)
      c = c / tf.cast(divisor, c.dtype)
    sums = {k: clipped_sum(forms[k], c, v.shape, batch, v.dtype)
            for k, v in known}
    if reduction is not None:
      reduced, divisor, key = _across_replicas(
          reduction, [v for _, v in known], [sums[k] for k, _ in known],
          batch, noise)
      sums = dict(zip([k for k, _ in known], reduced))
      out = noise.noised_mean([sums.get(k) for k in keys], divisor, counter,
                              key=key)
    else:
      out = noise.noised_mean([sums.get(k) for k in keys], divisor, counter,
                              where=first, divided=True)
    if scale is None:
      return out
    return [None if g is None else g * tf.cast(scale, g.dtype) for g in out]


def _global_batch(batch, expected: Optional[float]):
  """The divisor of the noised sum, and where the noise is added.

  On one device: ``expected`` or the batch size, and everywhere. Inside
  ``strategy.run`` with ``N`` replicas, whose clipped sums the optimizer
  adds up: ``expected`` or the sum of the replicas' batch sizes (one
  all-reduce), and only on the first replica, so that the global batch gets
  one noise draw: neither ``sqrt(N)`` times too much noise nor ``N`` times
  too little.
  """
  ctx = tf.distribute.get_replica_context()
  replicas = 1 if ctx is None else ctx.num_replicas_in_sync
  if replicas == 1:
    return (batch if expected is None else expected), None
  if expected is None:
    divisor = ctx.all_reduce(tf.distribute.ReduceOp.SUM, batch)
  else:
    divisor = expected
  first = tf.equal(ctx.replica_id_in_sync_group, 0)
  return divisor, first


def _across_replicas(reduction: Reduction, variables, sums, batch,
                     noise: "Noise"):
  """The global clipped sums, the divisor and the noise's key under a
  ``reduce_fn``: ``(sums, divisor, key)``.

  One call of the reduction takes the replica's clipped sums ``S_k`` and a
  float32 vector ``[b_k, 1, u_1 .. u_4]`` (batch size, one, random words),
  paired with a variable of its shape that is never read
  (``dp_replica_stats``). From ``R(1)`` the reduction is a sum (``N``) or a
  mean (``1``), checked at run time; the global sum is ``R(S) / alpha``
  and ``B`` is ``R(b) / alpha`` unless expected. Every replica receives the
  same reduced words, fresh each step, so all take their bits as the
  noise's seed pair (in place of the key and the step counter, which may
  differ between replicas) and draw the same noise: one draw per global
  batch. A declared seed is the key, with the step counter.
  """
  privacy, n = noise.privacy, reduction.replicas
  keyed = privacy.noise_multiplier > 0 and privacy.seed is None
  with tf.name_scope("across_replicas"):
    stats = tf.concat(
        [tf.cast(tf.stack([batch, 1]), tf.float32)]
        + ([tf.random.uniform([4], seed=secrets.randbits(31))]
           if keyed else []), axis=0)
    tag = tf.compat.v1.Variable(
        tf.zeros(stats.shape, tf.float32), trainable=False,
        name="dp_replica_stats",
        collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES])
    out = list(reduction.reduce(list(variables) + [tag], list(sums) + [stats]))
    reduced = tf.convert_to_tensor(out[-1])
    one = reduced[1]
    is_sum = tf.abs(one - n) <= 1e-3 * n
    is_mean = tf.abs(one - 1.0) <= 1e-3
    check = tf.debugging.Assert(tf.logical_or(is_sum, is_mean), [
        f"privatize: reduce_fn is neither a sum nor a mean over "
        f"replicas={n}: it reduced 1.0 to", one, f"(expected {n} for a sum, "
        f"1 for a mean). Pass the number of replicas it reduces over as "
        f"`replicas` (Horovod: hvd.size()), and a linear reduction."])
    with tf.control_dependencies([check]):
      inverse = tf.where(is_sum, 1.0, float(n))  # 1 / alpha
    total = [t * tf.cast(inverse, t.dtype)
             for t in map(tf.convert_to_tensor, out[:-1])]
    divisor = privacy.expected_batch_size
    if divisor is None:
      divisor = tf.round(reduced[0] * inverse)
    key = None
    if keyed:  # the bits of the reduced words as two int64s
      key = tf.bitcast(tf.reshape(reduced[2:], [2, 2]), tf.int64)
  return total, divisor, key


# -- the noise -----------------------------------------------------------------


def gaussian(shape, seed: tf.Tensor, dtype=tf.float32, stddev=1.0
             ) -> tf.Tensor:
  """Normal values of standard deviation ``stddev`` from Philox words by
  Box-Muller, keeping both values of each pair.

  A float32 draw is two XLA-compiled kernels: :func:`_philox_blocks`,
  TensorFlow's Philox words (those of ``tf.random.stateless_uniform(...,
  alg="philox")``, bit for bit) as elementwise ops that XLA vectorizes, in
  less than half the time of XLA's own Philox at one thread, and
  :func:`_box_muller`, the transform. They are the same kernels, so the
  same values, in eager mode, in a ``tf.function`` and in a TF1 Session,
  and at one thread the draw takes about a third of the time of the same
  draw with TensorFlow's kernels. Traced into an enclosing XLA computation
  (a ``tf.function(jit_compile=True)`` step), which would inline both
  kernels and fuse the rounds into the transform, once per value, the
  words are XLA's own Philox fused with the transform: the same values,
  in twice the time. The values differ from TensorFlow's kernels' in the
  last bit or two; grappler folds a draw whose seed is a constant with
  those kernels (the plan's seeds never are). Other dtypes (float64) draw
  uniforms with ``tf.random.stateless_uniform`` and transform them with
  TensorFlow's ops.

  Example:
    >>> import tensorflow as tf
    >>> z = gaussian([100000], tf.constant([1, 2], tf.int64), stddev=2.0)
    >>> abs(float(tf.math.reduce_std(z)) - 2.0) < 0.02
    True
  """
  static = tf.TensorShape(shape) if not tf.is_tensor(shape) else None
  n = (static.num_elements() if static is not None
       else tf.reduce_prod(shape))
  half = (n + 1) // 2
  if tf.as_dtype(dtype) == tf.float32:
    half = tf.cast(half, tf.int64)
    if _compat.in_xla_computation():
      # XLA inlines the kernels and would fuse _philox_blocks' rounds into
      # the transform, once per value; its own Philox fuses well.
      words = tf.random.stateless_uniform(
          tf.reshape(2 * half, [1]), seed, minval=None, maxval=None,
          dtype=tf.uint32, alg="philox")
    else:
      words = _philox_words((2 * half + 3) // 4, seed)
    z = _box_muller(words, half, tf.cast(stddev, tf.float32))
  else:
    u = tf.random.stateless_uniform(
        tf.stack([2, half]) if tf.is_tensor(half) else [2, half], seed,
        minval=1e-30, maxval=1.0, dtype=dtype)
    stddev = tf.cast(stddev, dtype)
    r = tf.sqrt(tf.math.log(u[0]) * (-2.0 * stddev * stddev))
    t = (2.0 * math.pi) * u[1]
    z = tf.concat([r * tf.cos(t), r * tf.sin(t)], axis=0)
  even = not tf.is_tensor(n) and n % 2 == 0
  return tf.reshape(z if even else z[:n], shape)


def philox_words(n, seed: tf.Tensor) -> tf.Tensor:
  """The first ``n`` uint32 words of TensorFlow's Philox stream for
  ``seed``: ``tf.random.stateless_uniform([n], seed, minval=None,
  maxval=None, dtype=tf.uint32, alg="philox")``, bit for bit (a test), from
  :func:`_philox_blocks`. A shape's words are these, in row-major order.

  Example:
    >>> import tensorflow as tf
    >>> seed = tf.constant([-3, 2**40], tf.int64)
    >>> tf_words = tf.random.stateless_uniform(
    ...     [5], seed, minval=None, maxval=None, dtype=tf.uint32, alg="philox")
    >>> bool(tf.reduce_all(philox_words(5, seed) == tf_words))
    True
  """
  n = tf.cast(n, tf.int64)
  return _philox_words((n + 3) // 4, seed)[:n]


def _philox_words(blocks, seed) -> tf.Tensor:
  """The ``4 * blocks`` words of :func:`_philox_blocks`, as uint32; the
  bitcast and the reshape share its buffer."""
  pairs = _philox_blocks(tf.cast(blocks, tf.int64),
                        tf.reshape(tf.cast(seed, tf.int64), [2]))
  return tf.reshape(tf.bitcast(pairs, tf.uint32), [-1])


# Philox-4x32-10 (Salmon et al. 2011), as TensorFlow's PhiloxRandom has it:
# the two round multipliers, the key's two increments, and the key that
# scrambles a seed pair (0x02461e293ec8f720, low word first).
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)
_PHILOX_SEED_KEY = (0x3EC8F720, 0x02461E29)


def _philox(counter, key):
  """Philox-4x32-10 of four counter words under two key words: the
  block's four words, each a uint64 that holds a 32-bit word.

  Each round's 32x32-bit products are uint64 multiplies of words whose
  high halves are zero, which XLA's CPU backend vectorizes (``vpmuludq``);
  keeping the words in 64-bit lanes saves a conversion each round. The key
  words are uint32 scalars, so that their increments wrap at 32 bits.
  """
  c = list(counter)
  k0, k1 = key
  low = tf.constant(0xFFFFFFFF, tf.uint64)
  high = tf.constant(32, tf.uint64)
  for r in range(10):
    if r:
      k0 += tf.constant(_PHILOX_W[0], tf.uint32)
      k1 += tf.constant(_PHILOX_W[1], tf.uint32)
    p0 = c[0] * tf.constant(_PHILOX_M[0], tf.uint64)
    p1 = c[2] * tf.constant(_PHILOX_M[1], tf.uint64)
    c = [tf.bitwise.right_shift(p1, high) ^ c[1] ^ tf.cast(k0, tf.uint64),
         p1 & low,
         tf.bitwise.right_shift(p0, high) ^ c[3] ^ tf.cast(k1, tf.uint64),
         p0 & low]
  return c


def _split(x):
  """The low and high 32-bit words of int64 ``x`` (two's complement), as
  uint64."""
  x = tf.cast(x, tf.uint64)
  return (x & tf.constant(0xFFFFFFFF, tf.uint64),
          tf.bitwise.right_shift(x, tf.constant(32, tf.uint64)))


@tf.function(jit_compile=True, autograph=False, input_signature=[
    tf.TensorSpec([], tf.int64), tf.TensorSpec([2], tf.int64)])
def _philox_blocks(blocks, seed):
  """Words ``4i .. 4i+3`` of TensorFlow's Philox stream for ``seed``, for
  each block ``i < blocks``: a uint64 ``[blocks, 2]`` whose bytes are the
  words in order.

  The stateless ops' key and counter (``random_ops_util``'s
  ``_philox_scramble_seed``, as the older kernels' seed scrambling did):
  one Philox block of the seed's words (``seed[0]`` low, high, ``seed[1]``
  low, high) under a fixed key gives four words ``m``; the key is ``(m0,
  m1)`` and block ``i`` of the stream is Philox of the counter ``(i low,
  i high, m2, m3)``, its four words in order. An XLA loop computes one
  value of at most 64 bits per element, so each element runs its block's
  ten rounds and keeps two of its four words: twice the rounds, and still
  less than half the time of XLA's own Philox (1.1 against 2.6 ms for 1.3M
  words at one thread). Fused into :func:`_box_muller`, XLA's CPU backend
  would run the rounds again for every value that reads a word (80 ms for
  1.3M values), hence a kernel of its own, whose buffer the bitcast to
  words shares. ``blocks`` must be known when the kernel runs: XLA
  compiles once per size.
  """
  mix = _philox([*_split(seed[0]), *_split(seed[1])],
                [tf.constant(k, tf.uint32) for k in _PHILOX_SEED_KEY])
  i = tf.range(blocks, dtype=tf.int64)[:, None] + tf.zeros([1, 2], tf.int64)
  second = tf.equal(
      tf.range(2, dtype=tf.int64)[None, :] + tf.zeros_like(i), 1)
  w = _philox([*_split(i), mix[2], mix[3]],
              [tf.cast(mix[0], tf.uint32), tf.cast(mix[1], tf.uint32)])
  first, last = tf.where(second, w[2], w[0]), tf.where(second, w[3], w[1])
  if sys.byteorder == "big":
    first, last = last, first
  return first | tf.bitwise.left_shift(last, tf.constant(32, tf.uint64))


# sin and cos on [0, pi/4] (Cephes' sinf and cosf): relative error at most
# 1.1e-7 (two float32 ulps) there, so no range reduction is needed.
_SIN = (-1.6666654611e-1, 8.3321608736e-3, -1.9515295891e-4)
_COS = (4.166664568298827e-2, -1.388731625493765e-3, 2.443315711809948e-5)


# One trace for every size (XLA still compiles once per size).
@tf.function(jit_compile=True, autograph=False, input_signature=[
    tf.TensorSpec([None], tf.uint32), tf.TensorSpec([], tf.int64),
    tf.TensorSpec([], tf.float32)])
def _box_muller(words, half, stddev):
  """``2 * half`` float32 normal values: ``[r cos t, r sin t]``.

  Two Philox words per pair: pair ``j`` takes words ``j`` and ``half + j``
  of ``words``. The radius ``r = stddev sqrt(-2 log u)``
  takes ``u = (w + 1/2) / 2**32`` of the whole first word ``w``, in
  ``(0, 1]``: its tail goes on to 6.76 standard deviations (``u =
  2**-33``), where a float32 uniform's 23 bits in ``[1e-30, 1)`` stop at
  5.65 and put the rest of the tail at 11.75. The angle is uniform on the
  circle: 23 bits of the second word give ``x`` in ``(0, pi/4)``, whose
  sine and cosine two short polynomials give (``tf.sin`` and ``tf.cos``
  cost 3x the whole kernel on XLA's CPU backend, one value at a time), and
  3 more bits pick one of the square's 8 symmetries (swap the two, negate
  either), which carry that arc onto the whole circle without changing
  the distribution. ``half`` must be known when the kernel runs, not when
  it is traced: XLA compiles once per size.
  """
  w = tf.reshape(words[:2 * half], tf.stack([2, half]))
  u = (tf.cast(w[0], tf.float32) + 0.5) * 2.0**-32
  r = tf.sqrt(tf.math.log(u) * (-2.0 * stddev * stddev))
  a = w[1]
  x = ((tf.cast(tf.bitwise.right_shift(a, 9), tf.float32) + 0.5)
       * (math.pi / 4 * 2.0**-23))
  x2 = x * x
  sin = x + x * x2 * (_SIN[0] + x2 * (_SIN[1] + x2 * _SIN[2]))
  cos = 1.0 - 0.5 * x2 + x2 * x2 * (_COS[0] + x2 * (_COS[1] + x2 * _COS[2]))

  def bit(k):
    return tf.not_equal(tf.bitwise.bitwise_and(a, k), 0)

  swap = bit(1)
  c, s = tf.where(swap, sin, cos), tf.where(swap, cos, sin)
  c = tf.where(bit(2), -c, c)
  s = tf.where(bit(4), -s, s)
  return tf.concat([r * c, r * s], axis=0)


# Variables of at least this many values draw their noise one at a time
# (Noise.noised_mean); smaller ones draw theirs side by side.
LARGE = 1 << 16


class NoiseCounter:
  """The steps a :class:`Noise` has drawn for: an executor's state.

  A non-trainable int64 variable that each step with noise increments. The
  executor makes it where it applies the noise (a ``tf.Graph`` plan's build,
  the chief's update under ``SyncReplicasOptimizer``, a ``KerasPlan``'s
  ``privatize``, under the strategy scope it is declared in), once, so that
  its steps never repeat a draw; compiling makes no variable. It is saved
  with the plan: a ``tf.Graph`` plan's as a global variable, a
  ``KerasPlan``'s in ``tf.train.Checkpoint(plan=plan)`` (the plan tracks
  the variable), so a resumed run goes on counting instead of repeating,
  with the same seed, the draws of its first steps.

  Args:
    name: name of the variable.
  """

  def __init__(self, name: str = "dp_noise_step"):
    # Under a tf.distribute strategy the first replica's count is kept.
    self.variable = tf.Variable(
        0, dtype=tf.int64, trainable=False, name=name,
        aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)

  def advance(self) -> tf.Tensor:
    """Counts one step; returns its number (1 for the first)."""
    return self.variable.assign_add(1, read_value=True)


class Noise:
  """Gaussian noise that never repeats: a key and a step counter.

  Every draw is :func:`gaussian` with seed ``(key + j, step)``: ``j``
  numbers the large variables' draws (the small variables' joint draw
  comes after them) and ``step`` counts the steps, kept in the executor's
  :class:`NoiseCounter`. The key is the declared seed, or 62 bits from the
  operating system's entropy (``secrets``) when none was declared, so the
  noise is unpredictable. Compiling a private plan makes its noise
  (``core._rules.PrivacyRule``); it holds no TensorFlow state.

  Args:
    privacy: what the noise draws for (``sigma``, ``C``, the seed).
  """

  def __init__(self, privacy: Privacy):
    self.privacy = privacy
    self.key = (privacy.seed if privacy.seed is not None
                else secrets.randbits(62))

  def noised_mean(self, grads: Sequence[Gradient], batch_size,
                  counter: NoiseCounter, name: Optional[str] = None,
                  where=None, key=None, divided: bool = False) -> list:
    """``(g + N(0, sigma^2 C^2 I)) / B`` for each gradient (``None`` kept).

    The draws wait for every gradient, and those of large variables
    (:data:`LARGE`) take turns: each waits for the previous one's noised
    gradient; the small variables draw together, one draw per dtype. A
    draw's temporaries (twice its variable) then live beside the finished
    sums only, one large draw at a time, while the sums still
    run side by side: at two threads the 6x512 MLP's peak fell from 1.3x /
    1.5x the plain step's to 1.2x (docs/privacy.md, Cost); letting each sum
    also wait for the previous draw cost 1.3x the time. An ``IndexedSlices``
    gradient becomes dense: the noise covers every row. With
    ``noise_multiplier == 0`` no noise op is built. ``counter`` counts the
    steps that draw. ``where`` (a boolean
    scalar tensor, or ``None`` for always) says whether this replica adds
    the noise. ``key``, an int64 pair tensor, replaces the key and the step
    counter (:func:`_across_replicas`). With ``divided`` the gradients are
    ``g / B`` already (the clip factors were divided).
    """
    with tf.name_scope(name or "noised_mean"):
      sigma = self.privacy.noise_multiplier * self.privacy.l2_norm_clip
      step = None
      if sigma > 0:
        step = counter.advance()
      out: list = [None] * len(grads)
      done = [g.values if isinstance(g, tf.IndexedSlices) else g
              for g in grads if g is not None]
      turn: list = []  # the last large variable's noised gradient
      small: Dict[tf.DType, list] = {}  # (j, g) of small variables, by dtype
      for j in range(len(grads)):
        g = grads[j]
        if g is None:
          continue
        if isinstance(g, tf.IndexedSlices):
          g = tf.math.unsorted_segment_sum(
              g.values, g.indices, tf.cast(g.dense_shape[0], tf.int32))
        dtype = norm_dtype(g.dtype)
        b = tf.cast(batch_size, dtype)
        if not divided:
          g = g * tf.cast(1.0 / b, g.dtype)
        out[j] = g
        if step is None:
          continue
        size = g.shape.num_elements()
        if size is not None and size < LARGE:
          small.setdefault(dtype, []).append((j, g))
          continue
        shape = g.shape if g.shape.is_fully_defined() else tf.shape(g)
        with tf.control_dependencies(done + turn):
          z = gaussian(shape, self._seed(j, step, key), dtype,
                       self._stddev(sigma, batch_size, dtype, where))
        out[j] = g + tf.cast(z, g.dtype)
        turn = [out[j]]
      # The small variables draw together, one draw per dtype (a draw's
      # fixed cost, an XLA kernel's launch, is then paid once), with seed
      # indices after the variables'.
      for k, dtype in enumerate(sorted(small, key=lambda d: d.name)):
        sizes = [g.shape.num_elements() for _, g in small[dtype]]
        with tf.control_dependencies(done):
          z = gaussian([sum(sizes)], self._seed(len(grads) + k, step, key),
                       dtype, self._stddev(sigma, batch_size, dtype, where))
        for (j, g), part in zip(small[dtype], tf.split(z, sizes)):
          out[j] = g + tf.cast(tf.reshape(part, g.shape), g.dtype)
      return out

  def _seed(self, index: int, step, key) -> tf.Tensor:
    """The seed pair of draw ``index``: ``(key + index, step)``, or the
    replicas' reduced ``key`` plus ``(index, 0)``."""
    if key is None:
      return tf.stack([tf.constant(self.key + index, tf.int64), step])
    return key + tf.constant([index, 0], tf.int64)

  @staticmethod
  def _stddev(sigma: float, batch_size, dtype, where) -> tf.Tensor:
    """``sigma C / B``, 0 where this replica adds no noise."""
    stddev = sigma / tf.cast(batch_size, dtype)
    return stddev if where is None else stddev * tf.cast(where, dtype)
