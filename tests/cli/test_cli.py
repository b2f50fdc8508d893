"""The command line, run in-process: inspect, demo --plot, and error paths."""

import re

import numpy as np
import pytest
import tensorflow as tf

from graphgrad.cli import _main as _cli
from helpers import dense, error_line

tf1 = tf.compat.v1


def _save(tmp_path, with_losses=True, name="model"):
  """Saves a small trained-graph MetaGraph; returns the .meta path."""
  with tf.Graph().as_default():
    x = tf1.placeholder(tf.float32, [None, 5], name="x")
    y = tf1.placeholder(tf.float32, [None, 2], name="y")
    h = dense(x, 7, "encoder", tf.nn.relu)
    logits = dense(h, 2, "classifier")
    if with_losses:
      loss = tf1.losses.softmax_cross_entropy(y, logits)
    else:
      xent = tf.reduce_mean(
          tf.nn.softmax_cross_entropy_with_logits(labels=y, logits=logits),
          name="xent_loss")
      reg = tf.multiply(1e-3, tf.nn.l2_loss(_kernel("encoder")), name="reg")
      loss = tf.add(xent, reg, name="total_loss")
    tf1.train.AdamOptimizer(1e-3).minimize(loss)
    saver = tf1.train.Saver()
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      prefix = saver.save(sess, str(tmp_path / name))
  return prefix + ".meta"


def _kernel(scope):
  return tf1.get_collection(tf1.GraphKeys.TRAINABLE_VARIABLES,
                            scope + "/kernel")[0]




def test_help_lists_the_commands(capsys):
  with pytest.raises(SystemExit) as e:
    _cli.main(["--help"])
  assert e.value.code == 0
  out = capsys.readouterr().out
  assert "demo" in out and "inspect" in out


def test_inspect_uses_the_losses_collection(tmp_path, capsys):
  meta = _save(tmp_path)
  assert _cli.main(["inspect", meta]) == 0
  out = capsys.readouterr().out
  assert re.search(r"loss softmax_cross_entropy_loss/value:0 \(the only "
                   r"tensor in the LOSSES collection\)", out)
  assert re.search(r"^encoder\s+1\s+kernel \[5,7\], bias \[7\]\s+42\s", out,
                   re.M)
  assert re.search(r"^classifier\s+1\s+kernel \[7,2\], bias \[2\]\s+16\s", out,
                   re.M)
  assert "2 layers, 58 trainable parameters" in out
  assert "encoder -> classifier" in out


def test_inspect_guesses_a_loss_by_name_and_writes_pictures(tmp_path, capsys):
  meta = _save(tmp_path, with_losses=False)
  dot, png = tmp_path / "net.dot", tmp_path / "net.png"
  assert _cli.main(["inspect", meta, "--dot", str(dot), "--png",
                    str(png)]) == 0
  out = capsys.readouterr().out
  # total_loss reaches both layers' variables; xent_loss and reg reach fewer
  # or come earlier.
  assert "loss total_loss:0 (the LOSSES collection is empty" in out
  assert "xent_loss:0" in out  # named as another candidate
  assert "params" in dot.read_text()
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_inspect_with_an_explicit_loss(tmp_path, capsys):
  meta = _save(tmp_path, with_losses=False)
  assert _cli.main(["inspect", meta, "--loss", "reg"]) == 0
  out = capsys.readouterr().out
  assert "loss reg:0 (given with --loss)" in out
  # The regularizer reaches only the encoder's kernel.
  assert "1 layers, 35 trainable parameters reach the loss reg:0" in out


def test_inspect_missing_file(tmp_path, capsys):
  line = error_line(capsys, ["inspect", str(tmp_path / "nope.meta")])
  assert line.startswith("graphgrad inspect: error: no such file: ")


def test_inspect_corrupt_file(tmp_path, capsys):
  bad = tmp_path / "bad.meta"
  bad.write_bytes(np.random.default_rng(0).bytes(300))
  line = error_line(capsys, ["inspect", str(bad)])
  assert re.match(r"graphgrad inspect: error: cannot read '.*bad\.meta' as a "
                  r"MetaGraph", line)


def test_inspect_unknown_loss(tmp_path, capsys):
  meta = _save(tmp_path)
  line = error_line(capsys, ["inspect", meta, "--loss", "no_such_loss"])
  assert re.match(r"graphgrad inspect: error: --loss 'no_such_loss': the graph "
                  r"has no tensor 'no_such_loss:0'\. Tensors named like a "
                  r"loss: softmax_cross_entropy_loss/", line)


def test_inspect_non_float_loss(tmp_path, capsys):
  meta = _save(tmp_path)
  line = error_line(capsys, ["inspect", meta, "--loss", "save/filename"])
  assert "save/filename:0 has dtype string; a loss must be a floating" in line


