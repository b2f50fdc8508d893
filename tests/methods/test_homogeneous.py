"""``TaskMethod.homogeneous``: what the loss-scale policy relies on.

Under a loss scale ``S`` a task combination receives ``S`` times the task
gradients; a method marked homogeneous must give ``S`` times its result, so
that unscaling afterwards gives the plan's gradient without a loss scale.
Every method is checked on task gradients that conflict, in float64.
"""

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg

S = 1024.0


def _grads():
  rng = np.random.default_rng(0)
  g = [rng.normal(size=(40,)) for _ in range(3)]
  g[1] = g[1] - 1.2 * g[0]  # conflicts with the first task
  return [tf.constant(x) for x in g]


def _combined(method, grads):
  tf.random.set_seed(7)  # GradDrop draws its masks: the same draws each time
  state = method.create_state(len(grads)) if method.stateful else None
  kw = {} if state is None else {"state": state}
  return np.asarray(method.combine(list(grads), **kw))


METHODS = [n for n in gg.mtl.__all__ if n not in ("MethodState", "TaskMethod")]


@pytest.mark.parametrize("name", METHODS)
def test_a_method_marked_homogeneous_scales_with_its_input(name):
  factory = getattr(gg.mtl, name)
  method = factory(seed=3) if name == "graddrop" else factory()
  grads = _grads()
  plain = _combined(method, grads)
  scaled = _combined(method, [S * g for g in grads]) / S
  if method.homogeneous:
    np.testing.assert_allclose(scaled, plain, rtol=1e-6, atol=1e-9)
  else:
    # Nash-MTL's weights solve (G a)_i = 1 / a_i: its result does not grow
    # with the gradients (degree 0), so a loss scale would change it.
    assert name == "nash_mtl"
    assert not np.allclose(scaled, plain, rtol=1e-3)
