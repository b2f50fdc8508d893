"""gg.analyze: layers, glue, boundaries and errors."""

import networkx as nx
import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from helpers import dense

tf1 = tf.compat.v1


def _names(net):
  return [l.name for l in net.layers]


def test_layers_from_tf_compat_v1_layers(graph):
  x = tf1.placeholder(tf.float32, [None, 10])
  h = tf1.layers.dense(x, 20, activation=tf.nn.relu, name="l1_dense")
  out = tf1.layers.dense(h, 2, name="l2_dense")
  net = gg.analyze(tf.reduce_mean(out))
  assert _names(net) == ["l1_dense", "l2_dense"]
  assert [v.name for v in net["l1_dense"].variables] == [
      "l1_dense/kernel:0", "l1_dense/bias:0"]
  assert list(net.graph.edges) == [("l1_dense", "l2_dense")]
  assert net.boundary("l1_dense", "l2_dense") == (h,)
  assert net["l1_dense"].outputs == (h,)
  assert net["l2_dense"].inputs == (h,)
  assert net["l1_dense"].inputs == (x,)
  assert all(op.name.startswith("l1_dense/") for op in net["l1_dense"].ops)


def test_layers_from_get_variable_with_glue_between(graph):
  x = tf1.placeholder(tf.float32, [None, 4])
  a = dense(x, 3, "enc/a")
  b = dense(x, 3, "enc/b")
  merged = tf.concat([tf.nn.relu(a), b], axis=1)  # glue
  out = dense(merged, 2, "head")
  net = gg.analyze(tf.reduce_sum(out))
  assert set(_names(net)) == {"enc/a", "enc/b", "head"}
  assert _names(net)[-1] == "head"
  assert set(net.graph.edges) == {("enc/a", "head"), ("enc/b", "head")}
  assert net.boundary("enc/a", "head") == (a,)
  assert net["head"].inputs == (merged,)
  assert isinstance(net.op_graph, nx.DiGraph)
  assert net.op_graph.has_edge(merged.op.name, out.op.inputs[0].op.name)
  assert net.op_graph.nodes[merged.op.name]["layer"] is None  # glue
  # Initializers are not forward ops of the loss.
  assert not any("Initializer" in n for n in net.op_graph.nodes)


def test_no_edge_through_another_layer(graph):
  x = tf1.placeholder(tf.float32, [None, 4])
  h = dense(dense(dense(x, 3, "a"), 3, "b"), 2, "c")
  net = gg.analyze(tf.reduce_sum(h))
  assert set(net.graph.edges) == {("a", "b"), ("b", "c")}
  with pytest.raises(
      gg.GraphGradError,
      match=r"no edge 'a' -> 'c'.*'a' feeds: b; 'c' is fed by: b"):
    net.boundary("a", "c")


def test_keras_functional_model_in_a_tf1_graph(graph):
  keras = tf.keras  # tf-keras here: the test conftest sets TF_USE_LEGACY_KERAS
  inp = keras.Input((6,))
  h = keras.layers.Dense(5, activation="relu", name="hidden")(inp)
  out = keras.layers.Dense(2, name="logits")(h)
  model = keras.Model(inp, out)
  net = gg.analyze(tf.reduce_sum(tf.square(model.output)))
  assert _names(net) == ["hidden", "logits"]
  assert list(net.graph.edges) == [("hidden", "logits")]
  assert net["hidden"].num_params == 6 * 5 + 5


def test_keras_model_called_on_a_new_input_is_attributed_by_scope(graph):
  keras = tf.keras
  inp = keras.Input((6,))
  out = keras.layers.Dense(2, name="only")(
      keras.layers.Dense(5, name="first")(inp))
  model = keras.Model(inp, out)
  x = tf1.placeholder(tf.float32, [None, 6])
  y = model(x)  # ops under "model/first/...", "model/only/..."
  net = gg.analyze(tf.reduce_sum(y))
  assert _names(net) == ["first", "only"]
  assert all("first" in op.name for op in net["first"].ops)
  assert list(net.graph.edges) == [("first", "only")]


def test_layers_mapping_by_prefix_and_by_variables(graph):
  x = tf1.placeholder(tf.float32, [None, 4])
  h = dense(x, 3, "block/conv")
  h = dense(h, 3, "block/bn")
  out = dense(h, 2, "head")
  loss = tf.reduce_sum(out)
  net = gg.analyze(loss, layers={"block": "block"})
  assert _names(net) == ["block", "head"]
  assert len(net["block"].variables) == 4
  head_vars = tf1.trainable_variables("head")
  net = gg.analyze(loss, layers={"top": head_vars})
  assert _names(net) == ["block/conv", "block/bn", "top"]
  assert list(net.graph.edges) == [("block/conv", "block/bn"),
                                   ("block/bn", "top")]


def test_depth_groups_nested_scopes(graph):
  x = tf1.placeholder(tf.float32, [None, 4])
  h = dense(x, 3, "resnet/block1/conv1")
  h = dense(h, 3, "resnet/block1/bn1")
  h = dense(h, 3, "resnet/block2/conv1")
  loss = tf.reduce_sum(dense(h, 2, "head"))
  net = gg.analyze(loss, depth=2)
  assert _names(net) == ["resnet/block1", "resnet/block2", "head"]
  assert len(net["resnet/block1"].variables) == 4
  assert gg.analyze(loss, depth=1).names == ("resnet", "head")


