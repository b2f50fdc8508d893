"""Per-example forms: the tensors one use of a variable gives DP-SGD.

Each executor describes where a variable meets the examples as forms, one
per use, built by a rule registered for the use's op type (TF1) or layer
type (Keras): :class:`DenseForm` (the input rows of a dense op and the
gradient at its output), :class:`Conv2DForm`, :class:`EmbeddingForm` (ids
and the gradient at the looked-up rows) and :class:`PerExampleForm` (the
per-example gradients themselves). A form knows its per-example squared
norms, without the per-example gradients where it can (ghost clipping:
Goodfellow 2015, Lee & Kifer 2021, Li et al. 2022), its clipped sum from
the same tensors (book-keeping, Bu et al. 2023), its form with the loss
scale divided out, and its form divided to entries of about 1 (against
overflow). :mod:`graphgrad.core._clipping` combines the forms of a step.
"""

import abc
import dataclasses
from typing import Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from graphgrad import _errors

__all__ = ["Conv2DForm", "DenseForm", "EmbeddingForm", "Form",
           "PerExampleForm", "after", "broadcast_per_example",
           "dense_sq_norms", "einsum_dense", "embedding_sq_norms",
           "examples_first", "norm_dtype", "patches", "per_example_sq_norms",
           "rows"]


def examples_first(x: tf.Tensor, batch, who: str, kind: str = "") -> list:
  """Checks that the leading axis of ``x`` holds the batch's examples.

  Every form reads rows ``[B, ...]``: a time-major ``[T, B, ...]`` tensor
  would silently mix examples. Where both sizes are known the check is
  done here; else its op is returned, for the caller to wait on
  (:func:`after`).

  Args:
    x: the tensor whose leading axis must be the batch.
    batch: the batch size, a scalar tensor.
    who: what ``x`` is, for messages (``"the input of layer 'd'"``).
    kind: said after ``who`` in the message raised here (``" (Dense)"``).

  Returns:
    The run-time check ops (none where the sizes are known).

  Raises:
    UnsupportedGraphError: when ``x`` is a scalar or its known leading
      size is not the known batch size.
  """
  n = tf.get_static_value(batch)
  lead = x.shape[0] if x.shape.rank else None
  fix = ("its per-example gradients cannot be computed. Pass the examples "
         "into and out of the layer as tensors of shape [batch, ...] "
         "(transpose time-major data to [batch, time, ...] around it), or "
         "train without privatize.")
  if x.shape.rank == 0 or (n is not None and lead is not None and lead != n):
    raise _errors.UnsupportedGraphError(
        f"privatize: {who}{kind} has shape {x.shape}, not the "
        f"{'' if n is None else f'{n} '}examples of the batch along its "
        f"first axis, so {fix}")
  if n is not None and lead is not None:
    return []
  return [tf.debugging.assert_equal(
      tf.shape(x, out_type=batch.dtype)[0], batch,
      message=f"privatize: the leading axis of {who} is not the batch, "
              f"so {fix}")]


def after(checks: Sequence, x: tf.Tensor) -> tf.Tensor:
  """``x``, once ``checks`` have run."""
  if not checks:
    return x
  with tf.control_dependencies(list(checks)):
    return tf.identity(x)


def norm_dtype(dtype) -> tf.DType:
  """float32, or float64 for float64 models: norms are never float16."""
  return tf.float64 if tf.as_dtype(dtype) == tf.float64 else tf.float32


def rows(x: tf.Tensor, batch, dtype, width: Optional[int] = None
         ) -> tf.Tensor:
  """``x`` as ``[B, T, width]`` in ``dtype`` (its leading axis is the
  batch)."""
  width = x.shape[-1] if width is None else width
  return tf.cast(tf.reshape(x, [batch, -1, width]), dtype)


def _peak(x: tf.Tensor) -> tf.Tensor:
  """``[B]``: each example's largest absolute entry, 1 where all are 0."""
  m = tf.reduce_max(tf.abs(tf.reshape(x, [tf.shape(x)[0], -1])), axis=1)
  return tf.where(m > 0, m, tf.ones_like(m))


def _over(x: tf.Tensor, m: tf.Tensor, dtype) -> tf.Tensor:
  """``x`` (cast to ``dtype``) divided by ``m``, one value per example."""
  x = tf.cast(x, dtype)
  return x / tf.reshape(m, tf.concat([[-1], tf.ones([tf.rank(x) - 1],
                                                     tf.int32)], 0))


