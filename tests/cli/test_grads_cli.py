"""`graphgrad grads` on a saved ResNet-style MetaGraph, and its error lines."""

import json
import re
import sys

import numpy as np
import pytest
import tensorflow as tf

from graphgrad.cli import _main as _cli
from helpers import error_line, global_norm

tf1 = tf.compat.v1


def _conv(x, filters, name):
  rng = np.random.default_rng(len(name))
  with tf1.variable_scope(name):
    w = tf1.get_variable("weights", initializer=rng.normal(
        scale=0.3, size=(3, 3, int(x.shape[-1]), filters)).astype(np.float32))
    return tf.nn.conv2d(x, w, 1, "SAME")


def _save_resnet(tmp_path, int_labels=False):
  """Saves stem -> 2 residual blocks -> head; returns paths and references."""
  with tf.Graph().as_default():
    x = tf1.placeholder(tf.float32, [None, 6, 6, 2], name="images")
    if int_labels:
      labels = tf1.placeholder(tf.int32, [None], name="labels")
    h = tf.nn.relu(_conv(x, 4, "stem"))
    for i in range(2):
      with tf1.variable_scope(f"block{i}"):
        r = tf.nn.relu(_conv(h, 4, "conv1"))
        h = tf.nn.relu(h + _conv(r, 4, "conv2"))
    with tf1.variable_scope("head"):
      w = tf1.get_variable("w", initializer=np.full((4, 3), 0.2, np.float32))
      logits = tf.reduce_mean(h, [1, 2]) @ w
    if int_labels:
      loss = tf1.losses.sparse_softmax_cross_entropy(labels, logits)
    else:
      loss = tf.reduce_mean(tf.square(logits), name="loss")
    tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
    images = np.random.default_rng(7).normal(size=(5, 6, 6, 2)).astype(
        np.float32)
    names = ["stem", "block0/conv1", "block0/conv2", "block1/conv1",
             "block1/conv2", "head"]
    grads = {n: tf.gradients(loss, tf1.get_collection(
        tf1.GraphKeys.TRAINABLE_VARIABLES, n + "/")) for n in names}
    saver = tf1.train.Saver()
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      stem = tf1.trainable_variables()[0]
      sess.run(stem.assign_add(tf.fill(stem.shape, 0.01)))  # "trained"
      prefix = saver.save(sess, str(tmp_path / "resnet"))
      ref = {} if int_labels else sess.run(grads, {x: images})
  feed = tmp_path / "feed.npz"
  np.savez(feed, images=images)
  return prefix + ".meta", prefix, str(feed), ref






def test_grads_matches_tf_gradients_on_the_restored_weights(tmp_path, capsys):
  meta, prefix, feed, ref = _save_resnet(tmp_path)
  out_json, out_png = tmp_path / "g.json", tmp_path / "g.png"
  assert _cli.main(["grads", meta, "--checkpoint", prefix, "--feed", feed,
                    "--json", str(out_json), "--png", str(out_png)]) == 0
  out = capsys.readouterr().out
  assert f"restored {prefix}" in out and "block1/conv2" in out
  data = json.loads(out_json.read_text())
  rows = {r["name"]: r for r in data["layers"]}
  assert list(rows) == list(ref)
  for name, grads in ref.items():
    np.testing.assert_allclose(rows[name]["grad_norm"]["before"],
                               global_norm(grads), rtol=1e-5)
  assert out_png.stat().st_size > 10_000


def test_depth_groups_the_blocks_and_random_inputs_fill_the_batch(
    tmp_path, capsys):
  meta, _, _, _ = _save_resnet(tmp_path)
  out_json = tmp_path / "g.json"
  assert _cli.main(["grads", meta, "--depth", "1", "--batch", "3",
                    "--json", str(out_json)]) == 0
  out = capsys.readouterr().out
  assert "no --checkpoint" in out
  names = [r["name"] for r in json.loads(out_json.read_text())["layers"]]
  assert names == ["stem", "block0", "block1", "head"]


def test_build_feed_shapes_and_given_arrays():
  from graphgrad.cli import _grads  # pylint: disable=g-import-not-at-top
  with tf.Graph().as_default() as g:
    x = tf1.placeholder(tf.float32, [None, 3], name="x")
    y = tf1.placeholder(tf.float32, [None], name="y")
    loss = tf.reduce_sum(x) + tf.reduce_sum(y)
    given = np.ones(4, np.float32)
    feed = _grads.build_feed(g, loss, {"y:0": given}, batch=5, seed=0)
  assert feed[x].shape == (5, 3)
  np.testing.assert_array_equal(feed[y], given)