def test_top_level_variables_are_grouped_by_the_ops_that_use_them(graph):
  x = tf1.placeholder(tf.float32, [None, 4])
  w = tf1.get_variable("w", initializer=np.ones((4, 3), np.float32))
  v = tf1.get_variable("v", initializer=np.ones((3, 1), np.float32))
  h = tf.matmul(x, w)
  net = gg.analyze(tf.reduce_sum(tf.matmul(h, v)))
  assert _names(net) == ["MatMul", "MatMul_1"]
  assert list(net.graph.edges) == [("MatMul", "MatMul_1")]
  assert net.boundary("MatMul", "MatMul_1") == (h,)
  assert net["MatMul"].variables == (w,)
  assert net.layer_of_variable(v) == "MatMul_1"


def test_a_top_level_variable_no_parametric_op_reads_is_its_own_layer(graph):
  x = tf1.placeholder(tf.float32, [None, 4])
  s = tf1.get_variable("s", initializer=np.ones((4,), np.float32))
  net = gg.analyze(tf.reduce_sum(tf.tanh(x) * s))
  assert _names(net) == ["s"]
  assert [t.op.type for t in net["s"].outputs] == ["ReadVariableOp"]


def test_shared_scope_is_one_layer_with_two_call_sites(graph):
  x1 = tf1.placeholder(tf.float32, [None, 4])
  x2 = tf1.placeholder(tf.float32, [None, 4])
  t1 = tf1.layers.dense(x1, 3, name="tower")
  t2 = tf1.layers.dense(x2, 3, name="tower", reuse=True)
  net = gg.analyze(tf.reduce_sum(dense(tf.concat([t1, t2], 1), 1, "head")))
  assert _names(net) == ["tower", "head"]
  tower = net["tower"]
  assert tower.call_sites == 2
  assert set(tower.outputs) == {t1, t2}
  assert set(tower.inputs) == {x1, x2}
  assert "tower  2" in net.summary()


def test_summary_lists_layers_params_and_boundaries(graph):
  x = tf1.placeholder(tf.float32, [None, 10])
  h = dense(x, 20, "l1_dense")
  net = gg.analyze(tf.reduce_sum(dense(h, 2, "l2_dense")))
  text = net.summary()
  assert "l1_dense" in text and "kernel [10,20]" in text and "220" in text
  assert "l1_dense -> l2_dense: l1_dense/BiasAdd:0 [?,20]" in text
  assert "262 trainable parameters" in text


def test_unknown_layer_lists_known_names(graph):
  x = tf1.placeholder(tf.float32, [None, 4])
  net = gg.analyze(tf.reduce_sum(dense(dense(x, 3, "l1"), 2, "l2")))
  with pytest.raises(gg.LayerNotFoundError,
                     match=r"no layer named 'l3'; known layers: l1, l2"):
    net["l3"]
  with pytest.raises(KeyError):
    net["l3"]
  with pytest.raises(gg.GraphGradError, match=r"layer names are strings"):
    net[0]
  assert "l1" in net and "l3" not in net and len(net) == 2


def test_loss_must_be_a_float_graph_tensor(graph):
  x = tf1.placeholder(tf.float32, [None, 4])
  dense(x, 2, "a")
  with pytest.raises(
      gg.GraphGradError,
      match=r"must be a floating-point tensor; got .* int32"):
    gg.analyze(tf.constant(3))
  with pytest.raises(gg.GraphGradError, match=r"got the variable a/kernel"):
    gg.analyze(tf1.trainable_variables()[0])
  with pytest.raises(gg.GraphGradError, match=r"got float. Build the model"):
    gg.analyze(1.0)
  with pytest.raises(
      gg.NotConnectedError, match=r"depends on no trainable variable"):
    gg.analyze(tf.reduce_sum(x))
  with pytest.raises(
      gg.GraphGradError, match=r"`depth` must be a positive int"):
    gg.analyze(tf.reduce_sum(dense(x, 2, "b")), depth=0)


def test_eager_loss_is_rejected():
  with pytest.raises(gg.GraphGradError, match=r"eager tensor.*tf.Graph"):
    gg.analyze(tf.constant(1.0))


def test_bad_layer_mappings(graph):
  x = tf1.placeholder(tf.float32, [None, 4])
  h = dense(dense(x, 3, "a"), 2, "b")
  other = tf1.get_variable("unused", [2])
  loss = tf.reduce_sum(h)
  a_vars = tf1.trainable_variables("a")
  with pytest.raises(gg.GraphGradError, match=r"empty mapping"):
    gg.analyze(loss, layers={})
  with pytest.raises(gg.GraphGradError, match=r"must map layer names"):
    gg.analyze(loss, layers=["a"])
  with pytest.raises(gg.GraphGradError, match=r"prefix 'zz'.*no trainable"):
    gg.analyze(loss, layers={"z": "zz"})
  with pytest.raises(gg.GraphGradError, match=r"empty list of variables"):
    gg.analyze(loss, layers={"z": []})
  with pytest.raises(
      gg.GraphGradError, match=r"must be a scope prefix .* got int"):
    gg.analyze(loss, layers={"z": 3})
  with pytest.raises(gg.GraphGradError, match=r"not a trainable variable"):
    gg.analyze(loss, layers={"z": [x]})
  with pytest.raises(gg.NotConnectedError, match=r"does not depend on"):
    gg.analyze(loss, layers={"z": [other]})
  with pytest.raises(gg.GraphGradError, match=r"in both 'p' and 'q'"):
    gg.analyze(loss, layers={"p": "a", "q": a_vars})
  with pytest.raises(gg.GraphGradError, match=r"splits the name scope 'a'"):
    gg.analyze(loss, layers={"p": a_vars[:1], "q": a_vars[1:]})
  with pytest.raises(gg.GraphGradError, match=r"keys must be non-empty"):
    gg.analyze(loss, layers={"": "a"})
  with pytest.raises(gg.GraphGradError, match=r"already a mapped layer"):
    gg.analyze(loss, layers={"b": a_vars})
