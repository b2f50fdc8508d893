"""graphgrad inspect and grads on TF2 SavedModels, against GradientTape.

Each model is saved as TF2 saves it (``tf.saved_model.save`` of a
``tf.Module`` and of a Keras model, Keras 3's ``model.export()``, tf-keras's
``save_format="tf"``), with weights that are neither zero nor their
initializers' values, and loaded back with ``tf.saved_model.load``: the
reference is ``GradientTape``'s gradient of the signature output's sum over
the loaded signature's trainable variables.
"""

import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from google.protobuf import text_format
from tensorflow.core.protobuf import saved_model_pb2

from graphgrad.cli import _main as _cli
from helpers import error_line

_X = np.random.default_rng(0).standard_normal((6, 4)).astype(np.float32)
_SEQ = np.random.default_rng(1).standard_normal((6, 5, 3)).astype(np.float32)


class _Module(tf.Module):
  """Two dense layers, a non-trainable scale, a captured constant, and two
  outputs."""

  def __init__(self):
    super().__init__()
    self.w1 = tf.Variable(tf.random.normal([4, 5], seed=1), name="w1")
    self.b1 = tf.Variable(tf.random.normal([5], seed=2), name="b1")
    self.w2 = tf.Variable(tf.random.normal([5, 3], seed=3), name="w2")
    self.scale = tf.Variable(1.5, trainable=False, name="scale")
    self.offset = tf.constant([1.0, -2.0, 0.5])

  @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32,
                                              name="x")])
  def __call__(self, x):
    h = tf.nn.relu(x @ self.w1 + self.b1)
    return {"out": (h @ self.w2 + self.offset) ** 2 * self.scale,
            "hidden": h}


class _Control(tf.Module):
  """A ``tf.cond`` and a ``tf.while_loop`` (functional If and While)."""

  def __init__(self):
    super().__init__()
    self.w = tf.Variable(tf.random.normal([4, 4], seed=4) * 0.5, name="w")
    self.v = tf.Variable(tf.random.normal([4, 2], seed=5), name="v")

  @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32,
                                              name="x")])
  def __call__(self, x):
    h = tf.cond(tf.reduce_sum(x) > 0, lambda: tf.tanh(x @ self.w),
                lambda: x @ self.w * 2.0)
    _, h = tf.while_loop(lambda i, h: i < 3,
                         lambda i, h: (i + 1, tf.tanh(h @ self.w)),
                         [tf.constant(0), h])
    return {"y": h @ self.v}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  """Path of each saved model, and the feed its signature takes."""
  root = tmp_path_factory.mktemp("tf2")
  found = {}
  module = _Module()
  module.w1.assign(module.w1 * 3.0)  # saved weights differ from the initial
  tf.saved_model.save(module, str(root / "module"),
                      signatures=module.__call__)
  found["module"] = root / "module"
  control = _Control()
  tf.saved_model.save(control, str(root / "control"),
                      signatures=control.__call__)
  found["control"] = root / "control"
  keras.utils.set_random_seed(0)
  inp = keras.Input((4,), name="x")
  h = keras.layers.Dense(5, activation="relu", name="fc0")(inp)
  out = keras.layers.Dense(3, name="fc1")(h)
  mlp = keras.Model(inp, out)
  mlp.export(str(root / "keras_export"))
  found["keras_export"] = root / "keras_export"
  tf.saved_model.save(mlp, str(root / "keras_saved"))
  found["keras_saved"] = root / "keras_saved"
  seq = keras.Input((5, 3), name="seq")
  lstm = keras.Model(seq, keras.layers.Dense(2, name="head")(
      keras.layers.LSTM(4, name="lstm")(seq)))
  lstm.export(str(root / "keras_lstm"))
  found["keras_lstm"] = root / "keras_lstm"
  # The module's SavedModel again, as text.
  text = root / "module_text"
  _copy_as_text(found["module"], text)
  found["module_text"] = text
  return found


