"""The training methods on real data: scikit-learn's bundled 8x8 digits.

A reduced run of ``python -m benchmarks.methods`` (which trains seeds 0, 1
and 2 for 40 epochs and writes benchmarks/METHODS.md): seed 0 only, with the
same 40 epochs. Every method must reach 90% test accuracy (backprop reaches
~97%) and beat the control in which only the top layer trains on fixed
random features (~90% after 40 epochs), which shows that the lower layers
learn from the method's signal.
"""

import pytest

from benchmarks import methods

EPOCHS = 40


@pytest.fixture(scope="module")
def data():
  return methods.load_digits()


@pytest.fixture(scope="module")
def control(data):
  return methods.run("top_only", seed=0, epochs=EPOCHS, data=data)[-1]


def test_fixed_split(data):
  x_train, x_test, y_train, y_test = data
  assert x_train.shape == (1437, 64) and x_test.shape == (360, 64)
  assert set(y_test) == set(range(10))


@pytest.mark.slow
@pytest.mark.parametrize("method", [m for m in methods.METHODS
                                    if m != "top_only"])
def test_method_learns_the_digits(data, control, method):
  accuracy = methods.run(method, seed=0, epochs=EPOCHS, data=data)[-1]
  assert accuracy >= 0.90, (method, accuracy)
  assert accuracy > control, (method, accuracy, control)