def _per_example_c(c: tf.Tensor, like: tf.Tensor) -> tf.Tensor:
  """The clip factors ``[B]`` in ``like``'s dtype, broadcast over its
  other axes."""
  return tf.reshape(tf.cast(c, like.dtype),
                    [-1] + [1] * (like.shape.rank - 1))


class Form(abc.ABC):
  """One use of a variable: the tensors its per-example gradients follow
  from.

  A variable used several times (a shared layer, an unrolled loop) has the
  sum of its uses' gradients per example; :meth:`sq_norms` takes all its
  uses of one class together, so that their cross terms are counted.
  """

  @classmethod
  def sq_norms(cls, forms: Sequence["Form"], var_shape, batch, dtype
               ) -> tf.Tensor:
    """``[B]`` squared norms of the per-example sum of ``forms`` (uses of
    this class), in ``dtype``. By default through the per-example
    gradients."""
    return per_example_sq_norms(tf.add_n(
        [f.per_example(var_shape, batch, dtype) for f in forms]))

  @abc.abstractmethod
  def per_example(self, var_shape, batch, dtype) -> tf.Tensor:
    """``[B, *var_shape]``: the per-example gradients, in ``dtype``."""

  @abc.abstractmethod
  def clipped_sum(self, c: tf.Tensor, var_shape) -> tf.Tensor:
    """``sum_i c_i grad_i`` (``var_shape``), from the clip factors ``c``
    (``[B]``), without the per-example gradients where the form can."""

  @abc.abstractmethod
  def unscaled(self, scale) -> "Form":
    """The form of the true gradients when the backward pass carried the
    loss scale ``S``: divided by ``S`` in float32 (float64 for float64
    gradients), never in float16."""

  def input_peak(self, dtype) -> Optional[tf.Tensor]:
    """``[B]`` largest entries of the factor that is not a gradient (a
    dense op's input), ``None`` for a form that has none."""
    return None

  @abc.abstractmethod
  def gradient_peak(self, u: tf.Tensor, dtype) -> tf.Tensor:
    """``[B]`` largest entries of the gradient factor, once the form is
    divided by the input peaks ``u`` (:meth:`divided`)."""

  @abc.abstractmethod
  def divided(self, u: tf.Tensor, w: tf.Tensor, dtype) -> "Form":
    """The form whose per-example gradients are those of this one divided
    by ``u_i w_i``: the input factor by ``u``, the gradient by ``w``."""


# -- a dense op: input rows and output gradient --------------------------------


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


@dataclasses.dataclass(frozen=True, eq=False)
class DenseForm(Form):
  """A dense use: ``y_it = a_it W`` for each example ``i`` and row ``t``.

  Attributes:
    a: the input rows ``[B, T, p]``, in the norms' dtype.
    g: the gradient at the output rows ``[B, T, q]``, in the same dtype.
  """
  a: tf.Tensor
  g: tf.Tensor

  @classmethod
  def sq_norms(cls, forms, var_shape, batch, dtype):
    """The uses' rows concatenated along ``T``: the ghost norm then holds
    the cross terms (:func:`dense_sq_norms`)."""
    return dense_sq_norms(tf.concat([f.a for f in forms], axis=1),
                          tf.concat([f.g for f in forms], axis=1))

  def per_example(self, var_shape, batch, dtype):
    shape = [batch] + tf.TensorShape(var_shape).as_list()
    return tf.reshape(tf.matmul(self.a, self.g, transpose_a=True), shape)

  def clipped_sum(self, c, var_shape):
    """``A^T (c * G)`` over all rows."""
    cg = self.g * _per_example_c(c, self.g)
    flat = tf.matmul(tf.reshape(self.a, [-1, self.a.shape[-1]]),
                     tf.reshape(cg, [-1, self.g.shape[-1]]), transpose_a=True)
    return tf.reshape(flat, tf.TensorShape(var_shape))

  def unscaled(self, scale):
    g = _unscale(self.g, scale)
    return DenseForm(tf.cast(self.a, g.dtype), g)

  def input_peak(self, dtype):
    return _peak(tf.cast(self.a, dtype))

  def gradient_peak(self, u, dtype):
    return _peak(tf.cast(self.g, dtype))

  def divided(self, u, w, dtype):
    return DenseForm(_over(self.a, u, dtype), _over(self.g, w, dtype))


