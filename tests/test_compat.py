"""The supported TensorFlow range: one place, agreeing with setup.cfg."""

import configparser
import logging
import pathlib
import re
import types

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from graphgrad import _compat
from graphgrad.analysis import _graph_util
from graphgrad.keras._layer_tree import LayerIndex
from graphgrad.plan import _hooks, _reach
from helpers import dense

tf1 = tf.compat.v1

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_running_tensorflow_is_in_the_supported_range():
  if "dev" in tf.__version__ and _compat.TF_VERSION > _compat.NEWEST:
    pytest.skip(f"a TensorFlow build newer than the tested range "
                f"({tf.__version__}, tools/test_newest_tf.sh)")
  assert _compat.OLDEST <= _compat.TF_VERSION <= _compat.NEWEST


def test_setup_cfg_declares_the_same_range():
  cfg = configparser.ConfigParser()
  cfg.read(ROOT / "setup.cfg")
  requires = cfg["options"]["install_requires"]
  m = re.search(r"tensorflow>=(\d+)\.(\d+),<(\d+)\.(\d+)", requires)
  assert m, requires
  lo, hi = tuple(map(int, m.group(1, 2))), tuple(map(int, m.group(3, 4)))
  assert lo == _compat.OLDEST
  assert hi == (_compat.NEWEST[0], _compat.NEWEST[1] + 1)


@pytest.mark.parametrize("version", ["2.14.1", "2.22.0rc1", "3.0.0"])
def test_unsupported_tensorflow_warns(version, caplog):
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    assert not _compat.check_tensorflow(version)
  (record,) = caplog.records
  assert re.search(rf"tested with TensorFlow 2\.15 to 2\.21; found "
                   rf"{re.escape(version)}\. .*pip install "
                   rf"'tensorflow>=2\.15,<2\.22'", record.getMessage())


@pytest.mark.parametrize("version", ["2.15.0", "2.16.2", "2.21.0"])
def test_supported_tensorflow_is_quiet(version, caplog):
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    assert _compat.check_tensorflow(version)
  assert not caplog.records


# -- private TensorFlow APIs: each fallback gives the same answer ------------


@pytest.fixture
def fresh_warnings(monkeypatch):
  """Forgets which fallbacks were already logged in this process."""
  monkeypatch.setattr(_compat, "_warned", set())


def _fallback_logs(caplog, api):
  return [r for r in caplog.records
          if r.name == "graphgrad" and "no usable" in r.getMessage()
          and api in r.getMessage()]


def test_private_apis_are_listed():
  assert "tf.Operation._id" in _compat.PRIVATE_APIS
  assert "tensorflow.python.ops.gradients_util._MarkReachedOps" in (
      _compat.PRIVATE_APIS)
  for api in _compat.PRIVATE_APIS:  # each one is documented with its fallback
    assert api.split()[-1].split(".")[-1] in _compat.__doc__


def _mlp():
  x = tf1.placeholder(tf.float32, [None, 3], name="x")
  h = dense(dense(x, 4, "l1", tf.tanh), 4, "l2", tf.tanh)
  return tf.reduce_sum(dense(h + 0.1 * x @ tf.ones([3, 4]), 2, "l3"))


def test_op_id_fallback_gives_the_same_order(graph, monkeypatch, caplog,
                                             fresh_warnings):
  loss = _mlp()
  ops = _graph_util.forward_ops(loss)
  ids = [_compat.op_id(op) for op in ops]
  monkeypatch.delattr(tf.Operation, "_id")
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    assert [op.name for op in _graph_util.forward_ops(loss)] == [
        op.name for op in ops]
    fallback = [_compat.op_id(op) for op in ops]
  assert fallback == sorted(fallback) and ids == sorted(ids)
  assert len(_fallback_logs(caplog, "tf.Operation._id")) == 1  # logged once


