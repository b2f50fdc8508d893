"""Stateless multi-task methods of ``gg.mtl``, as small values.

Each matches the aggregator of TorchJD 0.18 (``torchjd.aggregation``) on the
same ``k x n`` matrix ``J`` of flattened task gradients, ``G = J J^T``.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from graphgrad import _errors
from graphgrad.methods import _mtl_solvers as _solvers
from graphgrad.methods._mtl_base import (
  GramMethod,
  TaskMethod,
  check_number,
  check_pref,
  pref_weights,
)

_F64 = tf.float64


class _MGDA(GramMethod):
  homogeneous = True  # combine(S J) = S combine(J): tests/methods
  name = "mgda"

  def __init__(self, epsilon, max_iters):
    self.epsilon, self.max_iters = epsilon, max_iters

  def _weights(self, gram, state=None, eps=None):
    return _solvers.frank_wolfe(gram, gram.shape[0], self.epsilon,
                                self.max_iters)

  def _args(self):
    return f"epsilon={self.epsilon}, max_iters={self.max_iters}"


def mgda(epsilon: float = 1e-3, max_iters: int = 100) -> TaskMethod:
  """MGDA (Sener & Koltun, 2018, "Multi-Task Learning as Multi-Objective
  Optimization").

  The min-norm point of the convex hull of the task gradients, ``J^T w*``
  with ``w* = argmin_{w in simplex} w^T G w``, by their Algorithm 2
  (Frank-Wolfe from the uniform weights, exact line search, stop when the
  step ``gamma < epsilon``), as TorchJD's ``MGDA``. With two tasks one step
  is exact: ``w_1 = clip((g_2 - g_1) . g_2 / ||g_1 - g_2||^2, 0, 1)``. For
  ``k > 2`` the weights are within the Frank-Wolfe gap of the optimum.

  Args:
    epsilon: stop when the Frank-Wolfe step is below this (> 0).
    max_iters: at most this many steps (> 0).

  Example:
    >>> import graphgrad as gg
    >>> g = [tf.constant([1., 0.]), tf.constant([0., 2.])]
    >>> gg.mtl.mgda().combine(g).numpy()
    array([0.8, 0.4], dtype=float32)
  """
  epsilon = check_number("mgda", "epsilon", epsilon, low=0, low_open=True)
  max_iters = check_number("mgda", "max_iters", max_iters, low=1,
                           integer=True)
  return _MGDA(epsilon, max_iters)


class _DualCone(GramMethod):
  """UPGrad and DualProj: projections onto the dual cone of the rows."""
  homogeneous = True  # combine(S J) = S combine(J): tests/methods

  def __init__(self, name, pref, norm_eps, reg_eps):
    self.name, self.pref = name, pref
    self.norm_eps, self.reg_eps = norm_eps, reg_eps

  def _weights(self, gram, state=None, eps=None):
    k = gram.shape[0]
    u = pref_weights(self.name, self.pref, k, 1. / k)
    reg = (_solvers.normalize(gram, self.norm_eps)
           + self.reg_eps * tf.eye(k, dtype=_F64))
    if self.name == "upgrad":
      return tf.reduce_sum(_solvers.dual_cone_weights(
          tf.linalg.diag(u), reg, k), axis=0)
    return _solvers.dual_cone_weights(u[None], reg, k)[0]

  def _args(self):
    return (f"pref_vector={self.pref}, norm_eps={self.norm_eps}, "
            f"reg_eps={self.reg_eps}")


def _dual_cone(name: str, pref_vector, norm_eps, reg_eps) -> TaskMethod:
  """``name``'s dual-cone method, its arguments checked."""
  return _DualCone(name, check_pref(name, pref_vector),
                   check_number(name, "norm_eps", norm_eps, low=0),
                   check_number(name, "reg_eps", reg_eps, low=0))


def upgrad(pref_vector: Sequence[float] | None = None,
           norm_eps: float = 1e-4, reg_eps: float = 1e-4) -> TaskMethod:
  """UPGrad (Quinton & Rey, 2024, "Jacobian Descent for Multi-Objective
  Optimization").

  Each ``g_i`` is projected onto the dual cone ``{x : g_j . x >= 0 for all
  j}`` of the task gradients, and the projections are combined with the
  preference weights ``u`` (``1/k`` each): ``sum_i u_i pi(g_i) = J^T sum_i
  v_i``, ``v_i = argmin_{v >= u_i e_i} v^T G v``. The result conflicts with
  no task. As TorchJD's ``UPGrad``, the quadratic programs use ``G /
  trace(G) + reg_eps I`` (``G`` taken as zero if its trace is below
  ``norm_eps``, which makes the result the weighted mean): the
  regularisation shifts the weights slightly from the paper's. Solved
  exactly for ``k <= 8``, iteratively above (see ``_mtl_solvers``).

  Args:
    pref_vector: one weight per task, or ``None`` for ``1/k`` each.
    norm_eps: trace below which the Gram matrix counts as zero (>= 0).
    reg_eps: added to the normalised Gram's diagonal (>= 0).

  Example:
    >>> import graphgrad as gg
    >>> g = [tf.constant([1., 0.]), tf.constant([-1., 1.])]
    >>> gg.mtl.upgrad().combine(g).numpy().round(3)
    array([0.25, 0.75], dtype=float32)
  """
  return _dual_cone("upgrad", pref_vector, norm_eps, reg_eps)


def dualproj(pref_vector: Sequence[float] | None = None,
             norm_eps: float = 1e-4, reg_eps: float = 1e-4) -> TaskMethod:
  """DualProj (Lopez-Paz & Ranzato, 2017, GEM's Eq. 11; as in Quinton &
  Rey, 2024).

  The weighted mean ``J^T u`` (``u = 1/k`` each) projected onto the dual cone
  of the task gradients: ``J^T v``, ``v = argmin_{v >= u} v^T G v``. As
  TorchJD's ``DualProj``, with ``G / trace(G) + reg_eps I`` in the program.

  Args:
    pref_vector: one weight per task, or ``None`` for ``1/k`` each.
    norm_eps: trace below which the Gram matrix counts as zero (>= 0).
    reg_eps: added to the normalised Gram's diagonal (>= 0).

  Example:
    >>> import graphgrad as gg
    >>> g = [tf.constant([1., 0.]), tf.constant([-1., 1.])]
    >>> gg.mtl.dualproj().combine(g).numpy().round(4)
    array([0. , 0.5], dtype=float32)
  """
  return _dual_cone("dualproj", pref_vector, norm_eps, reg_eps)


class _CAGrad(GramMethod):
  homogeneous = True  # combine(S J) = S combine(J): tests/methods
  name = "cagrad"

  def __init__(self, c, norm_eps):
    self.c, self.norm_eps = c, norm_eps

  def _weights(self, gram, state=None, eps=None):
    k = gram.shape[0]
    if k > _solvers.EXACT_MAX_TASKS:
      raise _errors.GraphGradError(
          f"cagrad.combine: `grads` must hold at most "
          f"{_solvers.EXACT_MAX_TASKS} task gradients; got {k}. Group the "
          f"tasks, or use upgrad() or mgda().")
    return _solvers.cagrad_weights(gram, k, self.c, self.norm_eps)

  def _args(self):
    return f"c={self.c}, norm_eps={self.norm_eps}"


def cagrad(c: float = 0.5, norm_eps: float = 1e-4) -> TaskMethod:
  """CAGrad (Liu et al., 2021, "Conflict-Averse Gradient Descent for
  Multi-task Learning").

  With ``g0`` the mean gradient and ``sqrt(phi) = c ||g0||``, ``w* =
  argmin_{w in simplex} g_w . g0 + sqrt(phi) ||g_w||`` (``g_w = J^T w``),
  and the result is ``g0 + sqrt(phi) / ||g_w*|| g_w*``. As TorchJD's
  ``CAGrad``, without the official code's rescaling by ``1 / (1 + c^2)``,
  the program on ``G / trace(G)``, and a zero result when that Gram's
  trace is below ``norm_eps`` or ``||g_w*||`` is (in its units). The
  program is solved exactly (every face of the simplex in closed form),
  for at most 8 tasks; TorchJD's interior-point solver (CLARABEL) stops
  earlier, and its result differs by up to 2e-4 (relative) at a higher
  objective.

  Args:
    c: radius of the ball around ``g0``, relative to ``||g0||`` (>= 0).
    norm_eps: see above (>= 0).

  Example:
    >>> import graphgrad as gg
    >>> g = [tf.constant([1., 0.]), tf.constant([-1., 1.])]
    >>> gg.mtl.cagrad(0.5).combine(g).numpy().round(4)
    array([0.25, 0.5 ], dtype=float32)
  """
  return _CAGrad(check_number("cagrad", "c", c, low=0),
                 check_number("cagrad", "norm_eps", norm_eps, low=0))


class _IMTLG(GramMethod):
  homogeneous = True  # combine(S J) = S combine(J): tests/methods
  name = "imtl_g"

  def _weights(self, gram, state=None, eps=None):
    d = tf.sqrt(tf.maximum(tf.linalg.diag_part(gram), 0.))
    # torch.linalg.pinv's cutoff on the gradients' precision, as TorchJD.
    k = gram.shape[0]
    v = tf.linalg.matvec(tf.linalg.pinv(gram, rcond=k * eps), d)
    total = tf.reduce_sum(v)
    tiny = tf.abs(total) < 1e-12
    return tf.where(tiny, tf.zeros_like(v),
                    v / tf.where(tiny, tf.ones_like(total), total))


def imtl_g() -> TaskMethod:
  """IMTL-G (Liu et al., 2021, "Towards Impartial Multi-task Learning").

  The combination ``J^T w``, ``sum_i w_i = 1``, whose projections on every
  unit task gradient ``g_i / ||g_i||`` are equal. As TorchJD's ``IMTLG``
  (the generalisation of Quinton & Rey, 2024): ``w = v / sum(v)`` with ``v =
  G^+ d``, ``d_i = ||g_i||``, which also covers linearly dependent tasks;
  zero when ``|sum(v)| < 1e-12``.

  Example:
    >>> import graphgrad as gg
    >>> g = [tf.constant([1., 0.]), tf.constant([0., 2.])]
    >>> gg.mtl.imtl_g().combine(g).numpy().round(4)
    array([0.6667, 0.6667], dtype=float32)
  """
  return _IMTLG()


class _AlignedMTL(GramMethod):
  homogeneous = True  # combine(S J) = S combine(J): tests/methods
  name = "aligned_mtl"

  def __init__(self, pref, scale_mode):
    self.pref, self.scale_mode = pref, scale_mode

  def _weights(self, gram, state=None, eps=None):
    k = gram.shape[0]
    u = pref_weights(self.name, self.pref, k, 1. / k)
    lam, vec = tf.linalg.eigh(gram)
    tol = tf.reduce_max(lam) * k * eps
    keep = lam > tol
    one, zero = tf.ones_like(lam), tf.zeros_like(lam)
    inv_sqrt = tf.where(keep, 1. / tf.sqrt(tf.where(keep, lam, one)), zero)
    if self.scale_mode == "min":
      scale = tf.reduce_min(tf.where(keep, lam, one * lam.dtype.max))
    elif self.scale_mode == "median":
      scale = _lower_median(tf.boolean_mask(lam, keep))
    else:
      scale = (tf.reduce_sum(tf.where(keep, lam, zero))
               / tf.maximum(tf.reduce_sum(tf.cast(keep, _F64)), 1.))
    b = tf.sqrt(scale) * tf.matmul(vec * inv_sqrt[None], vec,
                                   transpose_b=True)
    alpha = tf.linalg.matvec(b, u)
    return tf.where(tf.reduce_any(keep), alpha, u)

  def _args(self):
    return f"pref_vector={self.pref}, scale_mode={self.scale_mode!r}"


def _lower_median(x):
  """torch.median: the lower of the two middle values."""
  n = tf.shape(x)[0]
  return tf.sort(x)[(n - 1) // 2]


def aligned_mtl(pref_vector: Sequence[float] | None = None,
                scale_mode: str = "min") -> TaskMethod:
  """Aligned-MTL (Senushkin et al., 2023, "Independent Component Alignment
  for Multi-Task Learning").

  With ``G = V diag(lambda) V^T`` (eigenvalues above ``k eps max(lambda)``),
  the balance transformation ``B = sqrt(lambda_min) V diag(lambda)^{-1/2}
  V^T`` makes the combined gradients' components orthogonal and of equal
  norm; the result is ``J^T B u`` (``u = 1/k`` each). As TorchJD's
  ``AlignedMTL``; ``scale_mode`` ``"median"`` or ``"rmse"`` (mean
  eigenvalue, the official code) replaces ``lambda_min``.

  Args:
    pref_vector: one weight per task, or ``None`` for ``1/k`` each.
    scale_mode: ``"min"``, ``"median"`` or ``"rmse"``.

  Example:
    >>> import graphgrad as gg
    >>> g = [tf.constant([1., 0.]), tf.constant([0., 2.])]
    >>> gg.mtl.aligned_mtl().combine(g).numpy().round(4)
    array([0.5, 0.5], dtype=float32)
  """
  if scale_mode not in ("min", "median", "rmse"):
    raise _errors.GraphGradError(
        f"aligned_mtl: `scale_mode` must be 'min', 'median' or 'rmse'; got "
        f"{scale_mode!r}.")
  return _AlignedMTL(check_pref("aligned_mtl", pref_vector), scale_mode)
