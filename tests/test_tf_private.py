"""Private TensorFlow and Keras APIs: the registry, self-tests and fallbacks.

Each failure is simulated by changing TensorFlow or Keras (a function that
no longer routes through the replaced lookup, a private name graphgrad can
no longer read), never graphgrad; the fallback must give the gradients of an
independent ``tf.gradients`` or ``GradientTape`` reference and log once.
"""

import ast
import logging
import pathlib
import re
import sys
import types

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from graphgrad import _compat
from graphgrad.analysis import _graph_util
from graphgrad.keras._layer_index import LayerIndex
from helpers import dense
from keras_cases import FLAVOURS

tf1 = tf.compat.v1

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "graphgrad"


@pytest.fixture
def fresh():
  """Self-tests run again for this test, and again after it."""
  _compat.reset()
  yield
  _compat.reset()


def _warnings(caplog, key):
  name = _compat.PRIVATE_APIS[key].name
  return [r for r in caplog.records if r.name == "graphgrad"
          and "fails graphgrad's self-test" in r.getMessage()
          and name in r.getMessage()]


# -- the registry -------------------------------------------------------------


def _own_names():
  """Every name graphgrad defines: modules, functions, classes, attributes."""
  names = {p.stem for p in PACKAGE.rglob("*.py")}
  for path in PACKAGE.rglob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, (ast.FunctionDef, ast.ClassDef,
                           ast.AsyncFunctionDef)):
        names.add(node.name)
      elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
        names.add(node.id)
      elif isinstance(node, ast.Attribute) and isinstance(node.ctx,
                                                          ast.Store):
        names.add(node.attr)
      elif isinstance(node, ast.arg):
        names.add(node.arg)
  return names


# Documented standard-library functions whose names start with "_": public
# API, not a private TF or Keras name (``os._exit`` ends the command line on
# ``grads --timeout``).
STDLIB_PUBLIC = {("os", "_exit")}


def _private_names_read():
  """Private TF/Keras names in graphgrad/: modules and ``_`` attributes."""
  own = _own_names()
  found = set()
  for path in PACKAGE.rglob("*.py"):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and node.module and re.match(
          r"(tensorflow\.python|keras\.src|tf_keras\.src)", node.module):
        found |= {f"{node.module}.{a.name}" for a in node.names}
      elif isinstance(node, ast.Import):
        found |= {a.name for a in node.names
                  if re.match(r"(tensorflow\.python|keras\.src)", a.name)}
      elif isinstance(node, ast.Attribute):
        name = node.attr
        owner = getattr(node.value, "id", None)
        if (name.startswith("_") and not name.startswith("__")
            and name not in own and (owner, name) not in STDLIB_PUBLIC):
          found.add(name)
      elif isinstance(node, ast.Call):
        # getattr(obj, "_name"), hasattr, setattr, ThreadPatch("_name", ...)
        func = getattr(node.func, "id", getattr(node.func, "attr", ""))
        at = {"getattr": 1, "hasattr": 1, "setattr": 1, "delattr": 1,
              "ThreadPatch": 0}.get(func)
        arg = node.args[at] if at is not None and len(node.args) > at \
            else None
        if (isinstance(arg, ast.Constant) and isinstance(arg.value, str)
            and re.fullmatch(r"_[A-Za-z]\w*", arg.value)
            and arg.value not in own):
          found.add(arg.value)
  return found


def test_the_registry_lists_every_private_name_graphgrad_reads():
  listed = {s for api in _compat.PRIVATE_APIS.values() for s in api.symbols}
  assert _private_names_read() == listed
  # The APIs and the private modules they live in: at most seven names (the
  # op registry, which the checks of a saved graph before import read, is
  # both an API and its module).
  names = {api.name for api in _compat.PRIVATE_APIS.values()}
  modules = {s for s in listed if s.startswith("tensorflow.")}
  assert len(names | modules) <= 7, sorted(names | modules)


def test_every_entry_says_why_what_it_proves_and_its_fallback():
  for api in _compat.PRIVATE_APIS.values():
    assert api.why and api.self_test and api.fallback and callable(api.check)


def test_every_self_test_passes_on_this_tensorflow(fresh, caplog):
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    for key in ("gradient_lookup", "reached_walk", "control_flow_context",
                "op_def_registry"):
      assert _compat.usable(key), key
    assert _compat.usable("control_flow_context", "xla")
    for flavour in FLAVOURS.values():
      package = flavour.__name__.split(".")[0]
      assert _compat.usable("flatten_layers", package), package
  assert not caplog.records