def test_inspect_graph_without_a_loss(tmp_path, capsys):
  with tf.Graph().as_default():
    x = tf1.placeholder(tf.float32, [None, 3], name="x")
    out = tf.reduce_sum(dense(x, 2, "layer"), name="score")
    del out
    tf1.train.export_meta_graph(str(tmp_path / "m.meta"))
  line = error_line(capsys, ["inspect", str(tmp_path / "m.meta")])
  assert "found no loss" in line and "--loss NAME" in line
  assert _cli.main(["inspect", str(tmp_path / "m.meta"), "--loss",
                    "score"]) == 0


def test_inspect_bad_output_name(tmp_path, capsys):
  meta = _save(tmp_path)
  line = error_line(capsys, ["inspect", meta, "--png", "layers.jpg"])
  assert line == ("graphgrad inspect: error: --png 'layers.jpg': the file name "
                  "must end in .png")


def test_demo_plot_writes_both_curves(tmp_path, capsys):
  path = tmp_path / "curves.png"
  assert _cli.main(["demo", "--steps", "20", "--plot", str(path)]) == 0
  out = capsys.readouterr().out
  assert f"wrote the loss curves to {path}" in out
  assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_plot_bad_extension(tmp_path, capsys):
  line = error_line(capsys, ["demo", "--plot", str(tmp_path / "c.txt")])
  assert "the file name must end in .png, .svg, .pdf" in line


def test_inspect_sums_several_losses(tmp_path, capsys):
  with tf.Graph().as_default():
    x = tf1.placeholder(tf.float32, [None, 3], name="x")
    out = dense(dense(x, 4, "a"), 1, "b")
    tf1.losses.mean_squared_error(tf.zeros_like(out), out)
    tf1.losses.add_loss(tf.multiply(1e-2, tf.nn.l2_loss(_kernel("a")),
                                    name="weight_decay"))
    tf1.train.export_meta_graph(str(tmp_path / "two.meta"))
  assert _cli.main(["inspect", str(tmp_path / "two.meta")]) == 0
  out = capsys.readouterr().out
  assert ("loss graphgrad_total_loss:0 (the sum of the 2 tensors in the "
          "LOSSES collection (mean_squared_error/value:0, weight_decay:0))"
          ) in out
  assert "2 layers, 21 trainable parameters" in out


def test_inspect_unwritable_output(tmp_path, capsys):
  meta = _save(tmp_path)
  line = error_line(capsys, ["inspect", meta, "--png",
                              str(tmp_path / "no" / "such" / "dir.png")])
  assert line.startswith("graphgrad inspect: error: --png ")
  assert line.endswith("/no/such' does not exist")


def test_no_command_prints_help_and_fails(capsys):
  assert _cli.main([]) == 2
  assert "usage: graphgrad" in capsys.readouterr().out


def test_demo_trains_three_runs_and_shows_the_reversal(capsys):
  assert _cli.main(["demo", "--steps", "40", "--seed", "1"]) == 0
  out = capsys.readouterr()
  assert "l1_dense -> l2_dense" in out.out  # the layer table
  rows = {}
  for line in out.out.splitlines():
    m = re.match(
        r"(plain backprop|seed plan|reversed plan)\s+([\d.]+)\s+([\d.]+)"
        r"\s+([\d.]+)$", line)
    if m:
      rows[m.group(1)] = [float(v) for v in m.groups()[1:]]
  assert set(rows) == {"plain backprop", "seed plan", "reversed plan"}
  for label in ("plain backprop", "seed plan"):
    train_loss, test_loss, acc = rows[label]
    assert 0 < train_loss < 0.6931 and 0 < test_loss  # better than chance
    assert 0.5 < acc <= 1.0
  # The reversed upstream gradient makes l1_dense climb the loss: a visible
  # effect, far beyond the run-to-run spread of the two other runs.
  assert rows["reversed plan"][1] > rows["plain backprop"][1] + 0.2
  assert rows["reversed plan"][2] < rows["plain backprop"][2] - 0.1
  assert "How to read it:" in out.out
  assert "40/40" in out.err  # the progress output


def test_demo_rejects_bad_steps(capsys):
  line = error_line(capsys, ["demo", "--steps", "0"])
  assert line == ("graphgrad demo: error: argument --steps: expected a "
                  "positive integer (1 or more); got '0'")


def test_demo_plot_without_matplotlib(tmp_path, capsys, monkeypatch):
  monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
  assert _cli.main(["demo", "--steps", "2", "--plot",
                    str(tmp_path / "c.png")]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err == ["graphgrad demo: error: --plot needs matplotlib: "
                 "pip install 'graphgrad[draw]'"]


def test_inspect_png_without_a_renderer_is_refused_before_any_work(
    tmp_path, capsys, monkeypatch):
  import sys  # pylint: disable=g-import-not-at-top
  for name in ("matplotlib", "pydot", "graphviz"):
    monkeypatch.setitem(sys.modules, name, None)
  line = error_line(capsys, ["inspect", str(tmp_path / "missing.meta"),
                             "--png", str(tmp_path / "layers.png")])
  assert line == (
      "graphgrad inspect: error: --png needs Graphviz's `dot` program (with "
      "pydot or graphviz) or matplotlib: pip install 'graphgrad[draw]', or "
      "write --dot instead"), line
