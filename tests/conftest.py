"""Test setup: legacy Keras for tf.compat.v1.layers, quiet TF logs.

TF_USE_LEGACY_KERAS must be set before TensorFlow is first imported; pytest
loads this file before it imports any test module or doctest.
"""

import importlib.util
import os

# TF 2.16+ needs tf-keras for tf.compat.v1.layers; TF 2.15 bundles Keras 2 and
# must not be pointed at a tf-keras that is not installed.
if importlib.util.find_spec("tf_keras") is not None:
  os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

tf1 = tf.compat.v1

# Scripts that the subprocess tests run: they read sys.argv when imported, so
# the doctest collection (--doctest-modules) must not import them.
collect_ignore = ["distributed/keras_fit_worker.py"]


@pytest.fixture
def graph():
  """A fresh tf.Graph as default graph for one test."""
  g = tf.Graph()
  with g.as_default():
    yield g


@pytest.fixture
def rng():
  return np.random.default_rng(1234)