def einsum_dense(equation: str, x: tf.Tensor, g: tf.Tensor, kernel_shape,
                 batch, dtype) -> Optional[DenseForm]:
  """The dense form of ``einsum(equation, x, kernel)``, or ``None``.

  An einsum is a dense op when it reads ``"<lead><in>,<in><out>-><lead>
  <out>"``: the kernel's leading axes (``<in>``) contract the input's
  trailing ones, its other axes (``<out>``) are the output's trailing ones,
  and the examples stay on the leading axis (``<lead>``: letters, or an
  ellipsis, with the batch first). Keras' ``EinsumDense`` (the projections
  of ``MultiHeadAttention``) and a TF1 ``Einsum`` op are then the rows
  ``[B, T, prod(in)]`` and ``[B, T, prod(out)]`` of a dense op whose
  weight is the kernel flattened to ``[prod(in), prod(out)]``.

  Example:
    >>> import tensorflow as tf
    >>> x, g = tf.ones([2, 3, 4]), tf.ones([2, 3, 5, 6])  # heads 5, size 6
    >>> f = einsum_dense("abc,cde->abde", x, g, [4, 5, 6], 2, tf.float32)
    >>> f.a.shape.as_list(), f.g.shape.as_list()
    ([2, 3, 4], [2, 3, 30])
  """
  split = _einsum_split(equation)
  shape = tf.TensorShape(kernel_shape)
  if split is None or not shape.is_fully_defined() or x.shape.rank is None:
    return None
  n_in, lead = split
  letters = len(lead.replace("...", ""))
  if "..." not in lead:
    fits = x.shape.rank == letters + n_in
  else:  # the batch is the ellipsis' first axis, or the lead's first letter
    fits = x.shape.rank >= letters + n_in + lead.startswith("...")
  if not fits:
    return None
  dims = shape.as_list()
  p, q = int(np.prod(dims[:n_in])), int(np.prod(dims[n_in:]))
  return DenseForm(rows(x, batch, dtype, p), rows(g, batch, dtype, q))


def _einsum_split(equation: str) -> Optional[Tuple[int, str]]:
  """``(number of contracted axes, the lead's subscripts)`` of a dense
  einsum (:func:`einsum_dense`), ``None`` for another one."""
  eq = equation.replace(" ", "")
  if eq.count("->") != 1 or eq.count(",") != 1:
    return None
  lhs, out = eq.split("->")
  x, k = lhs.split(",")
  if "." in k or len(set(k)) != len(k):
    return None
  for n_in in range(1, len(k)):
    ins, outs = k[:n_in], k[n_in:]
    if not (x.endswith(ins) and out.endswith(outs)):
      continue
    lead = x[:-n_in]
    if not lead or lead != out[:-len(outs)]:
      continue
    letters = lead.replace("...", "")
    if ("." in letters or len(set(letters)) != len(letters)
        or set(letters) & set(k)):
      continue
    return n_in, lead
  return None


# -- a 2-D convolution ---------------------------------------------------------


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
  flat, pixels, ho, wo, _ = _pixels(x, kh, kw, sh, sw, padding)
  out = tf.gather(flat, pixels.reshape(-1), axis=1)  # [B, ho*wo*kh*kw, c]
  return tf.reshape(out, [-1, ho, wo, kh * kw * c])