def test_ref_dtype_fallback(monkeypatch, caplog, fresh_warnings):
  ref = tf.float32._as_ref  # pylint: disable=protected-access
  monkeypatch.delattr(tf.DType, "_is_ref_dtype")
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    assert _compat.is_ref_dtype(ref) and not _compat.is_ref_dtype(tf.float32)
    assert not _compat.is_ref_dtype(tf.resource)
  assert len(_fallback_logs(caplog, "tf.DType._is_ref_dtype")) == 1


def test_control_flow_context_fallback_finds_the_same_v1_frames(
    monkeypatch, caplog, fresh_warnings):
  from tensorflow.python.ops import control_flow_util  # pylint: disable=g-import-not-at-top
  was = control_flow_util.ENABLE_CONTROL_FLOW_V2
  tf1.disable_control_flow_v2()
  try:
    with tf.Graph().as_default() as g:
      x = tf1.placeholder(tf.float32, [None, 3])
      with tf1.variable_scope("cell"):
        w = tf1.get_variable("w", initializer=np.eye(3, dtype=np.float32))
      _, h = tf1.while_loop(lambda i, h: i < 3,
                            lambda i, h: (i + 1, tf.tanh(h @ w)),
                            (tf.constant(0), dense(x, 3, "stem")))
      loss = tf.reduce_sum(dense(h, 2, "top"))
      real = {op.name: _graph_util.in_control_flow(op)
              for op in g.get_operations()}
      net = gg.analyze(loss)
      monkeypatch.delattr(tf.Operation, "_get_control_flow_context")
      with caplog.at_level(logging.WARNING, logger="graphgrad"):
        assert {op.name: _graph_util.in_control_flow(op)
                for op in g.get_operations()} == real
        again = gg.analyze(loss)
      assert [(l.name, [o.name for o in l.ops]) for l in again] == [
          (l.name, [o.name for o in l.ops]) for l in net]
      assert len(_fallback_logs(caplog, "_get_control_flow_context")) == 1
  finally:
    if was:
      tf1.enable_control_flow_v2()


def _residual_plan_graph():
  with tf.Graph().as_default() as g:
    x = tf1.placeholder(tf.float32, [None, 6], name="x")
    h0 = dense(x, 6, "stem", tf.tanh)
    h1 = dense(h0, 6, "block1", tf.tanh) + h0
    loss = tf.reduce_sum(tf.square(dense(h1, 3, "head")))
    plan = gg.GradientPlan(loss)
    for name in ("head", "block1"):
      plan.transform_upstream(name, gg.transforms.scale(0.5))
    plan.compute_gradients()
    return [(n.name, n.op, tuple(n.input)) for n in g.as_graph_def().node]


@pytest.mark.parametrize("change", ["missing", "signature"])
def test_reach_falls_back_to_tensorflows_walk(change, monkeypatch, caplog,
                                              fresh_warnings):
  bounded = _residual_plan_graph()
  assert _reach.available()
  # TensorFlow as _reach sees it: a gradients_util without the function, or
  # with one of another signature. TF's own module stays intact.
  real = _reach.gradients_util
  # A TensorFlow whose walk was never replaced.
  monkeypatch.setattr(real, "_MarkReachedOps", _reach._tf_walk()[0])  # pylint: disable=protected-access
  seen = types.SimpleNamespace(_PendingCount=real._PendingCount,  # pylint: disable=protected-access
                               backprop_util=real.backprop_util)
  if change == "signature":
    seen._MarkReachedOps = lambda from_ops, reached_ops: None  # pylint: disable=protected-access
  monkeypatch.setattr(_reach, "gradients_util", seen)
  monkeypatch.setattr(_reach, "_AT_IMPORT", None)
  monkeypatch.setattr(_reach, "_RESOLVED", None)
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    assert not _reach.available()
    fallback = _residual_plan_graph()
    assert not _reach.available()
  assert getattr(seen, "_MarkReachedOps", None) is not _reach._mark_reached_ops  # pylint: disable=protected-access
  assert fallback == bounded  # the same GraphDef, node for node
  assert len(_fallback_logs(caplog, "_MarkReachedOps")) == 1


