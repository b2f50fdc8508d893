"""What the command line answers before TensorFlow is imported.

``--help``, ``--version`` and every error about an argument or a path come
from a fresh ``python -X importtime -m graphgrad`` process that never
imports TensorFlow; a sandboxed run imports it in its child alone. The
import log on stderr says which modules were imported; the other stderr
lines are the command line's own.
"""

import os
import re
import subprocess
import sys

import pytest
import tensorflow as tf

import graphgrad
from graphgrad.cli import _confine
from helpers import dense

tf1 = tf.compat.v1
ROOT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Run:
  """A finished ``python -m graphgrad`` run, its import log set apart."""

  def __init__(self, done: subprocess.CompletedProcess):
    self.returncode = done.returncode
    self.stdout = done.stdout
    lines = done.stderr.splitlines()
    self.imported = {l.split("|")[2].strip() for l in lines
                     if l.startswith("import time:") and l.count("|") == 2}
    self.stderr = [l for l in lines if not l.startswith("import time:")]

  @property
  def imported_tensorflow(self) -> bool:
    return any(m == "tensorflow" or m.startswith("tensorflow.")
               for m in self.imported)


def _run(cwd, *argv, path=()) -> _Run:
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([*path, ROOT]))
  env.pop("TF_CPP_MIN_LOG_LEVEL", None)
  done = subprocess.run(
      [sys.executable, "-X", "importtime", "-m", "graphgrad", *argv],
      capture_output=True, text=True, env=env, cwd=cwd, timeout=300,
      check=False)
  return _Run(done)


def test_the_import_log_is_read():
  """The check below would pass vacuously if no import was logged."""
  run = _run(ROOT, "--help")
  assert "graphgrad.cli._main" in run.imported
  assert "argparse" in run.imported


@pytest.mark.parametrize("argv,expected", [
    (["--help"], "print the layer table of a saved graph"),
    (["grads", "--help"], "--no-sandbox"),
    (["inspect", "--help"], "--memory-report"),
    (["demo", "--help"], "--batch-size"),
])
def test_help_imports_no_tensorflow(tmp_path, argv, expected):
  run = _run(tmp_path, *argv)
  assert run.returncode == 0, run.stderr
  assert expected in run.stdout
  assert not run.stderr
  assert not run.imported_tensorflow


def test_version_names_tensorflow_without_importing_it(tmp_path):
  run = _run(tmp_path, "--version")
  assert run.returncode == 0, run.stderr
  assert re.fullmatch(r"graphgrad \d+\.\d+\.\d+\S* \(TensorFlow "
                      r"\d+\.\d+\S*\)\n", run.stdout), run.stdout
  assert not run.imported_tensorflow


def test_version_without_tensorflow_installed(tmp_path):
  """A ``tensorflow`` that cannot be imported and no distribution of it:
  ``--version`` says so."""
  hidden = tmp_path / "hidden"
  hidden.mkdir()
  (hidden / "sitecustomize.py").write_text(
      "import importlib.metadata as m\n"
      "def _none(name):\n"
      "  raise m.PackageNotFoundError(name)\n"
      "m.version = _none\n")
  run = _run(tmp_path, "--version", path=[str(hidden)])
  assert run.returncode == 0, run.stderr
  assert run.stdout == (f"graphgrad {graphgrad.__version__} (TensorFlow not "
                        f"installed)\n")


@pytest.fixture(name="meta")
def _meta(tmp_path):
  """A file named like a MetaGraph: the errors below come before it is
  read."""
  path = tmp_path / "m.meta"
  path.write_bytes(b"not read")
  return "m.meta"


