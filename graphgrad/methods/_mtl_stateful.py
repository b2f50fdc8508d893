"""Stateful multi-task methods of ``gg.mtl``: GradVac and Nash-MTL.

Their state lives in non-trainable ``tf.Variable`` s of a ``tf.Module`` made
by ``method.create_state(k)``, once per (plan, layer): one method value used
at two layers or on two plans gets two states. ``Saver`` saves them (they are
global variables) and ``tf.train.Checkpoint`` tracks the module; they are
created where the caller's device scope (a ``replica_device_setter``) puts
variables.
"""

from __future__ import annotations

import logging

import tensorflow as tf

from graphgrad import _errors
from graphgrad.methods import _mtl_solvers as _solvers
from graphgrad.methods._mtl_base import GramMethod, TaskMethod, check_number

_F64 = tf.float64
log = logging.getLogger("graphgrad")
# The largest max |a_i (G a)_i - 1| of a solve taken as converged.
NASH_WARN_RESIDUAL = 1e-6


class MethodState(tf.Module):
  """The variables of one stateful method at one (plan, layer)."""

  def __init__(self, name: str, k: int, **initial):
    super().__init__(name=name)
    self.tasks = k
    for key, value in initial.items():
      setattr(self, key, tf.Variable(value, trainable=False,
                                     name=f"{name}_{key}"))


def _assign_after(out: tf.Tensor, updates) -> tf.Tensor:
  """``out``, computed only once every update has run."""
  with tf.control_dependencies([u for u in updates if u is not None]):
    return tf.identity(out)


class _GradVac(GramMethod):
  homogeneous = True  # combine(S J) = S combine(J): tests/methods
  name = "gradvac"
  stateful = True

  def __init__(self, beta, eps, shuffle, seed):
    self.beta, self.eps, self.shuffle, self.seed = beta, eps, shuffle, seed

  def create_state(self, k, name=None):
    return MethodState(name or self.name, k, phi=tf.zeros([k, k], _F64))

  def _weights(self, gram, state=None, eps=None):
    k = gram.shape[0]
    phi = tf.convert_to_tensor(state.phi)
    eye = tf.eye(k, dtype=_F64)
    rows, new_phi = [], phi
    for i in range(k):
      c = eye[i]
      cg = gram[i]
      others = tf.constant([j for j in range(k) if j != i])
      if self.shuffle and k > 2:
        seed = None if self.seed is None else self.seed + i
        others = tf.gather(others, tf.random.shuffle(tf.range(k - 1),
                                                     seed=seed))
      for p in range(k - 1):
        j = others[p]
        gj = tf.gather(gram, j)
        norm_i = tf.sqrt(tf.maximum(tf.reduce_sum(cg * c), 0.))
        norm_j = tf.sqrt(tf.maximum(tf.gather(gj, j), 0.))
        cos = tf.gather(cg, j) / (norm_i * norm_j + self.eps)
        target = phi[i, j]
        w = norm_i * (target * tf.sqrt(tf.maximum(1. - cos * cos, 0.))
                      - cos * tf.sqrt(tf.maximum(1. - target * target, 0.))
                      ) / (norm_j * tf.sqrt(tf.maximum(
                          1. - target * target, 0.)) + self.eps)
        w = tf.where(cos < target, w, tf.zeros_like(w))
        onehot = tf.one_hot(j, k, dtype=_F64)
        c = c + w * onehot
        cg = cg + w * gj
        new_phi = new_phi + eye[i][:, None] * onehot[None] * (
            (1. - self.beta) * target + self.beta * cos - target)
      rows.append(c)
    weights = tf.add_n(rows)
    return _assign_after(weights, [state.phi.assign(new_phi)])

  def _args(self):
    return (f"beta={self.beta}, eps={self.eps}, shuffle={self.shuffle}, "
            f"seed={self.seed}")


def gradvac(beta: float = 0.5, eps: float = 1e-8, shuffle: bool = True,
            seed: int | None = None) -> TaskMethod:
  """GradVac (Wang et al., 2021, "Gradient Vaccine: Investigating and
  Improving Multi-task Optimization in Massively Multilingual Models").

  For each task ``i`` and every other ``j`` (in random order), with ``phi``
  the cosine of ``g_i^PC`` and ``g_j`` and ``phi_hat_ij`` its moving target:
  if ``phi < phi_hat``, ``g_i^PC += ||g_i^PC|| (phi_hat sqrt(1 - phi^2) -
  phi sqrt(1 - phi_hat^2)) / (||g_j|| sqrt(1 - phi_hat^2)) g_j``; then
  ``phi_hat_ij <- (1 - beta) phi_hat_ij + beta phi``. The result is ``sum_i
  g_i^PC``. As TorchJD's ``GradVac`` (targets start at 0, ``eps`` in the
  denominators). The targets are state: ``create_state(k)`` once per plan
  and layer.

  Args:
    beta: decay of the targets' moving average, in [0, 1].
    eps: added to the denominators (>= 0).
    shuffle: visit the other tasks in random order (TorchJD's behaviour).
    seed: op-level seed of the shuffles.

  Example:
    >>> import graphgrad as gg
    >>> method = gg.mtl.gradvac(beta=0.5)
    >>> state = method.create_state(2)
    >>> g = [tf.constant([1., 0.]), tf.constant([-1., 1.])]
    >>> method.combine(g, state=state).numpy().round(4)  # targets 0: PCGrad
    array([0.5, 1.5], dtype=float32)
    >>> state.phi.numpy().round(4)  # moved halfway to the cosine
    array([[ 0.    , -0.3536],
           [-0.3536,  0.    ]])
    >>> method.combine(g, state=state).numpy().round(4)
    array([0.311, 1.311], dtype=float32)
  """
  if not isinstance(shuffle, bool):
    raise _errors.GraphGradError(
        f"gradvac: `shuffle` must be True or False; got {shuffle!r}.")
  return _GradVac(check_number("gradvac", "beta", beta, low=0, high=1),
                  check_number("gradvac", "eps", eps, low=0), shuffle, seed)


