"""Fixtures shared by the KerasPlan tests."""

import pytest

from keras_cases import FLAVOURS


@pytest.fixture(params=sorted(FLAVOURS))
def K(request):
  """Each Keras flavour in turn: its module (``K.layers``, ``K.Sequential``)."""
  return FLAVOURS[request.param]