@pytest.mark.parametrize("argv,line", [
    (["grads", "MISSING.meta"],
     "graphgrad grads: error: no such file: 'MISSING.meta'. Pass the .meta "
     "file that tf.compat.v1.train.Saver.save wrote next to the checkpoint, "
     "a SavedModel directory, or a frozen .pb."),
    (["inspect", "MISSING.meta"],
     "graphgrad inspect: error: no such file: 'MISSING.meta'. Pass the "
     ".meta file that tf.compat.v1.train.Saver.save wrote next to the "
     "checkpoint, a SavedModel directory, or a frozen .pb."),
    (["grads", "MISSING.meta", "--no-sandbox"],
     "graphgrad grads: error: no such file: 'MISSING.meta'. Pass the .meta "
     "file that tf.compat.v1.train.Saver.save wrote next to the checkpoint, "
     "a SavedModel directory, or a frozen .pb."),
    (["grads", "{meta}", "--png", "out.txt"],
     "graphgrad grads: error: --png 'out.txt': the file name must end in "
     ".png, .svg, .pdf"),
    (["grads", "{meta}", "--json", "no/such/dir/out.json"],
     "graphgrad grads: error: --json 'no/such/dir/out.json': the directory "
     "'{cwd}/no/such/dir' does not exist"),
    (["grads", "{meta}", "--batch", "0"],
     "graphgrad grads: error: --batch '0': expected an integer of at least "
     "1, e.g. --batch 8"),
    (["grads", "{meta}", "--timeout", "-1"],
     "graphgrad grads: error: argument --timeout: expected a positive "
     "finite number (above 0); got '-1'"),
    (["grads", "{meta}", "--feed", "missing.npz"],
     "graphgrad grads: error: --feed 'missing.npz': no such file; pass an "
     ".npz written by numpy.savez(path, x=array, ...)"),
    (["grads", "{meta}", "--checkpoint", "missing.ckpt"],
     "graphgrad grads: error: --checkpoint 'missing.ckpt': no checkpoint "
     "there; pass the prefix Saver.save returned (model.ckpt, without "
     ".index) or its directory"),
    (["grads", "{meta}", "--no-sandbox", "--no-checks"],
     "graphgrad grads: error: --no-checks and --no-sandbox: pass at most "
     "one; without the sandbox graphgrad's own checks are all that stands "
     "between the model and this process"),
    (["grads", "{meta}", "--bogus"],
     "graphgrad: error: unrecognized arguments: --bogus"),
    (["inspect", "{meta}", "--dot", "layers.png"],
     "graphgrad inspect: error: --dot 'layers.png': the file name must end "
     "in .dot"),
    (["inspect", "{meta}", "--memory", "1M"],
     "graphgrad inspect: error: argument --memory: expected a memory size "
     "of at least 64M, such as 4G or 512M; got '1M'"),
    (["demo", "--steps", "0"],
     "graphgrad demo: error: argument --steps: expected a positive integer "
     "(1 or more); got '0'"),
    (["demo", "--plot", "curves.txt"],
     "graphgrad demo: error: --plot 'curves.txt': the file name must end in "
     ".png, .svg, .pdf, e.g. --plot curves.png"),
])
def test_errors_import_no_tensorflow(tmp_path, meta, argv, line):
  argv = [a.format(meta=meta) for a in argv]
  run = _run(tmp_path, *argv)
  assert run.returncode == 2, run.stderr
  assert run.stderr == [line.format(cwd=tmp_path)]
  assert not run.stdout
  assert not run.imported_tensorflow


@pytest.mark.parametrize("argv,line", [
    (["grads", "{meta}", "--png", "out.png"],
     "graphgrad grads: error: --png needs matplotlib: pip install "
     "'graphgrad[draw]', or leave --png out (--json writes the numbers)"),
    (["demo", "--plot", "curves.png"],
     "graphgrad demo: error: --plot needs matplotlib: pip install "
     "'graphgrad[draw]'"),
])
def test_a_missing_matplotlib_is_found_without_tensorflow(tmp_path, meta, argv,
                                                          line):
  hidden = tmp_path / "hidden" / "matplotlib"
  hidden.mkdir(parents=True)
  (hidden / "__init__.py").write_text(
      "raise ImportError('matplotlib is not installed')\n")
  run = _run(tmp_path, *[a.format(meta=meta) for a in argv],
             path=[str(hidden.parent)])
  assert run.returncode == 2, run.stderr
  assert run.stderr == [line]
  assert not run.imported_tensorflow


@pytest.mark.slow
@pytest.mark.skipif(_confine.missing() is not None,
                    reason=f"this kernel cannot confine: {_confine.missing()}")
def test_a_sandboxed_run_imports_tensorflow_in_its_child_alone(tmp_path):
  with tf.Graph().as_default():
    x = tf1.placeholder(tf.float32, [None, 4], name="x")
    loss = tf.reduce_mean(tf.square(dense(dense(x, 3, "l1"), 2, "l2")),
                          name="loss")
    tf1.add_to_collection(tf1.GraphKeys.LOSSES, loss)
    tf1.train.export_meta_graph(str(tmp_path / "m.meta"))
  run = _run(tmp_path, "grads", "m.meta", "--png", "grads.png", "--json",
             "grads.json")
  assert run.returncode == 0, run.stderr
  assert re.search(r"^l1\s", run.stdout, re.M), run.stdout
  assert (tmp_path / "grads.png").read_bytes()[:4] == b"\x89PNG"
  assert (tmp_path / "grads.json").is_file()
  assert not run.imported_tensorflow