class _NashMTL(TaskMethod):
  name = "nash_mtl"
  stateful = True

  def __init__(self, max_norm, update_weights_every, optim_niter):
    self.max_norm = max_norm
    self.update_weights_every = update_weights_every
    self.optim_niter = optim_niter
    self._warned = False

  def create_state(self, k, name=None):
    return MethodState(name or self.name, k, alpha=tf.ones([k], _F64),
                       step=tf.constant(0, tf.int64))

  def _combine(self, mat, state=None):
    k = mat.shape[0]
    # float64 before the product: the solution is exact for the Gram matrix
    # of the gradients as given, also when two nearly cancel.
    wide = tf.cast(mat, _F64)
    gram = tf.matmul(wide, wide, transpose_b=True)
    prev = tf.convert_to_tensor(state.alpha)
    step = tf.convert_to_tensor(state.step)

    def solve():
      scale = tf.norm(gram)
      scale = tf.where(scale > 0, scale, tf.ones_like(scale))
      start = prev * tf.sqrt(scale)
      a, res = _solvers.nash_weights(gram / scale, start, self.optim_niter)
      return a / tf.sqrt(scale), res

    alpha, res = tf.cond(tf.equal(step % self.update_weights_every, 0),
                         solve, lambda: (prev, tf.zeros([], _F64)))
    alpha.set_shape([k])
    warned = tf.cond(res > NASH_WARN_RESIDUAL,
                     lambda: tf.numpy_function(self._not_converged, [res],
                                               tf.bool, stateful=True),
                     lambda: tf.constant(False))
    used = alpha
    if self.max_norm > 0:
      norm = tf.sqrt(tf.maximum(tf.reduce_sum(
          alpha * tf.linalg.matvec(gram, alpha)), 0.))
      used = tf.where(norm > self.max_norm, alpha / norm * self.max_norm,
                      alpha)
    out = tf.linalg.matvec(mat, tf.cast(used, mat.dtype), transpose_a=True)
    return _assign_after(out, [state.alpha.assign(alpha),
                               state.step.assign_add(1), warned])

  def _not_converged(self, residual) -> bool:
    """Logs, once per method, that a solve stopped short of the solution."""
    if not self._warned:
      self._warned = True
      log.warning(
          "nash_mtl: the Nash bargaining solve did not converge in "
          "optim_niter=%d Newton steps: max |a_i (G a)_i - 1| = %.3g > %g. "
          "The direction is not the Nash solution; pass a larger "
          "optim_niter.", self.optim_niter, float(residual),
          NASH_WARN_RESIDUAL)
    return True

  def _args(self):
    return (f"max_norm={self.max_norm}, update_weights_every="
            f"{self.update_weights_every}, optim_niter={self.optim_niter}")


def nash_mtl(max_norm: float = 1.0, update_weights_every: int = 1,
             optim_niter: int = 20) -> TaskMethod:
  """Nash-MTL (Navon et al., 2022, "Multi-Task Learning as a Bargaining Game").

  The Nash bargaining solution ``J^T a`` with ``a > 0`` and ``G a = 1 / a``
  (every task's share ``a_i g_i . J^T a = 1``), then scaled down to norm
  ``max_norm`` when longer (``0``: no clipping), as TorchJD's ``NashMTL``.
  ``a`` is found by damped Newton steps on ``a^T G a / 2 - sum log a``
  (``G`` in float64, scaled to unit Frobenius norm), warm-started from the
  last step's ``a``, which is state, until ``max |a_i (G a)_i - 1| <=
  1e-10`` or ``optim_niter`` steps; a solve that ends above 1e-6 logs one
  warning with its residual. TorchJD instead runs up to ``optim_niter``
  convex-concave steps through cvxpy and stops once ``||G a - 1/a|| <
  1e-3``, so it guarantees only that accuracy.
  ``update_weights_every`` reuses the weights for that many steps.

  Args:
    max_norm: the norm the result is clipped to (>= 0; 0 disables).
    update_weights_every: solve every this many steps (>= 1).
    optim_niter: the most Newton steps per solve (>= 1).

  Example:
    >>> import graphgrad as gg
    >>> method = gg.mtl.nash_mtl(max_norm=0.)
    >>> state = method.create_state(2)
    >>> g = [tf.constant([1., 0.]), tf.constant([0., 2.])]
    >>> method.combine(g, state=state).numpy().round(4)  # a = (1, 1/2)
    array([1., 1.], dtype=float32)
  """
  return _NashMTL(
      check_number("nash_mtl", "max_norm", max_norm, low=0),
      check_number("nash_mtl", "update_weights_every", update_weights_every,
                   low=1, integer=True),
      check_number("nash_mtl", "optim_niter", optim_niter, low=1,
                   integer=True))
