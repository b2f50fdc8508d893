"""The supported TensorFlow range: one place (graphgrad._installed),
agreeing with setup.cfg; the installed version, read without importing
TensorFlow.

The private TensorFlow APIs are tested in test_tf_private.py.
"""

import configparser
import importlib.metadata
import logging
import pathlib
import re
import sys

import pytest
import tensorflow as tf

from graphgrad import _compat, _installed

tf1 = tf.compat.v1

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_running_tensorflow_is_in_the_supported_range():
  if "dev" in tf.__version__ and _compat.TF_VERSION > _installed.NEWEST:
    pytest.skip(f"a TensorFlow build newer than the tested range "
                f"({tf.__version__}, tools/test_newest_tf.sh)")
  assert _installed.OLDEST <= _compat.TF_VERSION <= _installed.NEWEST


def test_setup_cfg_declares_the_same_range():
  cfg = configparser.ConfigParser()
  cfg.read(ROOT / "setup.cfg")
  requires = cfg["options"]["install_requires"]
  m = re.search(r"tensorflow>=(\d+)\.(\d+),<(\d+)\.(\d+)", requires)
  assert m, requires
  lo, hi = tuple(map(int, m.group(1, 2))), tuple(map(int, m.group(3, 4)))
  assert lo == _installed.OLDEST
  assert hi == (_installed.NEWEST[0], _installed.NEWEST[1] + 1)


@pytest.mark.parametrize("version", ["2.14.1", "2.22.0rc1", "3.0.0"])
def test_unsupported_tensorflow_warns(version, caplog):
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    assert not _installed.check_tensorflow(version)
  (record,) = caplog.records
  assert re.search(rf"tested with TensorFlow 2\.15 to 2\.21; found "
                   rf"{re.escape(version)}\. .*pip install "
                   rf"'tensorflow>=2\.15,<2\.22'", record.getMessage())


@pytest.mark.parametrize("version", ["2.15.0", "2.16.2", "2.21.0"])
def test_supported_tensorflow_is_quiet(version, caplog):
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    assert _installed.check_tensorflow(version)
  assert not caplog.records


def test_the_installed_version_is_the_imported_one():
  assert _installed.tensorflow_version() == tf.__version__


def test_the_installed_version_is_read_from_a_distribution(monkeypatch):
  monkeypatch.delitem(sys.modules, "tensorflow")
  asked = []

  def version(name):
    asked.append(name)
    if name != "tf-nightly":
      raise importlib.metadata.PackageNotFoundError(name)
    return "2.23.0.dev20261026"

  monkeypatch.setattr(importlib.metadata, "version", version)
  assert _installed.tensorflow_version() == "2.23.0.dev20261026"
  assert asked[0] == "tensorflow" and asked[-1] == "tf-nightly"


def test_no_tensorflow_installed_is_no_version_and_no_warning(
    monkeypatch, caplog):
  monkeypatch.delitem(sys.modules, "tensorflow")

  def version(name):
    raise importlib.metadata.PackageNotFoundError(name)

  monkeypatch.setattr(importlib.metadata, "version", version)
  assert _installed.tensorflow_version() is None
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    assert not _installed.check_tensorflow()
  assert not caplog.records
