"""The training methods on real data: scikit-learn's bundled 8x8 digits.

A reduced run of ``python -m benchmarks.methods`` (which trains 3 seeds for
40 epochs and writes benchmarks/METHODS.md): seed 0, 10 epochs. The floor is
looser than the full run's 90%: after 10 epochs every method is above 88%
(backprop ~97%), and each must beat the control in which only the top layer
trains on fixed random features (~84%), which shows that the lower layers
learn from the method's signal.
"""

import pytest

from benchmarks import methods


@pytest.fixture(scope="module")
def data():
  return methods.load_digits()


@pytest.fixture(scope="module")
def control(data):
  return methods.run("top_only", seed=0, epochs=10, data=data)[-1]


def test_fixed_split(data):
  x_train, x_test, y_train, y_test = data
  assert x_train.shape == (1437, 64) and x_test.shape == (360, 64)
  assert set(y_test) == set(range(10))


@pytest.mark.slow
@pytest.mark.parametrize("method", [m for m in methods.METHODS
                                    if m != "top_only"])
def test_method_learns_the_digits(data, control, method):
  accuracy = methods.run(method, seed=0, epochs=10, data=data)[-1]
  assert accuracy >= 0.88, (method, accuracy)
  assert accuracy > control, (method, accuracy, control)
