"""Every bad command-line argument: exit code 2, one line, no traceback."""

import os
import re
import subprocess
import sys

import pytest
import tensorflow as tf

from graphgrad import _errors
from graphgrad.cli import _args
from graphgrad.demo import seed_problem
from helpers import dense, error_line

tf1 = tf.compat.v1
ROOT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))))




@pytest.mark.parametrize("flag,value,expected", [
    ("--steps", "-3", "expected a positive integer (1 or more); got '-3'"),
    ("--steps", "ten", "expected a positive integer; got 'ten'"),
    ("--steps", "2.5", "expected a positive integer; got '2.5'"),
    ("--batch-size", "0", "expected a positive integer (1 or more); got '0'"),
    ("--batch-size", "-64",
     "expected a positive integer (1 or more); got '-64'"),
    ("--batch-size", "x", "expected a positive integer; got 'x'"),
    ("--seed", "-1", "expected a non-negative integer (0 or more); got '-1'"),
    ("--seed", "s", "expected a non-negative integer; got 's'"),
    ("--lr", "0", "expected a positive finite number (above 0); got '0'"),
    ("--lr", "-0.1", "expected a positive finite number (above 0); got '-0.1'"),
    ("--lr", "nan", "expected a positive finite number; got 'nan'"),
    ("--lr", "fast", "expected a positive finite number; got 'fast'"),
    ("--noise", "-1",
     "expected a non-negative finite number (0 or more); got '-1'"),
    ("--noise", "inf", "expected a non-negative finite number; got 'inf'"),
    ("--noise", "loud", "expected a non-negative finite number; got 'loud'"),
])
def test_demo_bad_numbers(capsys, flag, value, expected):
  line = error_line(capsys, ["demo", flag, value])
  assert line == f"graphgrad demo: error: argument {flag}: {expected}"


def test_demo_batch_larger_than_the_data(capsys):
  line = error_line(capsys, ["demo", "--batch-size", "4096", "--steps", "1"])
  assert line == ("graphgrad demo: error: argument --batch-size: the demo has "
                  "2048 training examples, so a batch holds at most 2048; got "
                  "4096")


def test_problem_batches_refuses_a_batch_that_never_fills():
  problem = seed_problem(0, n_train=16, n_test=4)
  with pytest.raises(_errors.GraphGradError,
                     match=r"`batch_size` must be an int from 1 to the 16 "
                           r"training examples; got 17"):
    problem.batches(17, 0)
  with pytest.raises(_errors.GraphGradError, match=r"got 0\."):
    problem.batches(0, 0)
  xb, _ = next(problem.batches(16, 0))
  assert xb.shape == (16, 10)


def test_unknown_option_and_command_are_one_line(capsys):
  line = error_line(capsys, ["demo", "--steps"])
  assert line == ("graphgrad demo: error: argument --steps: "
                  "expected one argument")
  line = error_line(capsys, ["train"])
  assert line.startswith(
      "graphgrad: error: argument command: invalid choice: 'train'")
  line = error_line(capsys, ["demo", "--epochs", "3"])
  assert line == "graphgrad: error: unrecognized arguments: --epochs 3"
  line = error_line(capsys, ["inspect"])
  assert line == ("graphgrad inspect: error: the following arguments are "
                  "required: PATH")


def test_demo_unwritable_plot_is_refused_before_training(tmp_path, capsys):
  target = tmp_path / "missing" / "curves.png"
  line = error_line(capsys, ["demo", "--plot", str(target)])
  assert line == (f"graphgrad demo: error: --plot {str(target)!r}: the "
                  f"directory {str(target.parent)!r} does not exist")
  (tmp_path / "d.png").mkdir()
  line = error_line(capsys, ["demo", "--plot", str(tmp_path / "d.png")])
  assert line == (f"graphgrad demo: error: --plot {str(tmp_path / 'd.png')!r} "
                  f"is a directory; pass a file name")


def test_inspect_unwritable_dot_is_refused_before_loading(tmp_path, capsys):
  # The input does not exist either: the output is checked first.
  line = error_line(capsys, ["inspect", str(tmp_path / "m.meta"), "--dot",
                              str(tmp_path / "no" / "g.dot")])
  assert line.startswith("graphgrad inspect: error: --dot ")
  assert line.endswith("does not exist")


