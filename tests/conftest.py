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


# -- how the suite is spread over pytest-xdist workers ------------------------
#
# setup.cfg runs `pytest` on two workers with `--dist loadgroup
# --no-loadscope-reorder`: a worker takes the next unit of work when it has
# two tests or fewer left. A unit is one test, or every test of one
# xdist_group, which one worker runs in order. This hook makes the groups:
#   - tests that share a module- or session-scoped fixture of this suite (an
#     exported graph, a cluster run, a subprocess's results), directly or
#     through each other, form one group, so the fixture is built once, not
#     once per worker;
#   - HOST_PORTS: tests that pick free ports of this machine's network
#     namespace and bind them later in another process (Jupyter kernels,
#     MultiWorkerMirroredStrategy); side by side, one could take a port the
#     other picked. (The TF1 clusters run in private network namespaces.)
# Units start longest first (SECONDS below, measured on two loaded cores; a
# test not listed counts as 0 and keeps its collection order), so that no
# long unit starts last and both workers end together.
HOST_PORTS = (
    "tests/test_notebooks.py::test_notebook_runs_top_to_bottom",
    "tests/test_notebook_tf2.py::test_notebook_04_executes",
    "tests/test_notebook_tf2.py::test_notebook_06_executes",
    "tests/distributed/test_strategies.py::"
    "test_multi_worker_two_processes_equal_one_device",
)
SECONDS = {
}


def _key(item) -> str:
  """``path::function``: the test's node id without parameters or class."""
  return (item.nodeid.split("::")[0] + "::"
          + getattr(item, "originalname", item.name))


def _labels(item):
  """What ``item`` must share a worker for: fixtures and HOST_PORTS."""
  labels = ["host-ports"] if _key(item) in HOST_PORTS else []
  info = getattr(item, "_fixtureinfo", None)  # None for doctests
  for name in info.names_closure if info else ():
    for fixturedef in info.name2fixturedefs.get(name, ()):
      if (fixturedef.scope in ("module", "package", "session")
          and fixturedef.baseid.startswith("tests")):
        labels.append(f"{fixturedef.baseid}::{name}")
  return labels


def _estimate(item) -> float:
  return SECONDS.get(_key(item), SECONDS.get(item.nodeid.split("::")[0], 0.0))


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
  del config
  parent = {}  # union-find over labels: one group per connected set

  def root(label):
    while parent.setdefault(label, label) != label:
      label = parent[label]
    return label

  labels = {item: _labels(item) for item in items}
  for found in labels.values():
    for label in found:
      parent[root(label)] = root(found[0])
  name = {}  # a group is named after its first label in sorted order
  for label in sorted(parent):
    name.setdefault(root(label), label)
  units = {}
  for item in items:
    if labels[item]:
      group = name[root(labels[item][0])]
      item.add_marker(pytest.mark.xdist_group(group))
      units.setdefault("@" + group, []).append(item)
    else:
      units[item.nodeid] = [item]
  cost = {key: sum(_estimate(i) for i in unit) for key, unit in units.items()}
  order = sorted(units, key=lambda key: -cost[key])  # stable: ties keep order
  items[:] = [item for key in order for item in units[key]]


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
