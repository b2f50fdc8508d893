"""graphgrad inspect on SavedModels, frozen graphs and ops without gradient."""

import re

import legacy_graphs
import numpy as np
import pytest
import tensorflow as tf

from graphgrad.cli import _main as _cli
from helpers import dense, error_line

tf1 = tf.compat.v1


def _inference_graph():
  x = tf1.placeholder(tf.float32, [None, 5], name="x")
  h = dense(x, 7, "encoder", tf.nn.relu)
  return x, tf.identity(dense(h, 2, "classifier"), name="logits")




def _saved_model(path, tags=("serve",)):
  with tf.Graph().as_default():
    x, logits = _inference_graph()
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      builder = tf1.saved_model.Builder(str(path))
      builder.add_meta_graph_and_variables(sess, list(tags))
      builder.save()


def _frozen(path):
  with tf.Graph().as_default() as g:
    _inference_graph()
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      frozen = tf1.graph_util.convert_variables_to_constants(
          sess, g.as_graph_def(), ["logits"])
  tf.io.write_graph(frozen, str(path.parent), path.name, as_text=False)
  return str(path)


def test_saved_model_with_an_output(tmp_path, capsys):
  _saved_model(tmp_path / "sm")
  assert _cli.main(["inspect", str(tmp_path / "sm"), "--output",
                    "logits"]) == 0
  out = capsys.readouterr().out
  assert out.startswith(f"{tmp_path / 'sm'} (SavedModel): output logits:0 "
                        f"(given with --output: the layers it depends on)")
  assert re.search(r"encoder\s+1\s+kernel \[5,7\], bias \[7\]\s+42", out)
  assert "encoder -> classifier: encoder/Relu:0 [?,7]" in out
  assert "every op on the backward path of logits:0 has a registered" in out


def test_saved_model_tags(tmp_path, capsys):
  _saved_model(tmp_path / "sm", tags=("train",))
  assert _cli.main(["inspect", str(tmp_path / "sm"), "--tag", "train",
                    "--output", "logits:0"]) == 0
  assert "2 layers, 58 trainable parameters" in capsys.readouterr().out
  line = error_line(capsys, ["inspect", str(tmp_path / "sm"), "--output",
                              "logits"])
  assert line.endswith("--tag 'serve': the SavedModel "
                       f"'{tmp_path / 'sm'}' has no MetaGraph with that tag; "
                       "its MetaGraphs have the tags [['train']]. Pass one "
                       "with --tag.")


def test_a_non_float_output(tmp_path, capsys):
  _saved_model(tmp_path / "sm")
  line = error_line(capsys, ["inspect", str(tmp_path / "sm"), "--output",
                              "save/Const"])
  assert line.endswith("--output 'save/Const': save/Const:0 has dtype string; "
                       "an output to analyse must be a floating-point tensor. "
                       "Pass a float tensor's name.")


def test_a_directory_that_is_not_a_saved_model(tmp_path, capsys):
  line = error_line(capsys, ["inspect", str(tmp_path)])
  assert ("is a directory without saved_model.pb or saved_model.pbtxt, so "
          "not a SavedModel") in line


def test_frozen_graph_is_thawed_and_needs_an_output(tmp_path, capsys):
  pb = _frozen(tmp_path / "frozen.pb")
  line = error_line(capsys, ["inspect", pb])
  assert "found no loss" in line
  assert "an output with --output NAME (outputs: logits:0)" in line
  assert _cli.main(["inspect", pb, "--output", "logits"]) == 0
  out = capsys.readouterr().out
  assert out.startswith(f"{pb} (frozen GraphDef): output logits:0")
  assert re.search(r"classifier\s+1\s+kernel \[7,2\], bias \[2\]\s+16", out)


def test_output_errors(tmp_path, capsys):
  pb = _frozen(tmp_path / "frozen.pb")
  line = error_line(capsys, ["inspect", pb, "--output", "probs"])
  assert line.endswith("--output 'probs': the graph has no tensor 'probs:0'. "
                       "Tensors named like a model output: logits:0.")
  line = error_line(capsys, ["inspect", pb, "--output", "x", "--loss", "y"])
  assert "--loss 'y' and --output 'x': pass one" in line
  bad = tmp_path / "notes.pb"
  bad.write_text("not a graph")
  line = error_line(capsys, ["inspect", str(bad)])
  assert "notes.pb' is not a GraphDef, binary or text" in line