def test_sublayers_fallback_lists_the_same_layers(monkeypatch, caplog,
                                                  fresh_warnings):
  keras = tf.keras

  class Block(keras.layers.Layer):

    def __init__(self):
      super().__init__()
      self.a = keras.layers.Dense(2, name="a")
      self.parts = [keras.layers.Dense(2, name="b"),
                    keras.layers.Dense(2, name="c")]

    def call(self, x):
      return self.parts[1](self.parts[0](self.a(x)))

  model = keras.Sequential([keras.layers.Dense(3, name="d"), Block()])
  model(tf.ones([1, 2]))
  block = model.layers[1]
  real = ([l.name for l in _compat.sublayers(model)],
          [l.name for l in _compat.sublayers(block)])
  paths = LayerIndex(model).paths
  layer_class = [c for c in type(block).__mro__
                 if "_flatten_layers" in c.__dict__][0]
  monkeypatch.delattr(layer_class, "_flatten_layers")
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    assert ([l.name for l in _compat.sublayers(model)],
            [l.name for l in _compat.sublayers(block)]) == real
    assert _compat.has_sublayers_api(model)
    fallback_paths = LayerIndex(model).paths
  assert real[0][-2:] == ["d", block.name] and real[1] == ["a", "b", "c"]
  assert len(_fallback_logs(caplog, "_flatten_layers")) == 1
  assert fallback_paths == paths  # KerasPlan's layer tree is the same


def test_gradient_function_fallback(graph, monkeypatch, caplog,
                                    fresh_warnings):
  x = tf1.placeholder(tf.float32, [None, 3])
  with tf1.get_default_graph().gradient_override_map(
      {"Identity": "NoSuchGradient"}):
    y = tf.identity(x)
  assert not _compat.has_gradient_function(y.op)
  assert _compat.has_gradient_function(tf.square(x).op)
  monkeypatch.setattr(_compat, "_get_gradient_function", lambda: None)
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    assert _compat.has_gradient_function(y.op)
    assert _compat.has_gradient_function(y.op)
  assert len(_fallback_logs(caplog, "get_gradient_function")) == 1


def _chain_plan_values():
  with tf.Graph().as_default() as g:
    x = tf1.placeholder(tf.float32, [None, 3], name="x")
    h = dense(dense(x, 4, "l1", tf.tanh), 4, "l2", tf.tanh)
    loss = tf.reduce_sum(tf.square(dense(h, 2, "l3")))
    plan = gg.GradientPlan(loss)
    for name in ("l2", "l3"):
      plan.transform_upstream(name, gg.transforms.scale(0.5))
    before = len(g.get_operations())
    grads = [grad for grad, _ in plan.compute_gradients()]
    added = len(g.get_operations()) - before
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      values = sess.run(grads, {x: np.arange(6.0).reshape(2, 3) / 6})
  return values, added


def test_chained_layers_fall_back_to_one_call_per_layer(monkeypatch, caplog,
                                                        fresh_warnings):
  hooked, hooked_ops = _chain_plan_values()
  # A TensorFlow without the function: nothing was ever replaced.
  monkeypatch.setattr(_hooks._tf_ops, "get_gradient_function",  # pylint: disable=protected-access
                      _hooks._ORIGINAL)  # pylint: disable=protected-access
  monkeypatch.setattr(_hooks, "_ORIGINAL", None)
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    assert not _hooks.available()
    cut, cut_ops = _chain_plan_values()
  assert len(_fallback_logs(caplog, "ops.get_gradient_function")) == 1
  # One tf.gradients call per layer: an Identity on each call's grad_ys.
  assert cut_ops == hooked_ops + 2
  for a, b in zip(hooked, cut):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_gradient_hooks_refuse_to_run_without_the_lookup(monkeypatch,
                                                        fresh_warnings):
  with tf.Graph().as_default():
    op = tf.square(tf.constant(2.0)).op
  monkeypatch.setattr(_hooks, "_ORIGINAL", None)
  with pytest.raises(RuntimeError,
                     match="gradient hooks need ops.get_gradient_function"):
    with _hooks.hooked({op: _hooks.Hook()}):
      pass