# -- changing TensorFlow ------------------------------------------------------


def _rebuilt(monkeypatch, module, name, **bindings):
  """``module.<name>``, rebuilt to read ``bindings`` instead of its globals.

  TensorFlow then calls what ``bindings`` give, whatever graphgrad puts in
  the module's attributes: a release that no longer routes through them.
  """
  fn = getattr(module, name)
  scope = dict(fn.__globals__, **bindings)
  copy = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__,
                            fn.__closure__)
  copy.__kwdefaults__ = fn.__kwdefaults__
  monkeypatch.setattr(module, name, copy)


class _Hidden:
  """A class attribute that code in graphgrad can no longer read.

  TensorFlow and Keras keep using it; graphgrad sees it gone, as on a
  release that renamed it.
  """

  def __init__(self, value):
    self.value = value

  def __get__(self, obj, cls=None):
    caller = sys._getframe(1).f_globals.get("__name__", "")  # pylint: disable=protected-access
    if caller.startswith("graphgrad"):
      raise AttributeError("hidden from graphgrad")
    return self.value.__get__(obj, cls) if obj is not None else self.value


def _hide(monkeypatch, cls, name):
  owner = next(c for c in cls.__mro__ if name in c.__dict__)
  monkeypatch.setattr(owner, name, _Hidden(owner.__dict__[name]))


def _mlp_plan_gradients(factors):
  """Plan and reference gradients of an MLP with ``scale`` on layers.

  The reference multiplies each variable's ``tf.gradients`` by the product
  of the factors of the layers above it.
  """
  with tf.Graph().as_default() as g:
    x = tf1.placeholder(tf.float32, [None, 3], name="x")
    h = dense(dense(x, 4, "l1", tf.tanh), 4, "l2", tf.tanh)
    loss = tf.reduce_sum(tf.square(dense(h, 2, "l3")))
    plan = gg.GradientPlan(loss)
    for name, c in factors.items():
      plan.transform_upstream(name, gg.transforms.scale(c))
    before = len(g.get_operations())
    grads_and_vars = plan.compute_gradients()
    added = len(g.get_operations()) - before
    variables = [v for _, v in grads_and_vars]
    reference = tf.gradients(loss, variables)
    weights = []
    for v in variables:
      layer = int(v.op.name[1])
      weights.append(np.prod([c for name, c in factors.items()
                              if int(name[1]) > layer]))
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      feed = {x: np.arange(6.0).reshape(2, 3) / 6}
      got, want = sess.run([[gr for gr, _ in grads_and_vars], reference],
                           feed)
  return got, [w * r for w, r in zip(weights, want)], added


def _assert_close(got, want):
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


FACTORS = {"l2": 0.5, "l3": 0.25}


def test_a_tensorflow_that_stops_calling_the_lookup_unchains(
    fresh, monkeypatch, caplog):
  chained, reference, chained_ops = _mlp_plan_gradients(FACTORS)
  _assert_close(chained, reference)
  from tensorflow.python.ops import gradients_util  # pylint: disable=g-import-not-at-top
  real = gradients_util.ops
  # TensorFlow's own lookup, bound where tf.gradients reads it.
  proxy = types.SimpleNamespace(**{n: getattr(real, n) for n in dir(real)
                                   if not n.startswith("__")})
  proxy.get_gradient_function = _compat.original_function("gradient_lookup")
  _rebuilt(monkeypatch, gradients_util, "_GradientsHelper", ops=proxy)
  _compat.reset()
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    unchained, reference2, unchained_ops = _mlp_plan_gradients(FACTORS)
    _mlp_plan_gradients(FACTORS)
  _assert_close(unchained, reference2)
  _assert_close(unchained, chained)
  # One call per layer: an Identity on each further call's grad_ys.
  assert unchained_ops == chained_ops + 2
  (record,) = _warnings(caplog, "gradient_lookup")
  assert "did not call the replaced lookup" in record.getMessage()
  assert not _compat.usable("gradient_lookup")