def test_inspect_empty_file_is_not_a_metagraph(tmp_path, capsys):
  empty = tmp_path / "empty.meta"
  empty.write_bytes(b"")
  line = error_line(capsys, ["inspect", str(empty)])
  assert line == (f"graphgrad inspect: error: {str(empty)!r} is not a "
                  f"MetaGraph: it holds no graph (an empty file, or another "
                  f"kind of protocol buffer). Pass a .meta file written by "
                  f"tf.compat.v1.train.Saver or export_meta_graph.")


def test_inspect_text_file_is_not_a_metagraph(tmp_path, capsys):
  text = tmp_path / "notes.meta"
  text.write_text("these are not the graphs you are looking for\n")
  line = error_line(capsys, ["inspect", str(text)])
  assert re.match(r"graphgrad inspect: error: cannot read '.*notes\.meta' as "
                  r"a MetaGraph", line)


def test_a_library_error_is_one_line(tmp_path, capsys):
  # A MetaGraph whose loss depends on no trainable variable: gg.analyze
  # raises NotConnectedError, which the command reports as one line.
  with tf.Graph().as_default():
    x = tf1.placeholder(tf.float32, [None, 3], name="x")
    dense(x, 2, "layer")
    tf.reduce_sum(tf.square(x), name="loss")
    tf1.train.export_meta_graph(str(tmp_path / "m.meta"))
  line = error_line(capsys, ["inspect", str(tmp_path / "m.meta"), "--loss",
                              "loss"])
  assert line.startswith("graphgrad inspect: error: `loss` loss:0 depends on "
                         "no trainable variable")


def test_a_library_error_from_demo_is_one_line(capsys, monkeypatch):
  from graphgrad import demo  # pylint: disable=g-import-not-at-top

  def broken(*args, **kwargs):
    raise _errors.UnsupportedGraphError("the seed network cannot be built")
  monkeypatch.setattr(demo, "seed_network", broken)
  line = error_line(capsys, ["demo", "--steps", "1"])
  assert line == "graphgrad demo: error: the seed network cannot be built"


def test_check_output_refuses_a_read_only_directory(tmp_path, monkeypatch):
  monkeypatch.setattr(os, "access", lambda path, mode: False)
  with pytest.raises(_args.CommandError, match=r"is not writable"):
    _args.check_output("--png", str(tmp_path / "a.png"))


def _run(*argv, env_extra=None):
  env = dict(os.environ, PYTHONPATH=ROOT)
  env.pop("TF_CPP_MIN_LOG_LEVEL", None)  # the command line sets it itself
  env.update(env_extra or {})
  return subprocess.run([sys.executable, "-m", "graphgrad", *argv],
                        capture_output=True, text=True, env=env, cwd=ROOT,
                        timeout=300, check=False)


_TF_LOG = re.compile(r"^([IWEF]\d{4} |WARNING: All log messages|"
                     r"WARNING:tensorflow|.*Warning:)", re.MULTILINE)


@pytest.mark.slow
def test_tensorflow_start_up_logs_stay_off_the_terminal(tmp_path):
  """A whole run in a fresh process: stderr holds only the progress lines."""
  done = _run("demo", "--steps", "2", "--batch-size", "8")
  assert done.returncode == 0, done.stderr
  assert not _TF_LOG.search(done.stderr), done.stderr
  assert done.stderr.strip().splitlines()[-1].startswith("done in ")
  bad = _run("demo", "--noise", "-1")
  assert bad.returncode == 2
  assert bad.stderr.strip().splitlines() == [
      "graphgrad demo: error: argument --noise: expected a non-negative "
      "finite number (0 or more); got '-1'"]


@pytest.mark.slow
def test_verbose_shows_tensorflow_logs():
  done = _run("demo", "--steps", "1", "--verbose",
              env_extra={"TF_CPP_MIN_LOG_LEVEL": "0"})
  assert done.returncode == 0, done.stderr
  # Deprecation warnings of tf.compat.v1 APIs reach the terminal again.
  assert _TF_LOG.search(done.stderr), done.stderr


def test_version_check_comes_after_the_arguments(capsys, monkeypatch):
  """On an untested TensorFlow, a bad argument is still one line."""
  from graphgrad import _installed, _startup  # pylint: disable=g-import-not-at-top
  calls = []
  monkeypatch.setattr(_startup, "is_command_line", lambda: True)
  monkeypatch.setattr(_installed, "check_tensorflow",
                      lambda: calls.append(1))
  error_line(capsys, ["demo", "--noise", "-1"])
  assert not calls
  _args.quiet_tensorflow(verbose=True)
  assert calls == [1]
