"""Small solvers of ``gg.mtl`` in TensorFlow ops, on ``k x k`` Gram matrices.

All work in float64 on ``G = J J^T`` of ``k`` tasks, never on the
``n``-dimensional gradients, so their cost does not grow with ``n``:

* :func:`dual_cone_weights` (UPGrad, DualProj): ``min_v v^T G v`` subject to
  ``v >= u``; exact for ``k <= EXACT_MAX_TASKS`` (every active set in closed
  form), projected Gauss-Seidel sweeps above (``QP_TOL``, ``QP_MAX_SWEEPS``).
* :func:`frank_wolfe` (MGDA): Algorithm 2 of Sener & Koltun (2018), as
  TorchJD runs it; exact for ``k = 2``.
* :func:`cagrad_weights`: the CAGrad inner problem over the simplex, exact
  for ``k <= EXACT_MAX_TASKS``.
* :func:`nash_weights`: the Nash bargaining solution ``G a = 1 / a``, by
  damped Newton steps on ``a^T G a / 2 - sum log a`` until converged.
"""

import itertools
from typing import Tuple

import numpy as np
import tensorflow as tf

EXACT_MAX_TASKS = 8
QP_TOL = 1e-10
QP_MAX_SWEEPS = 10000
_F64 = tf.float64


def _masks(k: int) -> tf.Tensor:
  """Every 0/1 support pattern over ``k`` tasks: ``[2^k, k]``."""
  return tf.constant(np.array(list(itertools.product([0., 1.], repeat=k))),
                     _F64)


def _masked_pinv(gram: tf.Tensor, masks: tf.Tensor) -> tf.Tensor:
  """``[S, k, k]``: the pseudo-inverse of ``G`` on each support, 0 outside."""
  outer = masks[:, :, None] * masks[:, None, :]
  return tf.linalg.pinv(outer * gram[None]) * outer


def normalize(gram: tf.Tensor, eps: float) -> tf.Tensor:
  """``G / trace(G)``, or zeros when the trace is below ``eps`` (TorchJD)."""
  trace = tf.linalg.trace(gram)
  small = trace < eps if eps > 0 else tf.equal(trace, 0.)
  return tf.where(small, tf.zeros_like(gram),
                  gram / tf.where(small, tf.ones_like(trace), trace))


def dual_cone_weights(units: tf.Tensor, gram: tf.Tensor, k: int
                      ) -> tf.Tensor:
  """For each row ``u`` of ``units`` ``[m, k]``: ``argmin v^T G v, v >= u``.

  ``G`` must be positive definite (regularised). With ``v = u + x``, ``x >=
  0``, a support ``S`` of ``x`` gives ``x_S = -G_SS^{-1} (G u)_S``; clipped
  at zero every candidate is feasible, and the optimum is the candidate of
  its own support, so the candidate of least objective is the solution.
  """
  if k > EXACT_MAX_TASKS:
    return _gauss_seidel(units, gram, k)
  masks = _masks(k)
  inv = _masked_pinv(gram, masks)  # [S, k, k]
  gu = tf.linalg.matmul(units, gram)  # [m, k] (G symmetric)
  x = -tf.einsum("sij,mj->msi", inv, gu)
  v = units[:, None, :] + tf.maximum(x, 0.)  # [m, S, k]
  obj = tf.einsum("msi,ij,msj->ms", v, gram, v)
  best = tf.argmin(obj, axis=1)
  return tf.gather(v, best, axis=1, batch_dims=1)


def _gauss_seidel(units, gram, k):
  """Projected Gauss-Seidel on ``v^T G v``, ``v >= u``, row by row."""
  diag = tf.linalg.diag_part(gram)

  def sweep(v):
    for i in range(k):
      step = tf.linalg.matvec(v, gram[i]) / diag[i]
      vi = tf.maximum(units[:, i], v[:, i] - step)
      v = tf.concat([v[:, :i], vi[:, None], v[:, i + 1:]], axis=1)
    return v

  def cond(n, v, moved):
    return tf.logical_and(n < QP_MAX_SWEEPS, moved)

  def body(n, v, moved):
    new = sweep(v)
    scale = tf.maximum(tf.reduce_max(tf.abs(new)), 1e-300)
    return n + 1, new, tf.reduce_max(tf.abs(new - v)) > QP_TOL * scale

  _, v, _ = tf.while_loop(cond, body, [tf.constant(0), units,
                                       tf.constant(True)])
  return v


def frank_wolfe(gram: tf.Tensor, k: int, epsilon: float, max_iters: int
                ) -> tf.Tensor:
  """MGDA's min-norm weights by Frank-Wolfe, stopping when the step < eps."""
  eye = tf.eye(k, dtype=_F64)

  def body(n, alpha, done):
    g_alpha = tf.linalg.matvec(gram, alpha)
    t = tf.argmin(g_alpha)
    a = tf.gather(g_alpha, t)
    b = tf.reduce_sum(alpha * g_alpha)
    c = tf.gather_nd(gram, tf.stack([t, t])[None])[0]
    gamma = tf.where(c <= a, tf.constant(1., _F64), tf.where(
        b <= a, tf.constant(0., _F64),
        (b - a) / tf.where(b + c - 2 * a > 0, b + c - 2 * a, tf.ones_like(a))))
    new = (1 - gamma) * alpha + gamma * tf.gather(eye, t)
    return n + 1, new, gamma < epsilon

  def cond(n, alpha, done):
    return tf.logical_and(n < max_iters, tf.logical_not(done))

  start = tf.fill([k], tf.constant(1. / k, _F64))
  _, alpha, _ = tf.while_loop(cond, body, [tf.constant(0), start,
                                           tf.constant(False)])
  return alpha


