"""gg.mtl methods against numpy references built from the papers' equations."""

import numpy as np
import pytest
import scipy.optimize
import tensorflow as tf

import graphgrad as gg
from graphgrad.methods import _mtl_direct, _mtl_solvers, _pcgrad

tf1 = tf.compat.v1
RTOL = 1e-5


def _matrix(rng, k, n=9, conflict=False):
  j = rng.normal(size=(k, n))
  if conflict:
    for r in range(1, k):
      j[r] = -0.6 * j[0] + 0.6 * j[r]
  return j.astype(np.float32)


CASES = [(k, c) for k in (2, 3) for c in (False, True)]


def _combine(method, j, shape=None, **kw):
  grads = [tf.constant(r.reshape(shape) if shape else r) for r in j]
  return method.combine(grads, **kw).numpy().reshape(-1)


def _close(actual, expected, rtol=RTOL):
  np.testing.assert_allclose(actual, expected, rtol=rtol,
                             atol=rtol * np.abs(expected).max())


# -- numpy references -------------------------------------------------------


def np_frank_wolfe(gram, eps=1e-3, iters=100):
  """Sener & Koltun (2018), Algorithm 2."""
  k = len(gram)
  a = np.full(k, 1. / k)
  for _ in range(iters):
    t = np.argmin(gram @ a)
    e = np.eye(k)[t]
    va, vb, vc = a @ gram @ e, a @ gram @ a, gram[t, t]
    gamma = 1. if vc <= va else 0. if vb <= va else (vb - va) / (
        vb + vc - 2 * va)
    a = (1 - gamma) * a + gamma * e
    if gamma < eps:
      break
  return a


def np_dual_cone(gram, u):
  """argmin v^T G v, v >= u, exactly: NNLS on the Cholesky factor."""
  chol = np.linalg.cholesky(gram)
  x, _ = scipy.optimize.nnls(chol.T, -chol.T @ u)
  return u + x


def np_regularized(j, norm_eps=1e-4, reg_eps=1e-4):
  gram = j.astype(np.float64) @ j.T.astype(np.float64)
  tr = np.trace(gram)
  return (gram / tr if tr >= norm_eps else 0 * gram) + reg_eps * np.eye(len(j))


def np_cagrad_objective(gram, w, c):
  k = len(gram)
  g0 = np.full(k, 1. / k)
  return w @ gram @ g0 + c * np.sqrt(g0 @ gram @ g0) * np.sqrt(w @ gram @ w)


def np_gradvac(seq, beta=0.5, eps=1e-8):
  """Wang et al. (2021), Algorithm 1, on vectors, other tasks in order."""
  k = len(seq[0])
  phi_hat = np.zeros((k, k))
  outs = []
  for j in seq:
    j = j.astype(np.float64)
    total = 0
    for i in range(k):
      g = j[i].copy()
      for o in [o for o in range(k) if o != i]:
        ni, no = np.linalg.norm(g), np.linalg.norm(j[o])
        phi = g @ j[o] / (ni * no + eps)
        if phi < phi_hat[i, o]:
          h = phi_hat[i, o]
          g = g + ni * (h * np.sqrt(1 - phi**2) - phi * np.sqrt(1 - h**2)) / (
              no * np.sqrt(1 - h**2) + eps) * j[o]
        phi_hat[i, o] = (1 - beta) * phi_hat[i, o] + beta * phi
      total = total + g
    outs.append(total)
  return outs


# -- the methods ------------------------------------------------------------


@pytest.mark.parametrize("k,conflict", CASES)
def test_baselines_and_pcgrad(rng, k, conflict):
  j = _matrix(rng, k, conflict=conflict)
  _close(_combine(gg.mtl.mean(), j), j.mean(0))
  _close(_combine(gg.mtl.sum(), j), j.sum(0))
  got = _combine(gg.mtl.pcgrad(shuffle=False), j, shape=(3, 3))
  ref = 0
  for i in range(k):
    g = j[i].astype(np.float64)
    for o in [o for o in range(k) if o != i]:
      d = g @ j[o]
      g = g - min(d, 0) / (j[o] @ j[o]) * j[o]
    ref = ref + g
  _close(got, ref)
  proj = _pcgrad.project([[tf.constant(r)] for r in j], [tf.constant(j[0])],
                         shuffle=False)[0].numpy()
  np.testing.assert_array_equal(got, proj)


