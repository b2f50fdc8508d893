"""Every gg.mtl method trains MultiDigits (seed 0 of benchmarks/mtl.py).

A reduced run of ``python -m benchmarks.mtl``: the two digit tasks (left and
right, as MultiMNIST), seed 0, 12 epochs. Each task must reach 80% test
accuracy (plain backpropagation reaches ~95%), and no method may fall more
than 5 points below ``mean()`` on any task.
"""

import pytest

from benchmarks import mtl
from graphgrad import demo

EPOCHS = 12
TASKS = ("left", "right")


@pytest.fixture(scope="module")
def data():
  return demo.multi_digits_problem(0)


@pytest.fixture(scope="module")
def baseline(data):
  return mtl.run("mean", seed=0, epochs=EPOCHS, data=data, tasks=TASKS)


def test_pairs_come_from_disjoint_splits(data):
  assert data.x_train.shape == (4096, 128) and data.x_test.shape == (1024, 128)
  train = {r.tobytes() for r in data.x_train.reshape(-1, 8, 2, 8)
           .transpose(0, 2, 1, 3).reshape(-1, 64)}
  test = {r.tobytes() for r in data.x_test.reshape(-1, 8, 2, 8)
          .transpose(0, 2, 1, 3).reshape(-1, 64)}
  assert not train & test


@pytest.mark.parametrize("method", list(mtl.METHODS))
def test_method_trains_every_task(data, baseline, method):
  accuracy = mtl.run(method, seed=0, epochs=EPOCHS, data=data, tasks=TASKS)
  for task, a, b in zip(TASKS, accuracy, baseline):
    assert a >= 0.80, (method, task, a)
    assert a >= b - 0.05, (method, task, a, b)