def cagrad_weights(gram: tf.Tensor, k: int, c: float, norm_eps: float
                   ) -> tf.Tensor:
  """CAGrad's weights on ``J``, TorchJD's way, from the normalised Gram.

  ``w* = argmin_{w in simplex} w^T G g0 + sqrt(phi) ||J^T w||`` with ``g0``
  the mean and ``sqrt(phi) = c ||g0||``; the weights are ``1/k + sqrt(phi) /
  ||J^T w*|| w*`` (zero when ``||J^T w*|| < norm_eps``).
  """
  gram = normalize(gram, norm_eps)
  mean = tf.fill([k], tf.constant(1. / k, _F64))
  b = tf.linalg.matvec(gram, mean)
  sqrt_phi = c * tf.sqrt(tf.maximum(tf.reduce_sum(mean * b), 0.))
  cand = _cagrad_candidates(gram, b, sqrt_phi * sqrt_phi, k)  # [S', k]
  cand = tf.maximum(cand, 0.)
  total = tf.reduce_sum(cand, axis=1, keepdims=True)
  ok = tf.logical_and(total[:, 0] > 0, tf.reduce_all(tf.math.is_finite(
      cand), axis=1))
  safe = tf.where(total > 0, total, tf.ones_like(total))
  cand = tf.where(ok[:, None], cand / safe, mean)
  norms = tf.sqrt(tf.maximum(tf.einsum("si,ij,sj->s", cand, gram, cand), 0.))
  obj = tf.linalg.matvec(cand, b) + sqrt_phi * norms
  best = tf.argmin(tf.where(ok, obj, tf.constant(np.inf, _F64)))
  w, norm = tf.gather(cand, best), tf.gather(norms, best)
  weights = mean + sqrt_phi / tf.where(norm > 0, norm, tf.ones_like(norm)) * w
  return tf.where(norm >= norm_eps, weights, tf.zeros_like(weights))


def _cagrad_candidates(gram, b, phi, k):
  """Each face's stationary points (two roots) and every vertex.

  On a face ``S``, stationarity ``b_S + sqrt(phi) G_SS w_S / ||J^T w|| = mu
  1`` gives ``w_S = r / sqrt(phi) (mu y - z)`` (``y = G_SS^+ 1``, ``z =
  G_SS^+ b_S``, ``r = ||J^T w||``), so ``(mu y - z)^T G_SS (mu y - z) =
  phi``, a quadratic in ``mu``, and ``sum(w_S) = 1`` fixes ``r > 0``.
  """
  masks = _masks(k)[1:]
  inv = _masked_pinv(gram, masks)
  y = tf.einsum("sij,sj->si", inv, masks)  # G_SS^-1 1_S
  z = tf.einsum("sij,sj->si", inv, masks * b[None])  # G_SS^-1 b_S
  sy = tf.reduce_sum(masks * y, 1)
  sz = tf.reduce_sum(masks * z, 1)
  bz = tf.reduce_sum(masks * b[None] * z, 1)
  disc = sz * sz - sy * (bz - phi)
  root = tf.sqrt(tf.maximum(disc, 0.))
  out = [tf.eye(k, dtype=_F64)]
  for sign in (1., -1.):
    mu = (sz + sign * root) / tf.where(sy != 0, sy, tf.ones_like(sy))
    scale = mu * sy - sz
    valid = (disc >= 0) & (scale > 0) & (sy != 0)
    safe = tf.where(scale > 0, scale, tf.ones_like(scale))
    w = (mu[:, None] * y - z) / safe[:, None]
    nan = tf.fill(tf.shape(w), tf.constant(np.nan, _F64))
    out.append(tf.where(valid[:, None], w, nan))
  return tf.concat(out, axis=0)


NASH_TOL = 1e-10


def nash_weights(gram: tf.Tensor, start: tf.Tensor, steps: int
                 ) -> Tuple[tf.Tensor, tf.Tensor]:
  """``a > 0`` with ``G a = 1 / a``: damped Newton from ``start``.

  The solution minimises the self-concordant ``a^T G a / 2 - sum log a``;
  the step ``1 / (1 + lambda)`` (``lambda`` the Newton decrement) keeps ``a``
  positive and converges from any start, quadratically once ``lambda <
  1/4``, where full steps are taken. ``start`` is first scaled to the best
  multiple of itself (``t^2 = k / start^T G start``). The steps stop once
  ``max |a_i (G a)_i - 1| <= NASH_TOL``, or after ``steps``.

  Returns:
    ``(a, residual)``, ``residual`` the final ``max |a_i (G a)_i - 1|``.
  """
  k = start.shape[0]
  eye = tf.eye(k, dtype=_F64)
  a0 = tf.cast(start, _F64)
  curv = tf.reduce_sum(a0 * tf.linalg.matvec(gram, a0))
  a0 = tf.where(curv > 0, a0 * tf.sqrt(k / tf.where(curv > 0, curv, 1.)),
                a0)

  def residual(a):
    return tf.reduce_max(tf.abs(a * tf.linalg.matvec(gram, a) - 1.))

  def body(n, a, _):
    grad = tf.linalg.matvec(gram, a) - 1. / a
    hess = gram + eye / (a * a)[:, None] * eye
    delta = tf.linalg.solve(hess, grad[:, None])[:, 0]
    lam = tf.sqrt(tf.maximum(tf.reduce_sum(grad * delta), 0.))
    step = tf.where(lam < 0.25, tf.constant(1., _F64), 1. / (1. + lam))
    new = a - step * delta
    new = tf.where(new > 0, new, a * 0.5)
    return n + 1, new, residual(new)

  _, a, res = tf.while_loop(
      lambda n, a, res: (n < steps) & (res > NASH_TOL), body,
      [tf.constant(0), a0, residual(a0)])
  return a, res