def _pixels(x, kh, kw, sh, sw, padding, pad: bool = True):
  """``x`` flattened to ``[B, H*W, C]``, the index of the pixel each
  output position reads at each kernel offset, ``[ho, wo, kh, kw]``, and
  ``ho, wo`` (static spatial sizes). With ``pad``, ``x`` is padded first;
  without, a pixel of the padding reads a clamped pixel, and the fifth
  result, ``[ho, wo, kh, kw]`` booleans (``None`` for all), says which
  are inside the input."""
  h, w = x.shape[1], x.shape[2]
  if padding == "SAME":
    ho, wo = -(-h // sh), -(-w // sw)
    ph = max((ho - 1) * sh + kh - h, 0)
    pw = max((wo - 1) * sw + kw - w, 0)
  else:
    ho, wo, ph, pw = (h - kh) // sh + 1, (w - kw) // sw + 1, 0, 0
  at_rows = (np.arange(ho)[:, None, None, None] * sh + np.arange(kh)[:, None]
             + np.zeros([1, wo, 1, kw], np.int64))
  at_cols = (np.arange(wo)[:, None, None] * sw + np.arange(kw)
             + np.zeros([ho, 1, kh, 1], np.int64))
  if pad and (ph or pw):
    x = tf.pad(x, [[0, 0], [ph // 2, ph - ph // 2], [pw // 2, pw - pw // 2],
                   [0, 0]])
    h, w, inside = h + ph, w + pw, None
  else:
    at_rows, at_cols = at_rows - ph // 2, at_cols - pw // 2
    inside = ((at_rows >= 0) & (at_rows < h) & (at_cols >= 0)
              & (at_cols < w))
    at_rows, at_cols = np.clip(at_rows, 0, h - 1), np.clip(at_cols, 0, w - 1)
    inside = None if inside.all() else inside
  pixels = (at_rows * w + at_cols).astype(np.int32)
  return tf.reshape(x, [-1, h * w, x.shape[3]]), pixels, ho, wo, inside


def _offset(grid, i: int, j: int, dtype) -> tf.Tensor:
  """``[B, ho*wo, C]``: the pixels a convolution reads at offset ``(i, j)``
  (:func:`_pixels` without padding), those of the padding zero."""
  flat, pixels, _, _, inside = grid
  a = tf.cast(tf.gather(flat, pixels[:, :, i, j].reshape(-1), axis=1), dtype)
  if inside is None or inside[:, :, i, j].all():
    return a
  mask = inside[:, :, i, j].reshape(-1, 1).astype(dtype.as_numpy_dtype)
  return a * mask


@dataclasses.dataclass(frozen=True, eq=False)
class Conv2DForm(Form):
  """A 2-D convolution's kernel use (NHWC, no dilation).

  The norms take the cheapest exact way for the layer's sizes
  (:meth:`method`); the clipped sum is one ``Conv2DBackpropFilter`` of
  ``x`` and ``c * g``, with no patches.

  Attributes:
    x: the convolution's input ``[B, H, W, C]``.
    g: the gradient at its output ``[B, Ho, Wo, out]``.
    kernel_shape: ``(kh, kw, C, out)``.
    strides: the four strides, NHWC.
    padding: ``"SAME"`` or ``"VALID"``.
  """
  x: tf.Tensor
  g: tf.Tensor
  kernel_shape: Tuple[int, ...]
  strides: Tuple[int, ...]
  padding: str

  def __post_init__(self):
    object.__setattr__(self, "kernel_shape",
                       tuple(int(d) for d in self.kernel_shape))
    object.__setattr__(self, "strides", tuple(int(s) for s in self.strides))

  @classmethod
  def method(cls, forms: Sequence["Conv2DForm"]) -> str:
    """The cheapest exact way to the norms of ``forms`` (uses of one
    kernel ``[kh, kw, C, out]``), by their static sizes, with ``T`` the
    output positions and ``p = kh kw C``:

    * ``"patches"``: the dense form of the unfolded patches (its ghost
      norm or per-example product, :func:`dense_sq_norms`) where sizes are
      dynamic, where a patch has at most 16 values (unfolded by a one-hot
      convolution), where the ghost norm is the cheaper product
      (``T (p + out) <= p out``: few positions), or for 2 to 15 input
      channels (one gather of ``p``-wide rows beats ``kh kw`` gathers of
      narrow ones);
    * ``"depthwise"``: one input channel and a larger kernel (equal
      strides): the per-example products as one depthwise filter gradient
      whose channels are the examples, with no patches;
    * ``"offsets"``: otherwise (16 channels and more), the per-example
      product one kernel offset at a time, never holding the patches.

    ``benchmarks/privacy_conv.py`` times them on the tutorial convnet's
    layers: its 8x8 one-channel layer takes 1.05 ms by ``"depthwise"``
    against 7.0 ms one offset at a time (batch 128, one thread).
    """
    (kh, kw, cin, cout), t = forms[0].kernel_shape, 0
    for f in forms:
      if None in (f.x.shape[1], f.x.shape[2], f.x.shape[3], f.g.shape[1],
                  f.g.shape[2]):
        return "patches"
      t += f.g.shape[1] * f.g.shape[2]
    p = kh * kw * cin
    if p <= 16 or t * (p + cout) <= p * cout or 2 <= cin < 16:
      return "patches"
    if cin == 1 and all(f.strides[1] == f.strides[2] for f in forms):
      return "depthwise"
    return "offsets"

  @classmethod
  def sq_norms(cls, forms, var_shape, batch, dtype):
    """By :meth:`method`."""
    method = cls.method(forms)
    if method == "offsets":
      return cls._offset_sq_norms(forms, dtype)
    if method == "depthwise":
      return per_example_sq_norms(tf.add_n(
          [f._depthwise_per_example(dtype) for f in forms]))
    return DenseForm.sq_norms([f.as_dense(batch, dtype) for f in forms],
                              var_shape, batch, dtype)

  def _depthwise_per_example(self, dtype) -> tf.Tensor:
    """``[B, kh, kw, 1, out]``, the per-example kernel gradients of a
    one-channel input: a depthwise filter gradient whose input channels are
    the examples (``[1, H, W, B]``) and whose channel multiplier is
    ``out``."""
    kh, kw, _, cout = self.kernel_shape
    # Read once the gradient is there, not when the forward pass made x.
    with tf.control_dependencies([self.g]):
      x = tf.transpose(tf.cast(self.x, dtype), [3, 1, 2, 0])
    g = tf.cast(self.g, dtype)
    b = tf.shape(g)[0]
    g = tf.reshape(tf.transpose(g, [1, 2, 0, 3]),
                   [1, g.shape[1], g.shape[2], -1])  # channels (b, out)
    per = tf.nn.depthwise_conv2d_backprop_filter(
        x, tf.stack([kh, kw, b, cout]), g, list(self.strides),
        self.padding)  # [kh, kw, B, out]
    return tf.transpose(per, [2, 0, 1, 3])[:, :, :, None, :]

  @classmethod
  def _offset_sq_norms(cls, forms, dtype) -> tf.Tensor:
    """``[B]`` squared norms one kernel offset at a time: ``sum_k ||sum_t
    x_{t+k} g_t^T||^2``, the per-example product without the patches (a
    ``[B, T, C]`` slice at a time, not ``[B, T, kh*kw*C]``); static
    spatial sizes."""
    kh, kw, _, cout = forms[0].kernel_shape
    # Unpadded (a padded copy would live through every offset), each offset
    # read once the gradient is there, not during the forward pass.
    grids = [_pixels(f.x, kh, kw, f.strides[1], f.strides[2], f.padding,
                     pad=False) for f in forms]
    g = tf.concat([tf.reshape(tf.cast(f.g, dtype),
                              [tf.shape(f.g)[0], -1, cout]) for f in forms], 1)
    total = None
    for i in range(kh):
      for j in range(kw):
        with tf.control_dependencies([g] if total is None else [total]):
          a = tf.concat([_offset(grid, i, j, dtype) for grid in grids], 1)
        sq = tf.reduce_sum(tf.square(tf.matmul(a, g, transpose_a=True)),
                           axis=[1, 2])
        total = sq if total is None else total + sq
    return total

  def as_dense(self, batch, dtype) -> DenseForm:
    """The dense form of the patches."""
    kh, kw, cin = self.kernel_shape[:3]
    # Unfolded once the gradient is there, not when the forward pass made
    # x: the patches then live beside the norms alone, not the backward
    # pass.
    with tf.control_dependencies([self.g]):
      a = rows(patches(self.x, kh, kw, self.strides, self.padding), batch,
               dtype, kh * kw * cin)
    return DenseForm(a, rows(self.g, batch, dtype))

  def per_example(self, var_shape, batch, dtype):
    return self.as_dense(batch, dtype).per_example(var_shape, batch, dtype)

  def clipped_sum(self, c, var_shape):
    """``c`` scales the smaller of the input and the output gradient, then
    one filter gradient."""
    dtype = c.dtype
    x, g = tf.cast(self.x, dtype), tf.cast(self.g, dtype)
    nx, ng = x.shape[1:].num_elements(), g.shape[1:].num_elements()
    if nx is not None and ng is not None and nx < ng:
      x = x * c[:, None, None, None]
    else:
      g = g * c[:, None, None, None]
    return tf.compat.v1.nn.conv2d_backprop_filter(
        x, tf.TensorShape(var_shape).as_list(), g, list(self.strides),
        self.padding)

  def unscaled(self, scale):
    return dataclasses.replace(
        self, x=tf.cast(self.x, norm_dtype(self.x.dtype)),
        g=_unscale(self.g, scale))

  def input_peak(self, dtype):
    return _peak(tf.cast(self.x, dtype))

  def gradient_peak(self, u, dtype):
    return _peak(tf.cast(self.g, dtype))

  def divided(self, u, w, dtype):
    return dataclasses.replace(self, x=_over(self.x, u, dtype),
                               g=_over(self.g, w, dtype))


# -- an embedding lookup -------------------------------------------------------


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


@dataclasses.dataclass(frozen=True, eq=False)
class EmbeddingForm(Form):
  """An embedding lookup: row ``ids_it`` of the table for each example
  ``i`` and position ``t``.

  Attributes:
    ids: ``[B, T]`` integer ids.
    g: the gradient at the looked-up rows ``[B, T, D]``.
  """
  ids: tf.Tensor
  g: tf.Tensor

  @classmethod
  def sq_norms(cls, forms, var_shape, batch, dtype):
    return embedding_sq_norms(tf.concat([f.ids for f in forms], axis=1),
                              tf.concat([f.g for f in forms], axis=1))

  def per_example(self, var_shape, batch, dtype):
    shape = [batch] + tf.TensorShape(var_shape).as_list()
    vocab = shape[1]
    offset = self.ids + tf.range(tf.cast(batch, self.ids.dtype),
                                 dtype=self.ids.dtype)[:, None] * vocab
    flat = tf.math.unsorted_segment_sum(
        tf.reshape(self.g, [-1, shape[2]]), tf.reshape(offset, [-1]),
        batch * vocab)
    return tf.reshape(flat, shape)

  def clipped_sum(self, c, var_shape):
    """The rows ``c_i g_it`` summed at their ids."""
    shape = tf.TensorShape(var_shape)
    cg = self.g * _per_example_c(c, self.g)
    return tf.math.unsorted_segment_sum(
        tf.reshape(cg, [-1, shape[-1]]), tf.reshape(self.ids, [-1]),
        shape[0])

  def unscaled(self, scale):
    return EmbeddingForm(self.ids, _unscale(self.g, scale))

  def gradient_peak(self, u, dtype):
    return _peak(_over(self.g, u, dtype))

  def divided(self, u, w, dtype):
    return EmbeddingForm(self.ids, _over(_over(self.g, u, dtype), w, dtype))


# -- per-example gradients -----------------------------------------------------


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


def per_example_sq_norms(per_example: tf.Tensor,
                         name: Optional[str] = None) -> tf.Tensor:
  """Squared norms of per-example gradients ``[B, ...]`` (biases, scales,
  and the exact fallback)."""
  with tf.name_scope(name or "per_example_sq_norms"):
    flat = tf.reshape(per_example, [tf.shape(per_example)[0], -1])
    return tf.reduce_sum(tf.square(flat), axis=1)


@dataclasses.dataclass(frozen=True, eq=False)
class PerExampleForm(Form):
  """The per-example gradients themselves (a bias, a scale, the exact
  fallback through a layer's own call).

  Attributes:
    p: ``[B, *var_shape]``.
  """
  p: tf.Tensor

  def per_example(self, var_shape, batch, dtype):
    return tf.cast(self.p, dtype)

  def clipped_sum(self, c, var_shape):
    """``sum_i c_i P_i``."""
    return tf.tensordot(tf.cast(c, self.p.dtype), self.p, axes=1)

  def unscaled(self, scale):
    return PerExampleForm(_unscale(self.p, scale))

  def gradient_peak(self, u, dtype):
    return _peak(_over(self.p, u, dtype))

  def divided(self, u, w, dtype):
    return PerExampleForm(_over(_over(self.p, u, dtype), w, dtype))


def _unscale(x: tf.Tensor, scale) -> tf.Tensor:
  dtype = norm_dtype(x.dtype)
  return tf.cast(x, dtype) / tf.cast(scale, dtype)