def test_integer_placeholder_without_feed_is_an_error(tmp_path, capsys):
  meta, prefix, feed, _ = _save_resnet(tmp_path, int_labels=True)
  line = error_line(capsys, ["grads", meta, "--checkpoint", prefix,
                              "--feed", feed])
  assert re.search(r"placeholder 'labels' \(int32 \[\?\]\) is not floating-"
                   r"point.*--feed FEED.npz with an array named 'labels'",
                   line)
  np.savez(tmp_path / "full.npz", images=np.load(feed)["images"],
           labels=np.array([0, 1, 2, 0, 1], np.int32))
  assert _cli.main(["grads", meta, "--checkpoint", prefix, "--feed",
                    str(tmp_path / "full.npz")]) == 0


@pytest.mark.parametrize("args,pattern", [
    (["--batch", "0"], r"--batch '0': expected an integer of at least 1"),
    (["--batch", "abc"], r"--batch 'abc': expected an integer"),
    (["--depth", "0"], r"--depth '0': expected an integer of at least 1"),
    (["--seed", "-1"], r"--seed '-1': expected an integer of at least 0"),
    (["--png", "out.jpg"], r"--png 'out.jpg': the file name must end in"),
    (["--json", "out.txt"], r"--json 'out.txt': the file name must end in"),
    (["--feed", "missing.npz"], r"--feed 'missing.npz': no such file"),
    (["--checkpoint", "nowhere/ckpt"],
     r"--checkpoint 'nowhere/ckpt': no checkpoint there"),
    (["--loss", "nope"], r"--loss 'nope': the graph has no tensor"),
])
def test_bad_arguments_exit_2_with_one_line(tmp_path, capsys, args, pattern):
  meta, _, _, _ = _save_resnet(tmp_path)
  assert re.search(pattern, error_line(capsys, ["grads", meta] + args))


def test_bad_feed_files(tmp_path, capsys):
  meta, _, _, _ = _save_resnet(tmp_path)
  np.savez(tmp_path / "unknown.npz", pixels=np.zeros(3))
  line = error_line(capsys, ["grads", meta, "--feed",
                              str(tmp_path / "unknown.npz")])
  assert "no placeholder named 'pixels'" in line and "images" in line
  np.savez(tmp_path / "shape.npz", images=np.zeros((2, 3)))
  line = error_line(capsys, ["grads", meta, "--feed",
                              str(tmp_path / "shape.npz")])
  assert re.search(r"array 'images' is float64 \[2,3\]; the placeholder is "
                   r"float32 \[\?,6,6,2\]", line)
  (tmp_path / "junk.npz").write_text("not a zip")
  line = error_line(capsys, ["grads", meta, "--feed",
                              str(tmp_path / "junk.npz")])
  assert "cannot read it as an .npz" in line


def test_missing_model_and_missing_argument(tmp_path, capsys):
  line = error_line(capsys, ["grads", str(tmp_path / "none.meta")])
  assert "no such file" in line
  line = error_line(capsys, ["grads"])
  assert "the following arguments are required: MODEL" in line



def _save_matmul(tmp_path, shape):
  """x (placeholder of `shape`) @ w [4, 1]; returns the .meta and prefix."""
  with tf.Graph().as_default():
    x = tf1.placeholder(tf.float32, shape, name="x")
    with tf1.variable_scope("layer"):
      w = tf1.get_variable("w", initializer=np.ones((4, 1), np.float32))
    tf.identity(tf.reduce_sum(tf.reshape(x, [-1, 4]) @ w), name="loss")
    saver = tf1.train.Saver()
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      prefix = saver.save(sess, str(tmp_path / "matmul"))
  return prefix + ".meta", prefix


def test_unknown_rank_and_runtime_errors(tmp_path, capsys):
  meta, prefix = _save_matmul(tmp_path, None)
  line = error_line(capsys, ["grads", meta, "--loss", "loss"])
  assert "placeholder 'x' has an unknown rank" in line
  np.savez(tmp_path / "odd.npz", x=np.ones((2, 3), np.float32))
  line = error_line(capsys, ["grads", meta, "--loss", "loss", "--checkpoint",
                              prefix, "--feed", str(tmp_path / "odd.npz")])
  assert line.startswith("graphgrad grads: error: running the graph failed "
                         "at op "), line


def test_checkpoint_of_another_model_and_unwritable_output(tmp_path, capsys,
                                                           monkeypatch):
  meta, _, feed, _ = _save_resnet(tmp_path)
  _, other = _save_matmul(tmp_path, [None, 4])
  line = error_line(capsys, ["grads", meta, "--feed", feed,
                              "--checkpoint", other])
  assert re.search(r"--checkpoint '.*matmul': cannot restore it into this "
                   r"graph", line)
  # A write that fails after the work (a full disk): the command line's own
  # process writes the file, so the failure is seen there.
  def full(*args, **kwargs):
    raise OSError(28, "No space left on device")
  monkeypatch.setattr(json, "dump", full)
  line = error_line(capsys, ["grads", meta, "--feed", feed, "--json",
                              str(tmp_path / "g.json")])
  assert line == ("graphgrad grads: error: cannot write output: [Errno 28] "
                  "No space left on device"), line


