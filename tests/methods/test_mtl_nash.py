"""Nash-MTL reaches the Nash bargaining solution, or says it did not."""

import logging

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg


def _adversarial(rng, k, n=50):
  """g0 . g1 < 0 (nearly opposite), g2 agreeing with both, then small tasks."""
  j = rng.normal(size=(k, n))
  j[1] = -0.9 * j[0] + 0.1 * rng.normal(size=n)
  if k > 2:
    unit = j[:2] / np.linalg.norm(j[:2], axis=1, keepdims=True)
    j[2] = 3.0 * (unit[0] + unit[1])  # on the bisector: agrees with both
    j[2:] *= np.logspace(0, -3, k - 2)[:, None]
  return j


def _solve(j, **kw):
  """The method's direction and weights on the float32 gradients ``j``."""
  method = gg.mtl.nash_mtl(max_norm=0., **kw)
  state = method.create_state(len(j))
  d = method.combine([tf.constant(g, tf.float32) for g in j], state=state)
  return d.numpy().astype(np.float64), state.alpha.numpy()


@pytest.mark.parametrize("k", range(2, 11))
@pytest.mark.parametrize("adversarial", [False, True])
def test_nash_mtl_solves_the_bargaining_equations(k, adversarial, rng,
                                                  caplog):
  j = (_adversarial(rng, k) if adversarial else rng.normal(size=(k, 50)))
  j = j.astype(np.float32).astype(np.float64)  # the gradients as given
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    d, a = _solve(j)
  gram = j @ j.T
  if adversarial and k > 2:
    assert gram[0, 1] < 0 and gram[0, 2] > 0 and gram[1, 2] > 0
  assert np.all(a > 0)
  # G a = 1 / a elementwise, to 1e-6 relative.
  np.testing.assert_allclose(gram @ a, 1. / a, rtol=1e-6)
  np.testing.assert_allclose(d, j.T @ a, rtol=1e-5,
                             atol=1e-6 * np.abs(j.T @ a).max())
  assert not caplog.records


def test_the_three_task_case_with_one_conflict(rng):
  j = _adversarial(rng, 3).astype(np.float32).astype(np.float64)
  d, a = _solve(j)
  gram = j @ j.T
  # Each task's share of the direction is one: a_i g_i . d = 1.
  np.testing.assert_allclose(a * (j @ d), np.ones(3), rtol=1e-5)
  np.testing.assert_allclose(a * (gram @ a), np.ones(3), rtol=1e-6)


def test_a_solve_that_stops_short_warns_once_with_its_residual(rng, caplog):
  j = rng.normal(size=(8, 50)).astype(np.float32)
  method = gg.mtl.nash_mtl(max_norm=0., optim_niter=1)
  state = method.create_state(8)
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    for _ in range(2):  # the second solve starts nearer, still short
      state.alpha.assign(np.ones(8) * 50.)
      method.combine([tf.constant(g) for g in j], state=state)
  (record,) = caplog.records
  a = state.alpha.numpy()
  gram = j.astype(np.float64) @ j.T.astype(np.float64)
  residual = np.abs(a * (gram @ a) - 1).max()
  assert residual > 1e-6
  assert "did not converge in optim_niter=1 Newton steps" in (
      record.getMessage())
  assert "max |a_i (G a)_i - 1| = " in record.getMessage()
