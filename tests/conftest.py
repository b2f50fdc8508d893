"""Test setup: legacy Keras for tf.compat.v1.layers, quiet TF logs, the
hypothesis profile, and how the suite is spread over pytest-xdist workers.

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
from hypothesis import HealthCheck, settings  # noqa: E402

tf1 = tf.compat.v1

# Scripts that the subprocess tests run: they read sys.argv when imported, so
# the doctest collection (--doctest-modules) must not import them.
collect_ignore = ["distributed/keras_fit_worker.py"]

# Hypothesis profiles. Both draw the same examples on every run
# (derandomize) and have no deadline (a tf.Graph build takes what a shared
# machine gives it). Property tests take their example count from the
# profile, unless they set their own:
#   "ci" (the default, what `pytest` and .ci/run use): 10 examples per
#     property (tests/plan/test_properties.py: 10, and 5 for the two
#     properties that build every plan twice; tests/plan/test_bad_transforms.py:
#     10 random declaration lists);
#   "thorough": 30 per property (15 for those two), as CI ran before.
# `pytest --hypothesis-profile=thorough` selects the other one;
# GRAPHGRAD_PROPERTY_EXAMPLES=500 (see test_properties.py) explores fresh
# random examples instead.
settings.register_profile(
    "ci", max_examples=10, derandomize=True, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", settings.get_profile("ci"),
                          max_examples=30)
settings.load_profile("ci")


@pytest.fixture
def graph():
  """A fresh tf.Graph as default graph for one test."""
  g = tf.Graph()
  with g.as_default():
    yield g


@pytest.fixture
def rng():
  return np.random.default_rng(1234)


@pytest.fixture(scope="session")
def legacy_export(tmp_path_factory):
  """The directory of legacy_graphs' MetaGraph (legacy.meta) and reference
  gradients (reference.npz), exported once by a fresh process that
  registered the gradient overrides. Read-only for the tests."""
  import legacy_graphs  # pylint: disable=g-import-not-at-top
  directory = tmp_path_factory.mktemp("legacy")
  legacy_graphs.export_in_subprocess(directory)
  return directory