def _copy_as_text(src, dst):
  os.makedirs(dst)
  proto = saved_model_pb2.SavedModel()
  proto.ParseFromString((src / "saved_model.pb").read_bytes())
  (dst / "saved_model.pbtxt").write_text(text_format.MessageToString(proto))
  for name in os.listdir(src / "variables"):
    os.makedirs(dst / "variables", exist_ok=True)
    (dst / "variables" / name).write_bytes(
        (src / "variables" / name).read_bytes())


@pytest.fixture(scope="module")
def tf_keras_model(tmp_path_factory):
  """A tf-keras model with batch norm and an LSTM, saved with
  ``save_format="tf"``."""
  K = pytest.importorskip("tf_keras")
  path = tmp_path_factory.mktemp("tf_keras") / "model"
  K.utils.set_random_seed(0)
  seq = K.Input((5, 3), name="seq")
  h = K.layers.LSTM(4, name="lstm")(seq)
  h = K.layers.BatchNormalization(name="bn")(h)
  out = K.layers.Dense(2, name="head")(h)
  model = K.Model(seq, out)
  model.layers[-1].kernel.assign(model.layers[-1].kernel * 4.0)
  model.save(str(path), save_format="tf")
  return path


def _feed(tmp_path, **arrays):
  path = tmp_path / "feed.npz"
  np.savez(path, **arrays)
  return str(path)


def _tape(path, arrays, output=None, signature="serving_default"):
  """``{variable name: gradient}`` of the output's sum, by GradientTape."""
  loaded = tf.saved_model.load(str(path))  # the signature needs it alive
  fn = loaded.signatures[signature]
  with tf.GradientTape() as tape:
    outputs = fn(**{k: tf.constant(v) for k, v in arrays.items()})
    (key,) = [output] if output else list(outputs)
    loss = tf.reduce_sum(outputs[key])
  variables = fn.trainable_variables
  grads = tape.gradient(loss, variables)
  return {v.name.split(":")[0]: g.numpy() for v, g in zip(variables, grads)}


def _input_name(path):
  """The one input of the ``serving_default`` signature of ``path``."""
  proto = saved_model_pb2.SavedModel()
  proto.ParseFromString((path / "saved_model.pb").read_bytes())
  (name,) = proto.meta_graphs[0].signature_def["serving_default"].inputs
  return name


def _grads(path, feed, tmp_path, *flags):
  out = tmp_path / "report.json"
  assert _cli.main(["grads", str(path), "--feed", feed, "--json", str(out),
                    *flags]) == 0
  return {r["name"]: r["grad_norm"]["before"]
          for r in json.loads(out.read_text())["layers"]}


def _total(norms):
  return float(np.sqrt(sum(n ** 2 for n in norms)))


@pytest.mark.parametrize("name", ["module", "module_text", "control",
                                  "keras_export", "keras_saved"])
def test_grads_norm_is_gradient_tapes(models, tmp_path, name):
  path = models[name]
  # tf.saved_model.save names a Keras 3 model's input after its call's
  # argument (Keras 2 after the Input, as export() does): read it.
  binary = models["module"] if name == "module_text" else path
  arrays = {_input_name(binary): _X}
  output = "out" if name.startswith("module") else None
  flags = ["--output", output] if output else []
  rows = _grads(path, _feed(tmp_path, **arrays), tmp_path, "--no-sandbox",
                *flags)
  reference = _tape(models["module"] if name == "module_text" else path,
                    arrays, output)
  np.testing.assert_allclose(
      _total(rows.values()),
      _total(np.linalg.norm(g) for g in reference.values()), rtol=1e-5)


def test_keras_layers_are_the_models_layers(models, tmp_path):
  rows = _grads(models["keras_export"], _feed(tmp_path, x=_X), tmp_path,
                "--no-sandbox")
  reference = _tape(models["keras_export"], {"x": _X})
  assert sorted(rows) == ["fc0", "fc1"]
  for layer, norm in rows.items():
    mine = [g for n, g in reference.items() if n.startswith(layer + "/")]
    np.testing.assert_allclose(norm, _total(np.linalg.norm(g) for g in mine),
                               rtol=1e-5)


