"""Per-example gradient norms and clipped sums: the rules of DP-SGD's clip.

Each executor describes where a variable meets the examples as forms:
``("dense", a, g)`` (the input rows of a dense op and the gradient at its
output), :func:`conv_form`, ``("embedding", ids, g)`` or ``("example", P)``
(per-example gradients). From them come the per-example squared norms
(ghost clipping: Goodfellow 2015, Lee & Kifer 2021, Li et al. 2022,
:func:`combined_sq_norms`), the clip factors (:func:`clip_factors`) and each
variable's clipped sum from the same tensors (book-keeping, Bu et al. 2023,
:func:`clipped_sum`), with no per-example gradient materialized where a
form avoids it. :mod:`graphgrad.core._privacy` runs the algorithm.
"""

from typing import List, Optional, Sequence

import numpy as np
import tensorflow as tf

__all__ = ["broadcast_per_example", "clip_factors", "clipped_sum",
           "combined_sq_norms", "conv_form", "dense_sq_norms",
           "embedding_sq_norms", "example_norms", "norm_dtype", "patches",
           "per_example_sq_norms", "rows", "unscaled_forms"]


def norm_dtype(dtype) -> tf.DType:
  """float32, or float64 for float64 models: norms are never float16."""
  return tf.float64 if tf.as_dtype(dtype) == tf.float64 else tf.float32


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
  flat, pixels, ho, wo, _ = _pixels(x, kh, kw, sh, sw, padding)
  out = tf.gather(flat, pixels.reshape(-1), axis=1)  # [B, ho*wo*kh*kw, c]
  return tf.reshape(out, [-1, ho, wo, kh * kw * c])