def test_a_graph_grads_cannot_build_a_saver_for(tmp_path, capsys):
  """A variable listed twice in GLOBAL_VARIABLES: the .meta's own Saver
  predates the duplicate, grads' Saver fails on it."""
  meta, prefix = _save_matmul(tmp_path, [None, 4])
  with tf.Graph().as_default():
    saver = tf1.train.import_meta_graph(meta)
    tf1.add_to_collection(tf1.GraphKeys.GLOBAL_VARIABLES,
                          tf1.global_variables()[0])
    tf1.train.export_meta_graph(str(tmp_path / "twice.meta"),
                                saver_def=saver.as_saver_def())
  line = error_line(capsys, ["grads", str(tmp_path / "twice.meta"),
                             "--loss", "loss", "--checkpoint", prefix])
  assert line == (
      f"graphgrad grads: error: --checkpoint {prefix!r}: cannot restore it "
      f"into this graph (At least two variables have the same name: "
      f"layer/w)"), line


def test_png_without_matplotlib_is_refused_before_any_work(tmp_path, capsys,
                                                           monkeypatch):
  """The model does not even exist: the --png check comes first."""
  monkeypatch.setitem(sys.modules, "matplotlib", None)
  line = error_line(capsys, ["grads", str(tmp_path / "missing.meta"),
                             "--png", str(tmp_path / "g.png")])
  assert line == (
      "graphgrad grads: error: --png needs matplotlib: pip install "
      "'graphgrad[draw]', or leave --png out (--json writes the numbers)"), \
      line


def test_an_output_in_a_missing_directory_is_refused_before_any_work(
    tmp_path, capsys):
  line = error_line(capsys, ["grads", str(tmp_path / "missing.meta"),
                             "--json", str(tmp_path / "no" / "g.json")])
  assert line == (
      f"graphgrad grads: error: --json {str(tmp_path / 'no' / 'g.json')!r}: "
      f"the directory {str(tmp_path / 'no')!r} does not exist"), line


def _trained_saved_model(tmp_path):
  """A v1 SavedModel whose saved weights differ from its initializers; the
  per-layer gradient norms tf.gradients gives at the saved weights."""
  rng = np.random.default_rng(3)
  feed = rng.normal(size=(5, 3)).astype(np.float32)
  np.savez(tmp_path / "feed.npz", x=feed)
  with tf.Graph().as_default():
    x = tf1.placeholder(tf.float32, [None, 3], name="x")
    h = tf.tanh(tf.matmul(x, tf1.get_variable("l1/kernel", [3, 4])))
    loss = tf.reduce_mean(tf.square(tf.matmul(
        h, tf1.get_variable("l2/kernel", [4, 2]))), name="loss")
    tf1.add_to_collection(tf1.GraphKeys.LOSSES, loss)
    variables = tf1.trainable_variables()
    grads = tf.gradients(loss, variables)
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      sess.run([v.assign(rng.normal(size=v.shape).astype(np.float32) * 3)
                for v in variables])
      values = sess.run(grads, {x: feed})
      tf1.saved_model.simple_save(sess, str(tmp_path / "sm"), {"x": x},
                                  {"loss": loss})
  return {v.op.name.split("/")[0]: float(np.linalg.norm(g))
          for v, g in zip(variables, values)}


@pytest.mark.parametrize("flags", [[], ["--checkpoint", "variables"]],
                         ids=["by_default", "variables_directory"])
def test_a_saved_models_own_variables_are_restored(tmp_path, capsys, flags):
  want = _trained_saved_model(tmp_path)
  sm = str(tmp_path / "sm")
  flags = [f if f != "variables" else str(tmp_path / "sm" / "variables")
           for f in flags]
  out = tmp_path / "g.json"
  assert _cli.main(["grads", sm, "--loss", "loss", "--feed",
                    str(tmp_path / "feed.npz"), "--json", str(out),
                    *flags]) == 0
  first = capsys.readouterr().out.splitlines()[0]
  own = "its own variables, " if not flags else ""
  assert first.endswith(f"; restored {own}"
                        f"{tmp_path / 'sm' / 'variables' / 'variables'}"), first
  rows = {r["name"]: r for r in json.loads(out.read_text())["layers"]}
  for layer, norm in want.items():
    np.testing.assert_allclose(rows[layer]["grad_norm"]["before"], norm,
                               rtol=1e-5)