def test_keras_lstm_export_in_the_sandbox(models, tmp_path):
  """Keras 3's LSTM is a While loop inside the exported function; the
  default run is the sandboxed one."""
  rows = _grads(models["keras_lstm"], _feed(tmp_path, seq=_SEQ), tmp_path)
  reference = _tape(models["keras_lstm"], {"seq": _SEQ})
  assert set(rows) == {"lstm/lstm_cell", "head"}
  np.testing.assert_allclose(
      _total(rows.values()),
      _total(np.linalg.norm(g) for g in reference.values()), rtol=1e-5)


def test_tf_keras_saved_model(tf_keras_model, tmp_path):
  rows = _grads(tf_keras_model, _feed(tmp_path, seq=_SEQ), tmp_path,
                "--no-sandbox")
  reference = _tape(tf_keras_model, {"seq": _SEQ})
  assert set(rows) == {"lstm/lstm_cell", "bn", "head"}
  np.testing.assert_allclose(
      _total(rows.values()),
      _total(np.linalg.norm(g) for g in reference.values()), rtol=1e-5)
  np.testing.assert_allclose(
      rows["head"], _total(np.linalg.norm(g) for n, g in reference.items()
                           if n.startswith("head/")), rtol=1e-5)


def test_the_saved_weights_are_restored(models, tmp_path, capsys):
  """The module's w1 was tripled before saving: its gradient norm moves
  with the saved weights (a report from zeros or initial values differs)."""
  rows = _grads(models["module"], _feed(tmp_path, x=_X), tmp_path,
                "--no-sandbox", "--output", "out")
  assert "restored its own variables" in capsys.readouterr().out
  reference = _tape(models["module"], {"x": _X}, "out")
  layer_of_w2 = [n for n in rows if n != min(rows)]
  np.testing.assert_allclose(rows[layer_of_w2[0]],
                             np.linalg.norm(reference["w2"]), rtol=1e-5)


def test_checkpoint_flag_takes_the_variables_directory(models, tmp_path):
  path = models["keras_export"]
  own = _grads(path, _feed(tmp_path, x=_X), tmp_path, "--no-sandbox")
  given = _grads(path, _feed(tmp_path, x=_X), tmp_path, "--no-sandbox",
                 "--checkpoint", str(path / "variables"))
  assert own == given


def test_inspect_prints_the_keras_layers(models, capsys):
  assert _cli.main(["inspect", str(models["keras_export"]),
                    "--no-sandbox"]) == 0
  out = capsys.readouterr().out
  assert "(TF2 SavedModel): output serving_default/output_0:0" in out
  table = out.split("layer ", 1)[1]
  assert [line.split()[0] for line in table.splitlines()[2:4]] == [
      "fc0", "fc1"]
  assert "2 layers, 43 trainable parameters" in out


def test_several_outputs_need_output(models, tmp_path, capsys):
  line = error_line(capsys, ["grads", str(models["module"]), "--feed",
                             _feed(tmp_path, x=_X), "--no-sandbox"])
  assert "signature 'serving_default' has 2 floating-point outputs " \
         "(hidden, out): pass the one to analyse with --output KEY" in line
  line = error_line(capsys, ["grads", str(models["module"]), "--output",
                             "logits", "--no-sandbox"])
  assert line.endswith("--output 'logits': the signature 'serving_default' "
                       "has no such output; its outputs: hidden, out. Pass "
                       "one of them.")


def test_unknown_signature_lists_the_signatures(models, capsys):
  line = error_line(capsys, ["inspect", str(models["keras_export"]),
                             "--signature", "predict", "--no-sandbox"])
  assert line.endswith("--signature 'predict': "
                       f"'{models['keras_export']}' has no such signature; "
                       "its signatures: serve, serving_default. Pass one "
                       "with --signature KEY.")


def test_other_signature(models, tmp_path):
  """Keras 3's export also has a ``serve`` signature: same model, same
  numbers."""
  path = models["keras_export"]
  feed = _feed(tmp_path, x=_X)
  assert _grads(path, feed, tmp_path, "--no-sandbox", "--signature",
                "serve") == _grads(path, feed, tmp_path, "--no-sandbox")


