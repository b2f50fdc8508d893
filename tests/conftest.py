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
# setup.cfg runs `pytest` on two workers (`-n 2 --no-loadscope-reorder`), and
# pytest_xdist_make_scheduler below hands out units of work: a worker takes
# the next unit when it has two tests or fewer left, and runs a unit's tests
# in order. A unit is one test, or every test that SAME_WORKER names with
# one key:
#   - tests that share a module- or session-scoped fixture of this suite (an
#     exported graph, a cluster run, a subprocess's results), so that the
#     fixture is built once, not once per worker. Collection checks this
#     (_check_shared_fixtures): a new shared fixture needs its entry here;
#   - "host-ports": tests that pick free ports of this machine's network
#     namespace and bind them later in another process (Jupyter kernels,
#     MultiWorkerMirroredStrategy); side by side, one could take a port the
#     other picked. (The TF1 clusters run in private network namespaces.)
# xdist_group marks are not used: pytest 9.2 ignores the node ids that
# `--dist loadgroup` rewrites (pytest-xdist issue 1386).
# Units start longest first (SECONDS: CPU seconds of the tests of a file or
# function, with their fixtures and subprocesses, measured with two workers on
# two shared cores; a test not listed counts as 0 and keeps its collection
# order), so that no long unit starts last and both workers end together.
SAME_WORKER = {
    "host-ports": (
        "tests/test_notebooks.py::test_notebook_runs_top_to_bottom[",
        "tests/test_notebook_tf2.py::test_notebook_04_executes[",
        "tests/test_notebook_tf2.py::test_notebook_06_executes[",
        "tests/test_notebook_tf2.py::test_notebook_08_executes",
        "tests/distributed/test_strategies.py::"
        "test_multi_worker_two_processes_equal_one_device",
    ),
    "legacy-export": (
        "tests/analysis/test_lost_overrides.py::",
        "tests/cli/test_inspect_legacy.py::"
        "test_names_lost_overrides_of_a_graph_from_another_process",
    ),
    "mirrored": (
        "tests/distributed/test_strategies.py::test_mirrored_",
    ),
    "cluster-sync-run": ("tests/distributed/test_cluster.py::",),
    "methods-digits": ("tests/methods/test_methods_digits.py::",),
    "mtl-digits": ("tests/methods/test_mtl_digits.py::",),
    # One folder of models, built once.
    "scan-models": ("tests/cli/test_scan.py::",),
    # setup_module / teardown_module: one parity matrix per run.
    "parity": ("tests/keras/test_parity.py::",),
    "tf2-saved-models": ("tests/cli/test_tf2_saved_models.py::",),
}
SECONDS = {
    "tests/cli/test_tf2_saved_models.py": 80,
    "tests/test_notebooks.py::test_notebook_runs_top_to_bottom": 154,
    "tests/test_notebook_tf2.py::test_notebook_06_executes": 35,
    "tests/test_notebook_tf2.py::test_notebook_04_executes": 20,
    "tests/test_notebook_tf2.py::test_notebook_08_executes": 50,
    "tests/distributed/test_strategies.py::"
    "test_multi_worker_two_processes_equal_one_device": 38,
    "tests/distributed/test_keras_fit_faults.py": 55,
    "tests/keras/test_parity.py": 48,
    "tests/keras/test_parity_more.py": 40,
    "tests/keras/test_keras_privatize_layers.py": 32,
    "tests/test_benchmarks_smoke.py": 43,
    "tests/keras/test_mtl_parity.py": 33,
    "tests/distributed/test_cluster_faults.py": 32,
    "tests/distributed/test_strategies.py::"
    "test_mirrored_upstream_rewrites_per_replica": 32,
    "tests/distributed/test_cluster.py": 37,
    "tests/analysis/test_lost_overrides.py": 25,
    "tests/cli/test_example.py": 28,
    "tests/methods/test_mtl_digits.py": 26,
    "tests/methods/test_methods_digits.py": 24,
    "tests/cli/test_cli_errors.py::"
    "test_tensorflow_start_up_logs_stay_off_the_terminal": 13,
    "tests/keras/test_keras_benchmark.py": 11,
    "tests/test_example_keras_fit.py": 9,
    "tests/plan/test_properties.py": 4,
    "tests/cli/test_cli_errors.py::test_verbose_shows_tensorflow_logs": 7,
    "tests/cli/test_inspect_legacy.py::"
    "test_names_lost_overrides_of_a_graph_from_another_process": 6,
    # Each a command line in a process of its own, under strace.
    "tests/cli/test_sandbox.py::"
    "test_a_graph_that_crashes_or_exhausts_the_child_is_one_line": 20,
    "tests/cli/test_sandbox.py::test_a_write_by_a_hidden_route_is_contained":
        18,
    "tests/cli/test_sandbox.py::test_a_graph_that_touches_files_is_contained":
        10,
    "tests/cli/test_sandbox.py::"
    "test_a_crafted_file_is_one_line_with_the_sandbox_alone": 9,
    "tests/cli/test_sandbox.py::"
    "test_a_saved_model_that_touches_files_is_contained": 120,
    "tests/cli/test_scan.py": 40,
}


def _unit(nodeid: str) -> str:
  """The unit of work of a test: its SAME_WORKER key, else its node id."""
  for key, prefixes in SAME_WORKER.items():
    if nodeid.startswith(prefixes):
      return key
  return nodeid


def _seconds_key(nodeid: str):
  """The SECONDS entry that covers a test: its function's, else its file's."""
  path, _, rest = nodeid.partition("::")
  function = f"{path}::{rest.split('[')[0]}"
  return function if function in SECONDS else (
      path if path in SECONDS else None)


def _check_shared_fixtures(items) -> None:
  """Raises if the users of one shared fixture are in different units."""
  users = {}
  for item in items:
    info = getattr(item, "_fixtureinfo", None)  # None for doctests
    for name in info.names_closure if info else ():
      for fixturedef in info.name2fixturedefs.get(name, ()):
        if (fixturedef.scope in ("module", "package", "session")
            and fixturedef.baseid.startswith("tests")):
          users.setdefault(f"{fixturedef.baseid}::{name}", []).append(item)
  for fixture, found in users.items():
    units = {_unit(i.nodeid) for i in found}
    if len(units) > 1:
      raise pytest.UsageError(
          f"the tests that use the shared fixture {fixture} would run on "
          f"different workers ({len(units)} units of work); give them one "
          f"entry in SAME_WORKER in tests/conftest.py")


def pytest_collection_modifyitems(config, items):
  if os.environ.get("PYTEST_XDIST_WORKER"):
    _check_shared_fixtures(items)
  # Every worker collects, and must find the same order.
  units = {}
  for item in items:
    units.setdefault(_unit(item.nodeid), []).append(item)
  # A SECONDS entry covers all its tests: each test gets an equal share.
  keys = [_seconds_key(item.nodeid) for item in items]
  share = {k: SECONDS[k] / keys.count(k) for k in set(keys) if k}
  cost = {k: sum(share.get(_seconds_key(i.nodeid), 0.0) for i in unit)
          for k, unit in units.items()}
  order = sorted(units, key=lambda k: -cost[k])  # stable: ties keep order
  items[:] = [item for k in order for item in units[k]]
  del config


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook
def pytest_xdist_make_scheduler(config, log):
  """Units of work as _unit says (see above), in collection order."""
  from xdist.scheduler import LoadScopeScheduling  # pylint: disable=g-import-not-at-top

  class UnitScheduling(LoadScopeScheduling):
    def _split_scope(self, nodeid):
      return _unit(nodeid)

  return UnitScheduling(config, log)


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