def _pixels(x, kh, kw, sh, sw, padding, pad: bool = True):
  """``x`` flattened to ``[B, H*W, C]``, the index of the pixel each
  output position reads at each kernel offset, ``[ho, wo, kh, kw]``, and
  ``ho, wo`` (static spatial sizes). With ``pad``, ``x`` is padded first;
  without, a pixel of the padding reads a clamped pixel, and the fourth
  result, ``[ho, wo, kh, kw]`` booleans (``None`` for all), says which
  are inside the input."""
  h, w = x.shape[1], x.shape[2]
  if padding == "SAME":
    ho, wo = -(-h // sh), -(-w // sw)
    ph = max((ho - 1) * sh + kh - h, 0)
    pw = max((wo - 1) * sw + kw - w, 0)
  else:
    ho, wo, ph, pw = (h - kh) // sh + 1, (w - kw) // sw + 1, 0, 0
  rows = (np.arange(ho)[:, None, None, None] * sh + np.arange(kh)[:, None]
          + np.zeros([1, wo, 1, kw], np.int64))
  cols = (np.arange(wo)[:, None, None] * sw + np.arange(kw)
          + np.zeros([ho, 1, kh, 1], np.int64))
  if pad and (ph or pw):
    x = tf.pad(x, [[0, 0], [ph // 2, ph - ph // 2], [pw // 2, pw - pw // 2],
                   [0, 0]])
    h, w, inside = h + ph, w + pw, None
  else:
    rows, cols = rows - ph // 2, cols - pw // 2
    inside = (rows >= 0) & (rows < h) & (cols >= 0) & (cols < w)
    rows, cols = np.clip(rows, 0, h - 1), np.clip(cols, 0, w - 1)
    inside = None if inside.all() else inside
  pixels = (rows * w + cols).astype(np.int32)
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


def _conv_sq_norms(forms, dtype) -> Optional[tf.Tensor]:
  """``[B]`` squared norms of a kernel whose uses are all conv forms, one
  kernel offset at a time: ``sum_k ||sum_t x_{t+k} g_t^T||^2``, the
  per-example product without the patches (a ``[B, T, C]`` slice at a
  time, not ``[B, T, kh*kw*C]``). ``None`` where the patches are cheaper:
  dynamic spatial sizes, small patches, or a ghost norm cheaper than the
  per-example product."""
  (kh, kw, cin, cout), t = forms[0][3][0], 0
  for f in forms:
    x, g = f[1], f[2]
    if None in (x.shape[1], x.shape[2], x.shape[3], g.shape[1], g.shape[2]):
      return None
    t += g.shape[1] * g.shape[2]
  p = kh * kw * cin
  if p <= 16 or t * t * (p + cout) <= t * p * cout:
    return None
  # Unpadded (a padded copy would live through every offset), each offset
  # read once the gradient is there, not during the forward pass.
  grids = [_pixels(f[1], kh, kw, f[3][1][1], f[3][1][2], f[3][2], pad=False)
           for f in forms]
  g = tf.concat([tf.reshape(tf.cast(f[2], dtype), [tf.shape(f[2])[0], -1,
                                                   cout]) for f in forms], 1)
  total = None
  for i in range(kh):
    for j in range(kw):
      with tf.control_dependencies([g] if total is None else [total]):
        a = tf.concat([_offset(grid, i, j, dtype) for grid in grids], 1)
      sq = tf.reduce_sum(tf.square(tf.matmul(a, g, transpose_a=True)),
                         axis=[1, 2])
      total = sq if total is None else total + sq
  return total


def conv_form(x: tf.Tensor, g: tf.Tensor, kernel_shape, strides,
              padding: str) -> tuple:
  """The form of a 2-D convolution's kernel use (NHWC, no dilation).

  ``x`` is the convolution's input, ``g`` the gradient at its output. The
  norms read ``x`` one kernel offset at a time (:func:`_conv_sq_norms`) or
  unfold it into :func:`patches` (a dense op on them); the clipped sum is
  one ``Conv2DBackpropFilter`` of ``x`` and ``c * g``, with no patches.
  """
  return ("conv", x, g, (tuple(int(d) for d in kernel_shape),
                         tuple(int(s) for s in strides), padding))


def _conv_rows(form, batch, dtype):
  """A conv form as the dense form of its patches."""
  _, x, g, (shape, strides, padding) = form
  kh, kw, cin = shape[:3]
  # Unfolded once the gradient is there, not when the forward pass made
  # x: the patches then live beside the norms alone, not the backward pass.
  with tf.control_dependencies([g]):
    a = rows(patches(x, kh, kw, strides, padding), batch, dtype,
             kh * kw * cin)
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
  :func:`conv_form` (one kernel offset at a time, :func:`_conv_sq_norms`,
  or a dense form of its patches). A variable used
  several times (a shared layer, an unrolled loop) has the sum of its uses'
  gradients per example: uses of one kind are concatenated along ``T`` (the
  ghost norm then holds the cross terms); uses of several kinds are each
  made into per-example gradients ``[B, *var_shape]`` and summed.
  """
  if all(f[0] == "conv" for f in forms):
    norms = _conv_sq_norms(forms, dtype)
    if norms is not None:
      return norms
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


def _scaled(forms, batch, dtype):
  """``forms`` divided, example by example, so that their largest entries
  are at most about 1, and ``k`` (``[B]``) with ``grad_i(forms) = k_i
  grad_i(scaled forms)``.

  The inputs of dense and conv uses are divided by their largest entry
  ``u_i``, the gradients at their outputs by ``w_i``, and an embedding's
  rows and a per-example gradient by ``u_i w_i``: ``w_i`` is the largest
  of those entries (after the ``u_i``), so ``k_i = u_i w_i``. A zero
  example keeps a factor 1; a NaN or an infinity stays in the forms.
  """
  def peak(x):
    m = tf.reduce_max(tf.abs(tf.reshape(x, [tf.shape(x)[0], -1])), axis=1)
    return tf.where(m > 0, m, tf.ones_like(m))

  def over(x, m):
    x = tf.cast(x, dtype)
    return x / tf.reshape(m, tf.concat([[-1], tf.ones([tf.rank(x) - 1],
                                                       tf.int32)], 0))

  ones = tf.ones(tf.reshape(batch, [1]), dtype)
  inputs = [peak(tf.cast(f[1], dtype)) for f in forms
            if f[0] in ("dense", "conv")]
  u = tf.reduce_max(tf.stack(inputs), axis=0) if inputs else ones
  rest = [peak(tf.cast(f[2], dtype)) for f in forms
          if f[0] in ("dense", "conv")]
  rest += [peak(over(f[2] if f[0] == "embedding" else f[1], u))
           for f in forms if f[0] in ("embedding", "example")]
  w = tf.reduce_max(tf.stack(rest), axis=0) if rest else ones
  out: List[tuple] = []
  for f in forms:
    if f[0] == "dense":
      out.append(("dense", over(f[1], u), over(f[2], w)))
    elif f[0] == "conv":
      out.append(("conv", over(f[1], u), over(f[2], w), f[3]))
    elif f[0] == "embedding":
      out.append(("embedding", f[1], over(over(f[2], u), w)))
    else:
      out.append((f[0], over(over(f[1], u), w)))
  return out, u * w


def example_norms(forms: Sequence[Sequence[tuple]], shapes, dtypes, batch,
                  l2_norm_clip: float, name: Optional[str] = None
                  ) -> tf.Tensor:
  """``[B]`` norms of each example's whole gradient, over the variables
  whose uses are ``forms`` (one list per variable, of shape ``shapes``).

  The squared norms of the variables are summed as they come. Where that
  sum is not finite (a finite gradient with entries past about ``1e19`` in
  float32 overflows when squared, and would get a clip factor 0 instead of
  norm ``C``), it is taken again with each example's forms scaled to
  entries of about 1 (:func:`_scaled`), each variable's norm multiplied
  back and the variables combined by a scaled hypot: a finite gradient
  gets its norm whatever its scale. So does one whose squares underflow
  (a norm below a tiny ``C``). A NaN or an infinity in an example's
  gradient keeps its norm non-finite.

  Example:
    >>> import tensorflow as tf
    >>> a, g = tf.fill([1, 1, 4], 1e30), tf.fill([1, 1, 1], 1e-20)
    >>> n = example_norms([[("dense", a, g)]], [[4, 1]], [tf.float32], 1, 1.)
    >>> round(float(n[0]) / 2e10, 4)  # ||(1e10, 1e10, 1e10, 1e10)||
    1.0
  """
  with tf.name_scope(name or "example_norms"):
    def scaled():
      norms = []
      for f, shape, dtype in zip(forms, shapes, dtypes):
        small, k = _scaled(f, batch, dtype)
        norms.append(tf.cast(k * tf.sqrt(combined_sq_norms(
            small, shape, batch, dtype)), dtypes[0]))
      top = tf.reduce_max(tf.stack(norms), axis=0)
      safe = tf.where(top > 0, top, tf.ones_like(top))
      return top * tf.sqrt(tf.add_n([tf.square(n / safe) for n in norms]))

    tiny = np.finfo(dtypes[0].as_numpy_dtype).tiny
    if l2_norm_clip < np.sqrt(tiny) * 2.0 ** 12:  # C^2 near underflow
      return scaled()
    total = tf.add_n([tf.cast(combined_sq_norms(f, shape, batch, dtype),
                              dtypes[0])
                      for f, shape, dtype in zip(forms, shapes, dtypes)])
    return tf.cond(tf.reduce_all(tf.math.is_finite(total)),
                   lambda: tf.sqrt(total), scaled)


def clip_factors(norms: tf.Tensor, l2_norm_clip: float, dtype,
                 name: Optional[str] = None) -> tf.Tensor:
  """``c_i = min(1, C / ||g_i||)`` from each example's norm
  (:func:`example_norms`); all NaN when a norm is not finite.

  A NaN or an infinity in one example's gradient makes every clip factor,
  and so every gradient of the step, NaN: visible, never dropped (a factor
  0 would hide it, and ``0 * inf`` in a sum is NaN anyway). The result is a
  constant of the backward pass (``stop_gradient``): the gradient of
  ``sum_i c_i l_i`` is ``sum_i clip_C(grad l_i)``.

  Example:
    >>> import tensorflow as tf
    >>> c = clip_factors(tf.constant([1.0, 5.0]), 1.0, tf.float32)
    >>> [round(float(x), 3) for x in c]
    [1.0, 0.2]
    >>> clip_factors(tf.constant([1.0, float("inf")]), 1.0, tf.float32)
    ... # doctest: +ELLIPSIS
    <tf.Tensor: ... numpy=array([nan, nan], dtype=float32)>
  """
  with tf.name_scope(name or "clip_factors"):
    clip = tf.constant(l2_norm_clip, norms.dtype)
    c = clip / tf.maximum(norms, clip)
    finite = tf.reduce_all(tf.math.is_finite(norms))
    c = tf.where(finite, c, tf.constant(float("nan"), c.dtype))
    return tf.stop_gradient(tf.cast(c, dtype))


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