def test_without_the_lookup_a_plan_with_an_override_is_refused(
    fresh, monkeypatch, caplog):
  from tensorflow.python.ops import gradients_util  # pylint: disable=g-import-not-at-top
  real = gradients_util.ops
  proxy = types.SimpleNamespace(**{n: getattr(real, n) for n in dir(real)
                                   if not n.startswith("__")})
  proxy.get_gradient_function = _compat.original_function("gradient_lookup")
  _rebuilt(monkeypatch, gradients_util, "_GradientsHelper", ops=proxy)
  _compat.reset()
  with tf.Graph().as_default():
    x = tf1.placeholder(tf.float32, [None, 3])
    h = tf.round(dense(x, 4, "l1", tf.tanh), name="l2/round")
    loss = tf.reduce_sum(tf.square(dense(h, 2, "l2")))
    plan = gg.GradientPlan(loss).straight_through("Round")
    with caplog.at_level(logging.WARNING, logger="graphgrad"):
      with pytest.raises(gg.GraphGradError,
                         match=rf"TensorFlow {re.escape(tf.__version__)} fails "
                               rf"graphgrad's self-test of its gradient-"
                               rf"function lookup .* the ops l2/round their "
                               rf"overridden backward pass"):
        plan.compute_gradients()
  assert _warnings(caplog, "gradient_lookup")


def test_without_the_lookup_every_op_counts_as_having_a_gradient(
    fresh, graph, monkeypatch, caplog):
  x = tf1.placeholder(tf.float32, [None, 3])
  with graph.gradient_override_map({"Identity": "NoSuchGradient"}):
    y = tf.identity(x)
  assert not _compat.has_gradient_function(y.op)
  from tensorflow.python.framework import ops  # pylint: disable=g-import-not-at-top
  monkeypatch.delattr(ops, "get_gradient_function")
  with _compat.as_at_import(), caplog.at_level(logging.WARNING,
                                               logger="graphgrad"):
    assert _compat.has_gradient_function(y.op)
    assert _compat.has_gradient_function(tf.square(x).op)
  (record,) = _warnings(caplog, "gradient_lookup")
  assert "get_gradient_function is missing" in record.getMessage()


def _residual_graph_def():
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


@pytest.mark.parametrize("change", ["not_called", "missing"])
def test_a_tensorflow_without_the_walk_keeps_its_own(change, fresh,
                                                     monkeypatch, caplog):
  bounded = _residual_graph_def()
  bounded_grads, reference, _ = _mlp_plan_gradients(FACTORS)
  from tensorflow.python.ops import gradients_util  # pylint: disable=g-import-not-at-top
  walk = _compat.original_function("reached_walk")
  _rebuilt(monkeypatch, gradients_util, "_PendingCount", _MarkReachedOps=walk)
  if change == "missing":
    monkeypatch.delattr(gradients_util, "_MarkReachedOps")
  _compat.reset()
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    unbounded = _residual_graph_def()
    grads, reference2, _ = _mlp_plan_gradients(FACTORS)
  assert unbounded == bounded  # the same GraphDef, node for node
  _assert_close(grads, reference2)
  _assert_close(grads, bounded_grads)
  (record,) = _warnings(caplog, "reached_walk")
  assert re.search("did not use the bounded walk|_MarkReachedOps is missing",
                   record.getMessage())


def _v1_loop_plan(scale_top):
  tf1.disable_control_flow_v2()
  x = tf1.placeholder(tf.float32, [None, 3])
  with tf1.variable_scope("cell"):
    w = tf1.get_variable("w", initializer=np.eye(3, dtype=np.float32) * 0.5)
  _, h = tf1.while_loop(lambda i, h: i < 3,
                        lambda i, h: (i + 1, tf.tanh(h @ w)),
                        (tf.constant(0), dense(x, 3, "stem")))
  loss = tf.reduce_sum(tf.square(dense(h, 2, "top")))
  plan = gg.GradientPlan(loss)
  plan.transform_upstream("top", gg.transforms.scale(scale_top))
  grads_and_vars = plan.compute_gradients()
  variables = [v for _, v in grads_and_vars]
  reference = tf.gradients(loss, variables)
  weights = [1.0 if v.op.name.startswith("top/") else scale_top
             for v in variables]
  with tf1.Session() as sess:
    sess.run(tf1.global_variables_initializer())
    feed = {x: np.arange(6.0).reshape(2, 3) / 6}
    got, want = sess.run([[g for g, _ in grads_and_vars], reference], feed)
  layers = [(l.name, [o.name for o in l.ops]) for l in plan.net]
  return got, [w * r for w, r in zip(weights, want)], layers