def test_reports_ops_without_gradient(tmp_path, capsys):
  with tf.Graph().as_default() as g:
    x, logits = _inference_graph()
    with g.gradient_override_map({"Identity": "LegacyQuantizerGrad"}):
      with tf.name_scope("encoder/"):
        q = tf.identity(logits, name="quantize")
    q = tf.round(q * 255.0, name="to_8_bits")
    tf.identity(tf.reduce_sum(tf.square(q)), name="loss")
    tf1.train.export_meta_graph(str(tmp_path / "q.meta"))
  assert _cli.main(["inspect", str(tmp_path / "q.meta")]) == 0
  out = capsys.readouterr().out
  assert ("gradients: 1 op(s) on the backward path of loss:0 have no "
          "registered gradient") in out
  assert "plan.straight_through(op) or plan.override_gradient(op, fn)" in out
  assert "  encoder/quantize  type Identity  layer encoder" in out
  assert ("gradients: 1 op(s) on the backward path send no gradient below "
          "them") in out
  assert "  to_8_bits  type Round  glue" in out


@pytest.mark.slow
def test_names_lost_overrides_of_a_graph_from_another_process(tmp_path,
                                                              legacy_export):
  meta = str(legacy_export / "legacy.meta")
  run = legacy_graphs.run_python(
      "import sys; from graphgrad.cli import _main; "
      f"sys.exit(_main.main(['inspect', {meta!r}]))", tmp_path)
  assert run.returncode == 0, run.stderr
  out = run.stdout
  assert re.search(r"MatMul\s+1\s+Variable \[4,6\], Variable_1 \[6\]", out)
  assert "MatMul -> MatMul_2: add:0 [8,6]" in out
  assert ("gradient overrides: 3 op(s) carry a gradient_override_map name "
          "that no gradient function is registered for in this process") in out
  assert "  flip  type Identity  glue  override 'FlipGradient0'" in out
  assert ("    plan.straight_through('flip').transform_edge('MatMul', "
          "'MatMul_2', gg.transforms.reverse(l))") in out
  assert "  quantize  type Round  glue  override 'StraightThroughRound'" in out
  assert "    plan.straight_through('quantize')" in out
  assert "    plan.override_gradient('squash', fn)" in out


def test_text_formats_open_as_their_binary_twins(tmp_path, capsys):
  """A frozen GraphDef as .pbtxt, and a SavedModel whose graph is
  saved_model.pbtxt, give what their binary forms give."""
  from google.protobuf import text_format  # pylint: disable=g-import-not-at-top
  from tensorflow.core.protobuf import saved_model_pb2  # pylint: disable=g-import-not-at-top
  with tf.Graph().as_default() as g:
    x = tf1.placeholder(tf.float32, [None, 3], name="x")
    w = tf1.get_variable("l1/kernel", initializer=np.ones((3, 2), "f4"))
    y = tf.identity(tf.matmul(x, w), name="y")
    with tf1.Session() as sess:
      sess.run(w.initializer)
      frozen = tf1.graph_util.convert_variables_to_constants(
          sess, g.as_graph_def(), ["y"])
      tf1.saved_model.simple_save(sess, str(tmp_path / "sm"), {"x": x},
                                  {"y": y})
  tf.io.write_graph(frozen, str(tmp_path), "frozen.pb", as_text=False)
  tf.io.write_graph(frozen, str(tmp_path), "frozen.pbtxt", as_text=True)
  outs = []
  for path in ("frozen.pb", "frozen.pbtxt"):
    assert _cli.main(["inspect", str(tmp_path / path), "--output", "y"]) == 0
    outs.append(capsys.readouterr().out.replace(path, "MODEL"))
  assert outs[0] == outs[1] and "(frozen GraphDef)" in outs[1]
  assert _cli.main(["inspect", str(tmp_path / "sm"), "--output", "y"]) == 0
  binary = capsys.readouterr().out
  model = saved_model_pb2.SavedModel()
  model.ParseFromString((tmp_path / "sm" / "saved_model.pb").read_bytes())
  (tmp_path / "sm" / "saved_model.pbtxt").write_text(
      text_format.MessageToString(model))
  (tmp_path / "sm" / "saved_model.pb").unlink()
  assert _cli.main(["inspect", str(tmp_path / "sm"), "--output", "y"]) == 0
  assert capsys.readouterr().out == binary