@pytest.mark.parametrize("k,conflict", CASES)
def test_mgda_is_frank_wolfe_and_exact_for_two(rng, k, conflict):
  j = _matrix(rng, k, conflict=conflict)
  gram = j.astype(np.float64) @ j.T
  got = _combine(gg.mtl.mgda(), j)
  _close(got, np_frank_wolfe(gram) @ j)
  if k == 2:
    g1, g2 = j.astype(np.float64)
    w = np.clip((g2 - g1) @ g2 / ((g1 - g2) @ (g1 - g2)), 0, 1)
    _close(got, w * g1 + (1 - w) * g2)


@pytest.mark.parametrize("k,conflict", CASES)
def test_upgrad_and_dualproj_solve_the_dual_cone_programs(rng, k, conflict):
  j = _matrix(rng, k, conflict=conflict)
  gram = np_regularized(j)
  u = np.full(k, 1. / k)
  upgrad = sum(np_dual_cone(gram, u[i] * np.eye(k)[i]) for i in range(k))
  _close(_combine(gg.mtl.upgrad(), j), upgrad @ j)
  _close(_combine(gg.mtl.dualproj(), j), np_dual_cone(gram, u) @ j)
  pref = np.arange(1., k + 1)
  _close(_combine(gg.mtl.dualproj(pref_vector=list(pref)), j),
         np_dual_cone(gram, pref) @ j)
  out = _combine(gg.mtl.upgrad(reg_eps=0.), j)
  assert (j @ out).min() > -1e-5 * np.abs(j @ out).max()  # no conflict


def test_iterative_dual_cone_solver_meets_its_tolerance(rng):
  for k in (3, 10):
    j = _matrix(rng, k, n=20, conflict=True)
    gram = np_regularized(j)
    units = np.diag(np.full(k, 1. / k))
    got = _mtl_solvers._gauss_seidel(tf.constant(units), tf.constant(gram),
                                     k).numpy()
    ref = np.stack([np_dual_cone(gram, u) for u in units])
    _close(got, ref, rtol=1e-6)
  _close(_combine(gg.mtl.upgrad(), j), ref.sum(0) @ j, rtol=1e-5)  # k = 10


@pytest.mark.parametrize("k,conflict", CASES)
def test_cagrad_solves_its_program(rng, k, conflict):
  j = _matrix(rng, k, conflict=conflict)
  gram = j.astype(np.float64) @ j.T
  c = 0.5
  got = _combine(gg.mtl.cagrad(c), j)
  if k == 2:
    def f(t):
      return np_cagrad_objective(gram, np.array([t, 1 - t]), c)
    t = scipy.optimize.minimize_scalar(f, bounds=(0, 1), method="bounded",
                                       options={"xatol": 1e-12}).x
    w = np.array([t, 1 - t])
  else:
    res = scipy.optimize.minimize(
        lambda w: np_cagrad_objective(gram, w, c), np.full(k, 1. / k),
        method="SLSQP", bounds=[(0, 1)] * k, options={"ftol": 1e-15},
        constraints={"type": "eq", "fun": lambda w: w.sum() - 1})
    w = res.x
  g0 = j.astype(np.float64).mean(0)
  gw = w @ j
  ref = g0 + c * np.linalg.norm(g0) / np.linalg.norm(gw) * gw
  _close(got, ref, rtol=RTOL if k == 2 else 1e-3)
  # The primal: within the ball around g0, the worst task improves most.
  assert np.linalg.norm(got - g0) <= c * np.linalg.norm(g0) * (1 + 1e-5)
  assert (j @ got).min() >= (j @ ref).min() - 1e-6 * np.abs(j @ ref).max()
  _close(_combine(gg.mtl.cagrad(0.), j), g0)