def test_a_tensorflow_without_control_flow_contexts_reads_the_collections(
    fresh, monkeypatch, caplog):
  was_v2 = tf1.control_flow_v2_enabled()
  try:
    with tf.Graph().as_default() as g:
      got, want, layers = _v1_loop_plan(0.5)
      _assert_close(got, want)
      forward = [op for op in g.get_operations()
                 if not op.name.startswith(("gradients", "graphgrad/"))]
      real = {op.name: _graph_util.in_control_flow(op) for op in forward}
      assert any(real.values())
      _hide(monkeypatch, tf.Operation, "_get_control_flow_context")
      _compat.reset()
      with caplog.at_level(logging.WARNING, logger="graphgrad"):
        assert {op.name: _graph_util.in_control_flow(op)
                for op in forward} == real
    with tf.Graph().as_default():
      with caplog.at_level(logging.WARNING, logger="graphgrad"):
        got2, want2, layers2 = _v1_loop_plan(0.5)
  finally:
    if was_v2:
      tf1.enable_control_flow_v2()
  assert layers2 == layers
  _assert_close(got2, want2)
  _assert_close(got2, got)
  (record,) = _warnings(caplog, "control_flow_context")
  assert "hidden from graphgrad" in record.getMessage()


@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
def test_a_keras_without_flatten_layers_lists_attributes(flavour, fresh,
                                                         monkeypatch, caplog):
  K = FLAVOURS[flavour]

  class Block(K.layers.Layer):

    def __init__(self):
      super().__init__(name="block")
      self.a = K.layers.Dense(3, name="a", activation="tanh")
      self.parts = [K.layers.Dense(3, name="b", activation="tanh")]

    def call(self, x):
      return self.parts[0](self.a(x))

  model = K.Sequential([K.layers.Dense(3, name="d", activation="tanh"),
                        Block(), K.layers.Dense(2, name="top")])
  x = tf.constant(np.arange(6.0).reshape(2, 3) / 6, tf.float32)
  model(x)

  def run():
    plan = gg.KerasPlan(model)
    plan.transform_upstream("block", gg.transforms.scale(0.5))
    with plan.tape() as tape:
      loss = tf.reduce_sum(tf.square(model(x)))
    got = tape.gradient(loss, model.trainable_variables)
    with tf.GradientTape() as ref:
      loss = tf.reduce_sum(tf.square(model(x)))
    want = ref.gradient(loss, model.trainable_variables)
    below = {id(v) for v in model.layers[0].trainable_variables}
    want = [w * (0.5 if id(v) in below else 1.0)
            for w, v in zip(want, model.trainable_variables)]
    return [g.numpy() for g in got], [w.numpy() for w in want]

  got, want = run()
  _assert_close(got, want)
  index = LayerIndex(model)
  paths = tuple(p for p in index.paths
                if type(index[p]).__name__ != "InputLayer")
  _hide(monkeypatch, type(model.layers[1]), "_flatten_layers")
  _compat.reset()
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    # A Sequential's InputLayer is listed only by _flatten_layers.
    assert LayerIndex(model).paths == paths
    got2, want2 = run()
  _assert_close(got2, want2)
  _assert_close(got2, got)
  (record,) = _warnings(caplog, "flatten_layers")
  assert "hidden from graphgrad" in record.getMessage()


def test_without_op_signatures_the_checks_before_import_that_need_them_skip(
    fresh, monkeypatch, caplog):
  from tensorflow.python.framework import op_def_registry  # pylint: disable=g-import-not-at-top

  from graphgrad.analysis import _graph_limits  # pylint: disable=g-import-not-at-top
  graph_def = tf1.GraphDef()
  dims = graph_def.node.add(name="dims", op="Const")
  dims.attr["dtype"].type = tf.int32.as_datatype_enum
  dims.attr["value"].tensor.CopyFrom(tf.make_tensor_proto([1024, 1024]))
  fill = graph_def.node.add(name="fill", op="Fill", input=["dims", "zero"])
  fill.attr["T"].type = tf.float32.as_datatype_enum
  with pytest.raises(_graph_limits.GraphLimitError,
                     match=r"^node 'fill' \(Fill\) takes its `dims` input"):
    _graph_limits.check(graph_def, memory_bytes=2 ** 20)
  big = graph_def.node.add(name="big", op="Const")
  big.attr["value"].tensor.dtype = tf.float32.as_datatype_enum
  big.attr["value"].tensor.tensor_shape.dim.add(size=2 ** 20)
  monkeypatch.delattr(op_def_registry, "get")
  _compat.reset()
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    assert _compat.op_def("Fill") is None
    # The Fill's size needs its signature: skipped. The Const's does not.
    with pytest.raises(_graph_limits.GraphLimitError,
                       match=r"^node 'big' \(Const\) holds in its `value`"):
      _graph_limits.check(graph_def, memory_bytes=2 ** 20)
  (record,) = _warnings(caplog, "op_def_registry")
  assert "op_def_registry.get is missing" in record.getMessage()
