"""Fixtures shared by the KerasPlan tests."""

import pytest

from keras_cases import FLAVOURS


@pytest.fixture(params=sorted(FLAVOURS))
def K(request):
  """Each Keras flavour in turn: its module (``K.layers``, ``K.Sequential``)."""
  return FLAVOURS[request.param]


@pytest.fixture
def policy(K):
  """Sets the flavour's global dtype policy (``policy("mixed_float16")``);
  float32 again after the test."""
  def use(name):
    K.mixed_precision.set_global_policy(name)
  yield use
  K.mixed_precision.set_global_policy("float32")
