"""The version comes from one place: ``graphgrad.__version__``.

``setup.cfg`` reads it, the installed distribution carries it, the changelog's
newest entry is it, and ``graphgrad --version`` prints it.
"""

import configparser
import importlib.metadata
import os
import re

import graphgrad
from graphgrad.cli import _main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_setup_cfg_reads_the_version_from_the_package():
  cfg = configparser.ConfigParser()
  cfg.read(os.path.join(ROOT, "setup.cfg"))
  assert cfg["metadata"]["version"] == "attr: graphgrad.__version__"


def test_the_installed_distribution_has_the_package_version():
  assert importlib.metadata.version("graphgrad") == graphgrad.__version__


def test_the_changelog_newest_entry_is_the_version():
  with open(os.path.join(ROOT, "CHANGELOG.md")) as f:
    versions = re.findall(r"^## (\d+\.\d+\.\d+)\s*$", f.read(), re.M)
  assert versions and versions[0] == graphgrad.__version__


def test_the_command_line_prints_the_version(capsys):
  try:
    _main.main(["--version"])
  except SystemExit as e:
    assert e.code == 0
  out = capsys.readouterr().out
  assert out.split()[:2] == ["graphgrad", graphgrad.__version__]
