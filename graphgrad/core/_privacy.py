"""Differential privacy: the ``privatize`` declaration and DP-SGD, once.

DP-SGD (Abadi et al. 2016) clips each example's whole gradient to L2 norm
``C``, sums, adds ``N(0, sigma^2 C^2 I)`` and divides by the batch size. The
per-example squared norms come from two tensors per parametric op, its input
``a`` and the gradient ``g`` at its output (ghost clipping: Goodfellow 2015,
Lee & Kifer 2021, Li et al. 2022): :func:`dense_sq_norms`,
:func:`embedding_sq_norms`, :func:`per_example_sq_norms`. Each executor finds
those tensors (the TF1 op graph, the Keras layer calls) as its :class:`Uses`;
:func:`private_gradients` is the algorithm for both: one VJP to the uses,
the norms, the clip factors :func:`clip_factors`, the clipped sums from the
same tensors (:func:`clipped_sum`, book-keeping) and :class:`Noise`.
"""

import dataclasses
import logging
import math
import secrets
from typing import (
  Any,
  Callable,
  Hashable,
  List,
  Mapping,
  Optional,
  Protocol,
  Sequence,
)

import numpy as np
import tensorflow as tf

from graphgrad import _errors
from graphgrad._types import Gradient
from graphgrad.analysis import _example_axis

log = logging.getLogger("graphgrad")

__all__ = ["Noise", "Privacy", "Reduction", "Uses", "broadcast_per_example",
           "check_per_example_loss", "check_privacy", "clip_factors",
           "clipped_sum", "combined_sq_norms", "conv_form", "dense_sq_norms",
           "embedding_sq_norms", "gaussian", "norm_dtype", "patches",
           "per_example_sq_norms", "private_gradients", "refuse_declarations",
           "rows", "unscaled_forms"]


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
      realized global batch size.
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


_REASONS = {
    "tasks": "combine_tasks mixes examples before the clip: its weights "
             "come from the whole batch, so one example changes every other "
             "example's gradient",
    "parameter_tasks": "combine_tasks(at='parameters') mixes examples "
                       "before the clip: its projections come from the "
                       "whole batch's task gradients",
    "upstream": "transform_upstream acts on the whole batch's gradient at the "
                "layer's outputs before the clip (a clip_by_norm of a "
                "boundary mixes examples), and the per-example norms are "
                "taken from the chain rule",
    "edge": "transform_edge acts on the whole batch's gradient of a boundary "
            "before the clip, and the per-example norms are taken from the "
            "chain rule",
    "backward": "replace_backward changes what each example's gradient is, "
                "and the per-example norms are taken from the chain rule",
    "override": "override_gradient changes what each example's gradient is, "
                "and the per-example norms are taken from the chain rule",
}


def refuse_declarations(declarations) -> None:
  """Refuses a declaration that acts before the clip, with the reason.

  Raises:
    GraphGradError: for a task combination (its weights come from the whole
      batch), an upstream or edge transform, a backward replacement or an
      op override (they rewrite the backward pass the norms are taken
      from). Parameter transforms act after the noise and are allowed.
  """
  for d in declarations:
    kind = d.kind.value
    if kind in _REASONS:
      where = f" on {d.layer!r}" if d.layer else ""
      raise _errors.GraphGradError(
          f"privatize cannot be combined with {kind} declarations{where}: "
          f"{_REASONS[kind]}. Declare it without privatize, or use "
          f"transform_gradients, which acts after the noise "
          f"(post-processing keeps the privacy guarantee).")


def norm_dtype(dtype) -> tf.DType:
  """float32, or float64 for float64 models: norms are never float16."""
  return tf.float64 if tf.as_dtype(dtype) == tf.float64 else tf.float32


# -- the norm rules ------------------------------------------------------------


def rows(x: tf.Tensor, batch, dtype, width: Optional[int] = None
         ) -> tf.Tensor:
  """``x`` as ``[B, T, width]`` in ``dtype`` (its leading axis is the
  batch)."""
  width = x.shape[-1] if width is None else width
  return tf.cast(tf.reshape(x, [batch, -1, width]), dtype)