def test_feed_is_keyed_by_signature_input(models, tmp_path, capsys):
  line = error_line(capsys, ["grads", str(models["keras_export"]), "--feed",
                             _feed(tmp_path, inputs=_X), "--no-sandbox"])
  assert line.endswith("--feed: no placeholder named 'inputs' feeds the "
                       "loss graphgrad_output_sum:0; its placeholders: x")


def test_signature_flag_on_a_tf1_model(tmp_path, capsys):
  """A file is refused before anything is read; a TF1 SavedModel when its
  MetaGraph shows it has no object graph."""
  with tf.Graph().as_default():
    x = tf.compat.v1.placeholder(tf.float32, [None, 2], name="x")
    w = tf.compat.v1.get_variable("w", [2, 1])
    y = tf.identity(x @ w, name="y")
    saver = tf.compat.v1.train.Saver()
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      saver.save(sess, str(tmp_path / "model"))
      tf.compat.v1.saved_model.simple_save(
          sess, str(tmp_path / "v1"), {"x": x}, {"y": y})
  meta = str(tmp_path / "model.meta")
  line = error_line(capsys, ["inspect", meta, "--signature",
                             "serving_default"])
  assert line.endswith(f"--signature 'serving_default': {meta!r} is a file, "
                       f"not a SavedModel directory; its tensors are named "
                       f"with --loss or --output NAME, and --signature "
                       f"chooses a TF2 SavedModel's signature. Leave it "
                       f"out."), line
  line = error_line(capsys, ["grads", str(tmp_path / "v1"), "--signature",
                             "serving_default", "--no-sandbox"])
  assert "is a TF1 SavedModel, whose tensors are named with --loss or " \
         "--output NAME; --signature chooses a TF2 SavedModel's " \
         "signature" in line


def test_a_tf1_checkpoint_is_refused_for_a_tf2_model(models, tmp_path,
                                                     capsys):
  with tf.Graph().as_default():
    tf.compat.v1.get_variable("fc0/kernel", [4, 5])
    saver = tf.compat.v1.train.Saver()
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      prefix = saver.save(sess, str(tmp_path / "tf1"))
  line = error_line(capsys, ["grads", str(models["keras_export"]), "--feed",
                             _feed(tmp_path, x=_X), "--checkpoint", prefix,
                             "--no-sandbox"])
  assert "is a name-based (TF1) checkpoint, which keys variables by name" \
      in line


def test_a_captured_lookup_table_is_refused(tmp_path, capsys):
  vocab = tmp_path / "vocab.txt"
  vocab.write_text("a\nb\n")

  class Table(tf.Module):

    def __init__(self):
      super().__init__()
      self.table = tf.lookup.StaticHashTable(tf.lookup.TextFileInitializer(
          str(vocab), tf.string, tf.lookup.TextFileIndex.WHOLE_LINE,
          tf.int64, tf.lookup.TextFileIndex.LINE_NUMBER), -1)
      self.w = tf.Variable([[2.0]], name="w")

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string),
                                  tf.TensorSpec([None, 1], tf.float32)])
    def __call__(self, s, x):
      ids = tf.cast(self.table.lookup(s)[:, None], tf.float32)
      return {"y": x @ self.w * ids}

  table = Table()
  tf.saved_model.save(table, str(tmp_path / "table"),
                      signatures=table.__call__)
  line = error_line(capsys, ["inspect", str(tmp_path / "table"),
                             "--no-sandbox"])
  assert "the signature captures 'hash_table', a resource in the object " \
         "graph of" in line
  assert line.endswith("graphgrad rebuilds captured variables, constants "
                       "and assets only (a lookup table or another resource "
                       "is not rebuilt). Open a model whose signature "
                       "captures none.")


def test_a_model_saved_without_signatures(tmp_path, capsys):
  module = tf.Module()
  module.w = tf.Variable([1.0], name="w")
  tf.saved_model.save(module, str(tmp_path / "bare"))
  line = error_line(capsys, ["grads", str(tmp_path / "bare"),
                             "--no-sandbox"])
  assert "was saved without signatures, so it has no inputs and outputs " \
         "to open. Save it with one" in line