@pytest.mark.parametrize("k,conflict", CASES)
def test_imtl_g_equal_projections_by_the_papers_formula(rng, k, conflict):
  j = _matrix(rng, k, conflict=conflict).astype(np.float64)
  units = j / np.linalg.norm(j, axis=1, keepdims=True)
  d = j[0] - j[1:]
  u = units[0] - units[1:]
  alpha = j[0] @ u.T @ np.linalg.inv(d @ u.T)
  weights = np.concatenate([[1 - alpha.sum()], alpha])
  got = _combine(gg.mtl.imtl_g(), j.astype(np.float32))
  _close(got, weights @ j)
  proj = units @ got
  _close(proj, np.full(k, proj[0]), rtol=1e-4)


@pytest.mark.parametrize("k,conflict", CASES)
def test_aligned_mtl_by_the_svd_of_the_gradients(rng, k, conflict):
  j = _matrix(rng, k, conflict=conflict)
  p, s, qt = np.linalg.svd(j.astype(np.float64), full_matrices=False)
  u = np.full(k, 1. / k)
  for mode, scale in (("min", s.min()), ("rmse", np.sqrt((s**2).mean())),
                      ("median", np.sqrt(np.sort(s**2)[(k - 1) // 2]))):
    aligned = scale * p @ qt  # Senushkin et al.: singular values equalised
    _close(_combine(gg.mtl.aligned_mtl(scale_mode=mode), j), u @ aligned)


@pytest.mark.parametrize("k,conflict", CASES)
def test_config_eq2(rng, k, conflict):
  j = _matrix(rng, k, conflict=conflict).astype(np.float64)
  units = j / np.linalg.norm(j, axis=1, keepdims=True)
  d = np.linalg.pinv(units) @ np.ones(k)
  d /= np.linalg.norm(d)
  got = _combine(gg.mtl.config(), j.astype(np.float32))
  _close(got, (j @ d).sum() * d)
  cos = units @ got / np.linalg.norm(got)
  _close(cos, np.full(k, cos[0]), rtol=1e-4)  # equal angles to every task


@pytest.mark.parametrize("k,conflict", CASES)
def test_graddrop_sign_purity(rng, k, conflict):
  j = _matrix(rng, k, conflict=conflict)
  noise = rng.uniform(size=j.shape[1]).astype(np.float32)
  leak = np.linspace(0., 0.5, k)
  p = 0.5 * (1 + j.sum(0) / np.abs(j).sum(0))
  keep = ((p > noise) & (j > 0)) | ((p < noise) & (j < 0))
  ref = ((leak[:, None] + (1 - leak[:, None]) * keep) * j).sum(0)
  got = _mtl_direct.graddrop_with_noise(tf.constant(j), tf.constant(noise),
                                        None, list(leak), "graddrop", k)
  _close(got.numpy(), ref)
  out = _combine(gg.mtl.graddrop(seed=3), j)
  pos, neg = np.where(j > 0, j, 0).sum(0), np.where(j < 0, j, 0).sum(0)
  # Every element keeps one sign: all the tasks' values of that sign.
  assert (np.isclose(out, pos) | np.isclose(out, neg)).all()
  _close(_combine(gg.mtl.graddrop(leak=[1.] * k), j), j.sum(0))


@pytest.mark.parametrize("k", [2, 3])
def test_gradvac_targets_across_steps(rng, k):
  seq = [_matrix(rng, k, conflict=s % 2 == 1) for s in range(4)]
  method = gg.mtl.gradvac(beta=0.3, shuffle=False)
  state = method.create_state(k)
  got = [_combine(method, j, state=state) for j in seq]
  for a, b in zip(got, np_gradvac(seq, beta=0.3)):
    _close(a, b)


@pytest.mark.parametrize("k", [2, 3])
def test_nash_mtl_bargaining_solution(rng, k):
  j = _matrix(rng, k, conflict=True).astype(np.float64)
  gram = j @ j.T

  def residual(log_a):
    a = np.exp(log_a)
    return gram @ a - 1 / a
  a = np.exp(scipy.optimize.fsolve(residual, np.zeros(k), xtol=1e-14))
  method = gg.mtl.nash_mtl(max_norm=0.)
  state = method.create_state(k)
  _close(_combine(method, j.astype(np.float32), state=state), a @ j)
  _close(state.alpha.numpy(), a)
  clipped = _combine(gg.mtl.nash_mtl(max_norm=0.5), j.astype(np.float32),
                     state=gg.mtl.nash_mtl().create_state(k))
  _close(clipped, 0.5 * (a @ j) / np.linalg.norm(a @ j))


def test_nash_mtl_reuses_weights_between_updates(rng):
  method = gg.mtl.nash_mtl(max_norm=0., update_weights_every=2)
  state = method.create_state(2)
  j1, j2 = _matrix(rng, 2), _matrix(rng, 2)
  _combine(method, j1, state=state)
  alpha = state.alpha.numpy()
  _close(_combine(method, j2, state=state), alpha @ j2)
  assert int(state.step.numpy()) == 2


ALL = [gg.mtl.mean(), gg.mtl.sum(), gg.mtl.pcgrad(shuffle=False),
       gg.mtl.mgda(), gg.mtl.upgrad(), gg.mtl.dualproj(), gg.mtl.cagrad(0.4),
       gg.mtl.imtl_g(), gg.mtl.aligned_mtl(), gg.mtl.config(),
       gg.mtl.graddrop(leak=[0.5, 0.5, 0.5]),
       gg.mtl.gradvac(shuffle=False), gg.mtl.nash_mtl()]


@pytest.mark.parametrize("method", ALL, ids=lambda m: m.name)
def test_graph_eager_and_function_agree(rng, method):
  j = _matrix(rng, 3, n=12, conflict=True).reshape(3, 4, 3)
  eager = method.combine([tf.constant(r) for r in j],
                         state=method.create_state(3)).numpy()
  fn_state = method.create_state(3)
  fn = tf.function(lambda *g: method.combine(list(g), state=fn_state))
  traced = fn(*[tf.constant(r) for r in j]).numpy()
  with tf.Graph().as_default():
    out = method.combine([tf.constant(r) for r in j],
                         state=method.create_state(3), name="combined")
    assert out.op.name.startswith("combined")
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      graph = sess.run(out)
  assert eager.shape == (4, 3) and eager.dtype == np.float32
  if method.name != "graddrop":  # its draws differ between runs
    _close(traced, eager, rtol=1e-6)
    _close(graph, eager, rtol=1e-6)
  assert repr(method).startswith(method.name + "(")


# -- state --------------------------------------------------------------------


def test_state_is_per_create_state_and_saved(tmp_path, rng):
  method = gg.mtl.gradvac(shuffle=False)
  j = _matrix(rng, 2, conflict=True)
  with tf.Graph().as_default():
    a, b = method.create_state(2, "layer_a"), method.create_state(2, "layer_b")
    out = method.combine([tf.constant(r) for r in j], state=a)
    assert not tf1.trainable_variables()
    assert {v.name for v in tf1.global_variables()} == {
        "layer_a_phi:0", "layer_b_phi:0"}
    saver = tf1.train.Saver()
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      sess.run(out)
      moved, untouched = sess.run([a.phi, b.phi])
      path = saver.save(sess, str(tmp_path / "ckpt"))
    with tf1.Session() as sess:
      saver.restore(sess, path)
      np.testing.assert_array_equal(sess.run(a.phi), moved)
  assert np.abs(moved).max() > 0 and not untouched.any()
  state = gg.mtl.nash_mtl().create_state(2)
  method = gg.mtl.nash_mtl()
  method.combine([tf.constant(r) for r in j], state=state)
  ckpt = tf.train.Checkpoint(state=state)
  saved = ckpt.write(str(tmp_path / "tf2"))
  alpha = state.alpha.numpy()
  state.alpha.assign(tf.zeros([2], tf.float64))
  ckpt.read(saved).assert_consumed()
  np.testing.assert_array_equal(state.alpha.numpy(), alpha)


# -- errors -------------------------------------------------------------------


@pytest.mark.parametrize("make,match", [
    (lambda: gg.mtl.pcgrad(shuffle=1), r"pcgrad: `shuffle` must be True"),
    (lambda: gg.mtl.gradvac(shuffle="no"), r"gradvac: `shuffle` must be"),
    (lambda: gg.mtl.mgda(epsilon=0), r"mgda: `epsilon` must be a number > 0"),
    (lambda: gg.mtl.mgda(max_iters=1.5), r"mgda: `max_iters` must be an int"),
    (lambda: gg.mtl.cagrad(-1), r"cagrad: `c` must be a number >= 0"),
    (lambda: gg.mtl.gradvac(beta=2), r"gradvac: `beta` must be .* <= 1"),
    (lambda: gg.mtl.nash_mtl(update_weights_every=0),
     r"nash_mtl: `update_weights_every` must be an integer >= 1"),
    (lambda: gg.mtl.upgrad(norm_eps="x"), r"upgrad: `norm_eps` must be a"),
    (lambda: gg.mtl.dualproj(pref_vector="ab"),
     r"dualproj: `pref_vector` must be None or a non-empty list"),
    (lambda: gg.mtl.config(pref_vector=[]), r"config: `pref_vector` must"),
    (lambda: gg.mtl.aligned_mtl(scale_mode="max"),
     r"aligned_mtl: `scale_mode` must be 'min', 'median' or 'rmse'"),
    (lambda: gg.mtl.graddrop(f=3), r"graddrop: `f` must be None or a call"),
])
def test_factories_validate_hyperparameters(make, match):
  with pytest.raises(gg.GraphGradError, match=match):
    make()


def test_combine_validates_its_inputs():
  a = tf.constant([1., 2.])
  cases = [
      (gg.mtl.mean(), a, {}, r"mean.combine: `grads` must be a list"),
      (gg.mtl.mean(), [None, None], {}, r"at least one gradient that is not"),
      (gg.mtl.upgrad(), [a, tf.constant([1., 2., 3.])], {},
       r"upgrad.combine: `grads\[1\]` must be a floating-point tensor of the"),
      (gg.mtl.sum(), [tf.constant([1, 2])], {}, r"`grads\[0\]` must be a fl"),
      (gg.mtl.gradvac(), [a, a], {}, r"gradvac: `state` is required"),
      (gg.mtl.nash_mtl(), [a, a], {"state": gg.mtl.nash_mtl().create_state(3)},
       r"nash_mtl: `state` was made for 3 tasks but `grads` holds 2"),
      (gg.mtl.upgrad(pref_vector=[1., 2., 3.]), [a, a], {},
       r"`pref_vector` has 3 entries but `grads` holds 2"),
      (gg.mtl.cagrad(), [a] * 9, {},
       r"cagrad.combine: `grads` must hold at most 8"),
  ]
  for method, grads, kw, match in cases:
    with pytest.raises(gg.GraphGradError, match=match):
      method.combine(grads, **kw)


def test_none_counts_as_zero():
  a = tf.constant([1., 2.])
  np.testing.assert_allclose(gg.mtl.mean().combine([a, None]).numpy(),
                             [0.5, 1.])


def test_linearly_dependent_tasks(rng):
  j = rng.normal(size=(3, 7))
  j[2] = -0.5 * j[0] + 0.5 * j[1]
  p, s, qt = np.linalg.svd(j, full_matrices=False)
  p, s, qt = p[:, :2], s[:2], qt[:2]  # rank 2
  u = np.full(3, 1. / 3)
  j32 = j.astype(np.float32)
  _close(_combine(gg.mtl.aligned_mtl(), j32), u @ (s.min() * p @ qt),
         rtol=1e-4)
  gram = j @ j.T
  v = np.linalg.pinv(gram) @ np.sqrt(np.diag(gram))
  _close(_combine(gg.mtl.imtl_g(), j32), v / v.sum() @ j, rtol=1e-4)
  units = j / np.linalg.norm(j, axis=1, keepdims=True)
  d = np.linalg.pinv(units) @ np.ones(3)
  d /= np.linalg.norm(d)
  _close(_combine(gg.mtl.config(), j32), (j @ d).sum() * d, rtol=1e-4)