def patches(x: tf.Tensor, kh: int, kw: int, strides, padding: str
            ) -> tf.Tensor:
  """The input patches of a 2-D convolution, ``[B, Ho, Wo, kh*kw*C]``.

  The depth is ordered as a ``[kh, kw, C, out]`` kernel reshaped to
  ``[kh*kw*C, out]``, so that the convolution is a dense op on them. With
  static spatial sizes they are one gather of the padded input's pixels
  (several times faster on a CPU than ``tf.image.extract_patches``, and
  than slices), or, for a patch of at most 16 values, a convolution with a
  one-hot kernel (each value is ``1 * x`` plus zeros: exact).

  Example:
    >>> import tensorflow as tf
    >>> x = tf.reshape(tf.range(32.0), [1, 4, 4, 2])
    >>> ref = tf.image.extract_patches(x, [1, 3, 3, 1], [1, 2, 2, 1],
    ...                                [1, 1, 1, 1], "SAME")
    >>> bool(tf.reduce_all(patches(x, 3, 3, [1, 2, 2, 1], "SAME") == ref))
    True
  """
  h, w, c = x.shape[1], x.shape[2], x.shape[3]
  sh, sw = strides[1], strides[2]
  if h is None or w is None or c is None:
    return tf.image.extract_patches(x, [1, kh, kw, 1], strides, [1, 1, 1, 1],
                                    padding)
  if kh * kw * c <= 16:
    eye = np.eye(kh * kw * c, dtype=x.dtype.as_numpy_dtype)
    return tf.nn.conv2d(x, eye.reshape(kh, kw, c, kh * kw * c),
                        [1, sh, sw, 1], padding)
  if padding == "SAME":
    ho, wo = -(-h // sh), -(-w // sw)
    ph = max((ho - 1) * sh + kh - h, 0)
    pw = max((wo - 1) * sw + kw - w, 0)
    x = tf.pad(x, [[0, 0], [ph // 2, ph - ph // 2], [pw // 2, pw - pw // 2],
                   [0, 0]])
    h, w = h + ph, w + pw
  else:
    ho, wo = (h - kh) // sh + 1, (w - kw) // sw + 1
  rows = np.arange(ho)[:, None, None, None] * sh + np.arange(kh)[:, None]
  cols = np.arange(wo)[:, None, None] * sw + np.arange(kw)
  pixels = (rows * w + cols).reshape(-1).astype(np.int32)  # [ho,wo,kh,kw]
  out = tf.gather(tf.reshape(x, [-1, h * w, c]), pixels, axis=1)
  return tf.reshape(out, [-1, ho, wo, kh * kw * c])


def conv_form(x: tf.Tensor, g: tf.Tensor, kernel_shape, strides,
              padding: str) -> tuple:
  """The form of a 2-D convolution's kernel use (NHWC, no dilation).

  ``x`` is the convolution's input, ``g`` the gradient at its output. The
  norms unfold ``x`` into :func:`patches` (a dense op on them); the clipped
  sum is one ``Conv2DBackpropFilter`` of ``x`` and ``c * g``, with no
  patches.
  """
  return ("conv", x, g, (tuple(int(d) for d in kernel_shape),
                         tuple(int(s) for s in strides), padding))


def _conv_rows(form, batch, dtype):
  """A conv form as the dense form of its patches."""
  _, x, g, (shape, strides, padding) = form
  kh, kw, cin = shape[:3]
  a = rows(patches(x, kh, kw, strides, padding), batch, dtype, kh * kw * cin)
  return ("dense", a, rows(g, batch, dtype))


def broadcast_per_example(p: tf.Tensor, var_shape, batch
                          ) -> Optional[tf.Tensor]:
  """``[B, *var_shape]``: ``p`` summed over the axes a variable is
  broadcast along (the per-example gradient of a bias or a scale).

  ``p`` is ``[B, ...]``, the product of the output gradient and what
  multiplies the variable; the variable lines up with ``p``'s trailing
  axes. ``None`` when the variable is not broadcast over the batch.

  Example:
    >>> import tensorflow as tf
    >>> p = tf.ones([2, 3, 4])  # a [4] bias on [B, T, 4] outputs
    >>> broadcast_per_example(p, [4], 2).numpy().tolist()
    [[3.0, 3.0, 3.0, 3.0], [3.0, 3.0, 3.0, 3.0]]
  """
  vs, rank = tf.TensorShape(var_shape), p.shape.rank
  if not vs.is_fully_defined() or rank is None or rank < 1:
    return None
  if vs.rank >= rank and (vs.rank > rank or vs[0] != 1):
    return None
  lead = rank - vs.rank  # axes the variable lacks, the batch's included
  shape = [1] * lead + vs.as_list()
  axes = [ax for ax in range(1, rank) if ax < lead or shape[ax] == 1]
  if axes:
    p = tf.reduce_sum(p, axis=axes, keepdims=True)
  tail = vs.as_list()[1:] if lead == 0 else vs.as_list()
  return tf.reshape(p, [batch] + tail)


def combined_sq_norms(forms, var_shape, batch, dtype) -> tf.Tensor:
  """``[B]`` squared norms of one variable's per-example gradients.

  ``forms`` are the variable's uses, each ``("dense", a, g)``,
  ``("embedding", ids, g)``, ``("example", per_example)`` or a
  :func:`conv_form` (a dense form of its patches here). A variable used
  several times (a shared layer, an unrolled loop) has the sum of its uses'
  gradients per example: uses of one kind are concatenated along ``T`` (the
  ghost norm then holds the cross terms); uses of several kinds are each
  made into per-example gradients ``[B, *var_shape]`` and summed.
  """
  forms = [_conv_rows(f, batch, dtype) if f[0] == "conv" else f
           for f in forms]
  kinds = {f[0] for f in forms}
  if kinds == {"dense"}:
    return dense_sq_norms(tf.concat([f[1] for f in forms], axis=1),
                          tf.concat([f[2] for f in forms], axis=1))
  if kinds == {"embedding"}:
    return embedding_sq_norms(tf.concat([f[1] for f in forms], axis=1),
                              tf.concat([f[2] for f in forms], axis=1))
  shape = [batch] + tf.TensorShape(var_shape).as_list()
  parts = []
  for f in forms:
    if f[0] == "dense":
      parts.append(tf.reshape(tf.matmul(f[1], f[2], transpose_a=True), shape))
    elif f[0] == "embedding":
      ids, g = f[1], f[2]
      vocab = shape[1]
      offset = ids + tf.range(tf.cast(batch, ids.dtype),
                              dtype=ids.dtype)[:, None] * vocab
      flat = tf.math.unsorted_segment_sum(
          tf.reshape(g, [-1, shape[2]]), tf.reshape(offset, [-1]),
          batch * vocab)
      parts.append(tf.reshape(flat, shape))
    else:
      parts.append(tf.cast(f[1], dtype))
  return per_example_sq_norms(tf.add_n(parts))


def dense_sq_norms(a: tf.Tensor, g: tf.Tensor,
                   name: Optional[str] = None) -> tf.Tensor:
  """Squared norms of the per-example gradients ``a_i^T g_i`` of a dense op.

  ``a`` is ``[B, T, p]`` (the op's input rows of each example), ``g`` is
  ``[B, T, q]`` (the gradient at its output rows). The gradient of the
  weight for example ``i`` is ``sum_t a_it g_it^T``. With ``T == 1`` its
  squared norm is ``||a_i||^2 ||g_i||^2``; else the ghost norm
  ``sum_{t,s} (a_it . a_is)(g_it . g_is)`` (cost ``T^2 (p + q)``), or the
  per-example product's squared entries (cost ``T p q``), whichever is
  cheaper for the static shapes. A convolution is a dense op on its
  unfolded patches.

  Example:
    >>> import numpy as np, tensorflow as tf
    >>> a, g = np.ones([1, 2, 3], np.float32), np.ones([1, 2, 1], np.float32)
    >>> float(dense_sq_norms(tf.constant(a), tf.constant(g))[0])  # 2 * ones
    12.0
  """
  with tf.name_scope(name or "dense_sq_norms"):
    t, p, q = a.shape[1], a.shape[2], g.shape[2]
    if t == 1:
      return (tf.reduce_sum(tf.square(a), axis=[1, 2])
              * tf.reduce_sum(tf.square(g), axis=[1, 2]))
    ghost = t is None or p is None or q is None or t * t * (p + q) <= t * p * q
    if ghost:
      aa = tf.matmul(a, a, transpose_b=True)
      gg = tf.matmul(g, g, transpose_b=True)
      return tf.reduce_sum(aa * gg, axis=[1, 2])
    per_example = tf.matmul(a, g, transpose_a=True)  # [B, p, q]
    return tf.reduce_sum(tf.square(per_example), axis=[1, 2])


def embedding_sq_norms(ids: tf.Tensor, g: tf.Tensor,
                       name: Optional[str] = None) -> tf.Tensor:
  """Squared norms of the per-example gradients of an embedding table.

  ``ids`` is ``[B, T]``, ``g`` is ``[B, T, D]`` (the gradient at the
  looked-up rows). Example ``i``'s gradient holds, at row ``v``, the sum of
  the ``g_it`` with ``ids_it == v``, so its squared norm is
  ``sum_{t,s} [ids_it == ids_is] (g_it . g_is)``: repeated ids add up before
  squaring. No ``[B, vocabulary, D]`` tensor is made.

  Example:
    >>> import tensorflow as tf
    >>> ids = tf.constant([[3, 3]])  # one example looking up row 3 twice
    >>> g = tf.constant([[[1.0, 0.0], [1.0, 0.0]]])
    >>> float(embedding_sq_norms(ids, g)[0])  # ||(2, 0)||^2
    4.0
  """
  with tf.name_scope(name or "embedding_sq_norms"):
    same = tf.cast(tf.equal(ids[:, :, None], ids[:, None, :]), g.dtype)
    return tf.reduce_sum(same * tf.matmul(g, g, transpose_b=True), axis=[1, 2])


def per_example_sq_norms(per_example: tf.Tensor,
                         name: Optional[str] = None) -> tf.Tensor:
  """Squared norms of per-example gradients ``[B, ...]`` (biases, scales,
  and the exact fallback)."""
  with tf.name_scope(name or "per_example_sq_norms"):
    flat = tf.reshape(per_example, [tf.shape(per_example)[0], -1])
    return tf.reduce_sum(tf.square(flat), axis=1)


def clipped_sum(forms, c: tf.Tensor, var_shape, batch, dtype,
                name: Optional[str] = None) -> tf.Tensor:
  """``sum_i c_i grad_i`` of one variable from the forms of its uses.

  Book-keeping (Bu et al. 2023): the clipped sum is linear in each use's
  per-example gradient, so it comes from the boundary tensors the norms were
  taken from, without a second backward pass: a dense use gives
  ``A^T (c * G)`` over all rows, an embedding the rows ``c_i g_it`` summed
  at their ids, a per-example gradient ``sum_i c_i P_i``, a convolution
  the filter gradient of its input and ``c * G``.

  Example:
    >>> import tensorflow as tf
    >>> a = tf.ones([2, 1, 3]); g = tf.ones([2, 1, 1])
    >>> clipped_sum([("dense", a, g)], tf.constant([1.0, 0.5]), [3, 1], 2,
    ...             tf.float32).numpy().ravel().tolist()
    [1.5, 1.5, 1.5]
  """
  with tf.name_scope(name or "clipped_sum"):
    shape = tf.TensorShape(var_shape)
    parts = []
    for f in forms:
      if f[0] == "dense":
        a, g = f[1], f[2]
        cg = g * tf.cast(c, g.dtype)[:, None, None]
        flat = tf.matmul(tf.reshape(a, [-1, a.shape[-1]]),
                         tf.reshape(cg, [-1, g.shape[-1]]), transpose_a=True)
        parts.append(tf.reshape(flat, shape))
      elif f[0] == "conv":
        parts.append(_conv_clipped_sum(f, c, shape))
      elif f[0] == "embedding":
        ids, g = f[1], f[2]
        cg = g * tf.cast(c, g.dtype)[:, None, None]
        parts.append(tf.math.unsorted_segment_sum(
            tf.reshape(cg, [-1, shape[-1]]), tf.reshape(ids, [-1]),
            shape[0]))
      else:
        p = tf.cast(f[1], tf.cast(c, f[1].dtype).dtype)
        parts.append(tf.tensordot(tf.cast(c, p.dtype), p, axes=1))
    return tf.cast(tf.add_n(parts), dtype)


def _conv_clipped_sum(form, c: tf.Tensor, shape) -> tf.Tensor:
  """``sum_i c_i grad_i`` of a conv form: ``c`` scales the smaller of the
  input and the output gradient, then one filter gradient."""
  _, x, g, (_, strides, padding) = form
  dtype = c.dtype
  x, g = tf.cast(x, dtype), tf.cast(g, dtype)
  nx, ng = x.shape[1:].num_elements(), g.shape[1:].num_elements()
  if nx is not None and ng is not None and nx < ng:
    x = x * c[:, None, None, None]
  else:
    g = g * c[:, None, None, None]
  return tf.compat.v1.nn.conv2d_backprop_filter(
      x, shape.as_list(), g, list(strides), padding)


def clip_factors(sq_norms: Sequence[tf.Tensor], l2_norm_clip: float,
                 dtype, name: Optional[str] = None) -> tf.Tensor:
  """``c_i = min(1, C / ||g_i||)`` from the parts of each squared norm.

  The result is a constant of the backward pass (``stop_gradient``): the
  gradient of ``sum_i c_i l_i`` is ``sum_i clip_C(grad l_i)``.

  Example:
    >>> import tensorflow as tf
    >>> c = clip_factors([tf.constant([1.0, 16.0]), tf.constant([0.0, 9.0])],
    ...                  1.0, tf.float32)
    >>> [round(float(x), 3) for x in c]  # norms 1 and 5
    [1.0, 0.2]
  """
  with tf.name_scope(name or "clip_factors"):
    total = tf.add_n(list(sq_norms))
    norms = tf.sqrt(total)
    clip = tf.constant(l2_norm_clip, total.dtype)
    c = clip / tf.maximum(norms, clip)
    return tf.stop_gradient(tf.cast(c, dtype))


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
                      uses: Uses, noise: "Noise",
                      reduction: Optional[Reduction] = None,
                      scale=None, seed=None
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
    noise: the plan's :class:`Noise`.
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
  """
  if not tf.executing_eagerly():
    _example_axis.refuse_mixing(loss)
  with tf.name_scope("privatize"):
    batch = tf.shape(loss)[0]
    outputs = uses.outputs()
    forms = uses.forms(
        vjp.vjp([loss], [tf.ones_like(loss) if seed is None else seed],
                outputs) if outputs else [],
        batch)
    if scale is not None:
      forms = {k: unscaled_forms(f, scale) for k, f in forms.items()}
    keys = [uses.key(v) for v in variables]
    known = [(k, v) for k, v in zip(keys, variables) if k in forms]
    missing = [v for k, v in zip(keys, variables) if k not in forms]
    if missing:
      for v, g in zip(missing, vjp.vjp([loss], [tf.ones_like(loss)],
                                       missing)):
        if g is not None:
          uses.refuse_outside(v)
    if not known:
      return [None] * len(keys)
    sq_norms = [combined_sq_norms(forms[k], v.shape, batch,
                                  norm_dtype(v.dtype)) for k, v in known]
    c = clip_factors(sq_norms, noise.privacy.l2_norm_clip,
                     norm_dtype(loss.dtype))
    if scale is not None:  # an overflow: no clip factor may hide it (0 * inf)
      finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(n))
                              for n in sq_norms])
      c = tf.where(finite, c, tf.constant(float("nan"), c.dtype))
    if reduction is None:  # the mean's division folded into c: [B] values
      divisor, first = _global_batch(batch,
                                     noise.privacy.expected_batch_size)
      c = c / tf.cast(divisor, c.dtype)
    sums = {k: clipped_sum(forms[k], c, v.shape, batch, v.dtype)
            for k, v in known}
    if reduction is not None:
      reduced, divisor, key = _across_replicas(
          reduction, [v for _, v in known], [sums[k] for k, _ in known],
          batch, noise)
      sums = dict(zip([k for k, _ in known], reduced))
      out = noise.noised_mean([sums.get(k) for k in keys], divisor, key=key)
    else:
      out = noise.noised_mean([sums.get(k) for k in keys], divisor,
                              where=first, divided=True)
    if scale is None:
      return out
    return [None if g is None else g * tf.cast(scale, g.dtype) for g in out]


def unscaled_forms(forms: Sequence[tuple], scale) -> list:
  """``forms`` with each gradient divided by the loss scale ``S``.

  The division is in float32 (float64 for float64 gradients), never in
  float16: the norms and clipped sums then see the true per-example
  gradients. A dense use's input is cast alike, for the sum's matmul.

  Example:
    >>> import tensorflow as tf
    >>> f = unscaled_forms([("example", tf.constant([[512.0]], tf.float16))],
    ...                    tf.constant(256.0))
    >>> f[0][1].dtype.name, float(f[0][1][0, 0])
    ('float32', 2.0)
  """
  def unscale(x):
    dtype = norm_dtype(x.dtype)
    return tf.cast(x, dtype) / tf.cast(scale, dtype)

  out: List[tuple] = []
  for f in forms:
    if f[0] == "dense":
      g = unscale(f[2])
      out.append(("dense", tf.cast(f[1], g.dtype), g))
    elif f[0] == "embedding":
      out.append(("embedding", f[1], unscale(f[2])))
    elif f[0] == "conv":
      out.append(("conv", tf.cast(f[1], norm_dtype(f[1].dtype)),
                  unscale(f[2]), f[3]))
    else:
      out.append((f[0], unscale(f[1])))
  return out


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
  """Normal values of standard deviation ``stddev`` from Philox uniforms
  by Box-Muller.

  ``tf.random.stateless_normal`` draws them the same way but computes one
  pair per value; this keeps both values of each pair (``r cos t`` and
  ``r sin t``), which halves the cost of the noise on a CPU, and scales
  ``r`` (half the values) rather than the result.

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
  u = tf.random.stateless_uniform(
      tf.stack([2, half]) if tf.is_tensor(half) else [2, half], seed,
      minval=1e-30, maxval=1.0, dtype=dtype)
  stddev = tf.cast(stddev, dtype)
  r = tf.sqrt(tf.math.log(u[0]) * (-2.0 * stddev * stddev))
  t = (2.0 * math.pi) * u[1]
  z = tf.concat([r * tf.cos(t), r * tf.sin(t)], axis=0)
  even = not tf.is_tensor(n) and n % 2 == 0
  return tf.reshape(z if even else z[:n], shape)


class Noise:
  """Gaussian noise that never repeats: a key and a step counter.

  Every draw is ``stateless_normal`` with seed ``(key + j, step)``: ``j``
  numbers the variables and ``step`` counts the draws, kept in a
  non-trainable int64 variable that each step increments. The key is the
  declared seed, or 63 bits from the operating system's entropy
  (``secrets``) when none was declared, so the noise is unpredictable.

  Args:
    privacy: the declaration.
    name: name of the step counter variable.
  """

  def __init__(self, privacy: Privacy, name: str = "dp_noise_step"):
    self.privacy = privacy
    self.key = (privacy.seed if privacy.seed is not None
                else secrets.randbits(62))
    # Under a tf.distribute strategy the first replica's count is kept.
    self.counter = tf.Variable(
        0, dtype=tf.int64, trainable=False, name=name,
        aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)

  def noised_mean(self, grads: Sequence[Gradient], batch_size,
                  name: Optional[str] = None, where=None, key=None,
                  divided: bool = False) -> list:
    """``(g + N(0, sigma^2 C^2 I)) / B`` for each gradient (``None`` kept).

    An ``IndexedSlices`` gradient becomes dense: the noise covers every
    row. With ``noise_multiplier == 0`` no noise op is built. ``where`` (a
    boolean scalar tensor, or ``None`` for always) says whether this
    replica adds the noise. ``key``, an int64 pair tensor, replaces the
    key and the step counter (:func:`_across_replicas`). With ``divided``
    the gradients are ``g / B`` already (the clip factors were divided).
    """
    with tf.name_scope(name or "noised_mean"):
      sigma = self.privacy.noise_multiplier * self.privacy.l2_norm_clip
      step = None
      if sigma > 0:
        step = self.counter.assign_add(1, read_value=True)
      out: list = []
      for j, g in enumerate(grads):
        if g is None:
          out.append(None)
          continue
        if isinstance(g, tf.IndexedSlices):
          g = tf.math.unsorted_segment_sum(
              g.values, g.indices, tf.cast(g.dense_shape[0], tf.int32))
        dtype = norm_dtype(g.dtype)
        b = tf.cast(batch_size, dtype)
        if not divided:
          g = g * tf.cast(1.0 / b, g.dtype)
        if step is not None:
          seed = (tf.stack([tf.constant(self.key + j, tf.int64), step])
                  if key is None else key + tf.constant([j, 0], tf.int64))
          stddev = sigma / b  # 0 where this replica adds no noise
          if where is not None:
            stddev = stddev * tf.cast(where, dtype)
          shape = g.shape if g.shape.is_fully_defined() else tf.shape(g)
          g = g + tf.cast(gaussian(shape, seed, dtype, stddev), g.dtype)
        out.append(g)
      return out
