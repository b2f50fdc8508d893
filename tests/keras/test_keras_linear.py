"""KerasPlan: a linear upstream rewrite computes the layer's VJP once.

For every linear transform and six network shapes, the fused tape (one VJP,
the input cotangent weighted by the factor) must equal the same plan forced
through the general path (a second VJP of ``f(dy)``) and a reference: the
same model called with gradient-scaling identities
``stop(t) + c * (t - stop(t))`` wired where the rewritten share enters the
layer, differentiated by a plain ``tf.GradientTape``.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from graphgrad.keras import _intercept
from helpers import opaque

T = gg.transforms
LINEAR = {
    "scale": (T.scale(0.5), 0.5),
    "reverse": (T.reverse(0.3), -0.3),
    "zero": (T.zero(), 0.0),
    "chain": (T.chain(T.scale(2.0), T.reverse(0.25)), -0.5),
    "declared": (T.linear(lambda g: 0.7 * g, 0.7), 0.7),
}


def _dense(units, name, act=None):
  seed = sum(map(ord, name))
  init = keras.initializers.RandomNormal(stddev=0.5, seed=seed)
  return keras.layers.Dense(units, activation=act, name=name,
                            kernel_initializer=init,
                            bias_initializer=keras.initializers.Constant(0.1))


class Net(keras.Model):
  """A model whose call wires scaled identities: (upper, lower) -> c."""

  def __init__(self, kind):
    super().__init__()
    self.kind, self.factors = kind, {}
    self.l1 = _dense(5, "l1", "tanh")
    self.l2 = _dense(5, "l2", "tanh")
    self.l3 = _dense(3, "l3")
    if kind == "lstm":
      self.rnn = keras.layers.LSTM(
          6, name="rnn", kernel_initializer=keras.initializers.GlorotUniform(3),
          recurrent_initializer=keras.initializers.Orthogonal(seed=4))
    if kind == "embedding":
      self.embed = keras.layers.Embedding(
          20, 4, name="embed",
          embeddings_initializer=keras.initializers.RandomNormal(seed=5))

  def into(self, upper, lower, t):
    c = self.factors.get((upper, lower), 1.0)
    if c == 1.0:
      return t
    stop = tf.stop_gradient(t)
    return stop + c * (t - stop)

  def call(self, x):
    i = self.into
    if self.kind == "embedding":
      e = tf.reshape(self.embed(x), [-1, 12])
      h1 = self.l1(i("l1", "embed", e))
      return [self.l3(i("l3", "l1", h1)), self.embed(x[:, :1])]
    if self.kind == "lstm":
      h = self.rnn(i("rnn", "l1", self.l1(x)))
      return [self.l3(i("l3", "rnn", h))]
    if self.kind == "shared":  # one layer at two call sites
      a, b = self.l1(x[:, :2]), self.l1(x[:, 2:])
      ea, eb = self.l2(i("l2", "l1", a)), self.l2(i("l2", "l1", b))
      return [self.l3(tf.concat([ea, eb], 1))]
    h1 = self.l1(x)
    h2 = self.l2(i("l2", "l1", h1))
    if self.kind == "skip":
      return [self.l3(tf.nn.relu(h2 + h1))]
    if self.kind == "heads":
      return [self.l3(i("l3", "l1", h1)), h2]
    return [self.l3(h2)]


# kind -> (upstream layers, edges, reference entries)
CASES = {
    "chain": (["l2"], [], [("l2", "l1")]),
    "skip": (["l2"], [], [("l2", "l1")]),
    "heads": (["l2"], [("l1", "l3")], [("l2", "l1"), ("l3", "l1")]),
    "shared": (["l2"], [], [("l2", "l1")]),
    "lstm": (["rnn"], [], [("rnn", "l1")]),
    "embedding": (["l1"], [], [("l1", "embed")]),
}


def _inputs(kind):
  rng = np.random.default_rng(0)
  if kind == "embedding":
    return tf.constant(rng.integers(0, 20, size=(6, 3)), tf.int32)
  shape = (6, 4, 3) if kind == "lstm" else (6, 4)
  return tf.constant(rng.normal(size=shape).astype(np.float32))


def _loss(outs):
  return sum(tf.reduce_sum(tf.sin(o) + tf.square(o)) for o in outs)


def _plan_grads(model, x, upstream, edges, fn, fuse):
  plan = gg.KerasPlan(model)
  fn = fn if fuse else opaque(fn)
  for name in upstream:
    plan.transform_upstream(name, fn)
  for lo, up in edges:
    plan.transform_edge(lo, up, fn)

  @tf.function
  def step(x):
    with plan.tape() as tape:
      loss = _loss(model(x))
    return tape.gradient(loss)

  return step(x)


def _value(g, like):
  if g is None:
    return np.zeros(like.shape, np.float32)
  return np.asarray(tf.convert_to_tensor(g))


@pytest.mark.parametrize("transform", sorted(LINEAR))
@pytest.mark.parametrize("kind", sorted(CASES))
def test_one_vjp_equals_two_and_the_reference(kind, transform):
  upstream, edges, entries = CASES[kind]
  fn, c = LINEAR[transform]
  model, x = Net(kind), _inputs(kind)
  model(x)
  fused = _plan_grads(model, x, upstream, edges, fn, True)
  cut = _plan_grads(model, x, upstream, edges, fn, False)
  for e in entries:
    model.factors[e] = model.factors.get(e, 1.0) * c
  with tf.GradientTape() as tape:
    loss = _loss(model(x))
  want = tape.gradient(loss, model.trainable_variables)
  for v, a, b, r in zip(model.trainable_variables, fused, cut, want):
    a, b, r = _value(a, v), _value(b, v), _value(r, v)
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6, err_msg=v.name)
    np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-6, err_msg=v.name)


def _backward_loops(graph_def):
  """How many times a step runs a while loop's backward loop.

  A backward loop is a While op whose body is a gradient function; one inside
  a function counts once per call of that function.
  """
  lib = {f.signature.name: f for f in graph_def.library.function}

  def count(nodes):
    n = 0
    for node in nodes:
      if (node.op in ("While", "StatelessWhile")
          and "_grad" in node.attr["body"].func.name):
        n += 1
      called = node.attr["f"].func.name if "f" in node.attr else ""
      if called in lib:
        n += count(lib[called].node_def)
    return n

  return count(graph_def.node)


@pytest.mark.parametrize("fuse, loops", [(True, 1), (False, 2)])
def test_lstm_rewrite_runs_one_backward_loop(fuse, loops):
  model, x = Net("lstm"), _inputs("lstm")
  model(x)
  plan = gg.KerasPlan(model)
  plan.transform_upstream("rnn", T.scale(0.5) if fuse
                          else opaque(T.scale(0.5)))

  @tf.function
  def step(x):
    with plan.tape() as tape:
      loss = _loss(model(x))
    return tape.gradient(loss)

  graph_def = step.get_concrete_function(x).graph.as_graph_def()
  assert _backward_loops(graph_def) == loops


def _rounding_model(quant_call):
  rng = np.random.default_rng(5)
  inp = tf.keras.Input((3,))
  h = tf.keras.layers.Dense(4, name="fc1", kernel_initializer=(
      tf.keras.initializers.Constant(rng.normal(size=(3, 4)))))(inp)

  class Quant(tf.keras.layers.Layer):
    def call(self, x):  # noqa: D102
      return quant_call(x)

  q = Quant(name="quant")(h)
  out = tf.keras.layers.Dense(2, name="fc2", kernel_initializer=(
      tf.keras.initializers.Constant(rng.normal(size=(4, 2)))))(q)
  return tf.keras.Model(inp, out)


def _rounded(t):
  return tf.round(t * 4.0) / 4.0


@tf.custom_gradient
def _rounded_half_straight_through(t):
  return _rounded(t), lambda dy: 0.5 * dy


def test_a_linear_rewrite_on_an_overridden_layer_keeps_the_override():
  # The override is the layer's gradient function: it receives the rewritten
  # gradient, so the one-VJP path (which would backpropagate through Round,
  # whose gradient is None) must not be taken.
  x = tf.constant(np.random.default_rng(2).normal(size=(5, 3)), tf.float32)
  model = _rounding_model(_rounded)
  plan = (gg.KerasPlan(model).transform_upstream("quant", T.scale(0.5))
          .straight_through("quant"))
  with plan.tape() as tape:
    loss = _loss([model(x)])
  got = tape.gradient(loss)
  reference = _rounding_model(_rounded_half_straight_through)
  with tf.GradientTape() as tape:
    loss = _loss([reference(x)])
  want = tape.gradient(loss, reference.trainable_variables)
  assert all(g is not None and np.abs(g).max() > 0 for g in got)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


class Tied(keras.layers.Layer):
  """Reads another layer's kernel, which it does not track, besides its own."""

  def __init__(self, peer, **kwargs):
    super().__init__(**kwargs)
    self._peer = lambda: peer.kernel  # a lambda: Keras does not track it

  def build(self, input_shape):
    self.w = self.add_weight(
        shape=(int(input_shape[-1]), 3), name="w",
        initializer=keras.initializers.RandomNormal(stddev=0.5, seed=7))

  def call(self, x):
    return tf.tanh(x @ self.w) + x @ tf.convert_to_tensor(self._peer())[:, :3]


class TiedNet(keras.Model):
  def __init__(self):
    super().__init__()
    self.l1 = _dense(4, "l1", "tanh")
    self.tied = Tied(self.l1, name="tied")

  def call(self, x):
    return [self.tied(self.l1(x))]


@pytest.mark.parametrize("traced", [True, False])
def test_a_layer_reading_another_layers_variable_weights_that_share_too(
    traced):
  model, x = TiedNet(), _inputs("chain")
  model(x)
  plan = gg.KerasPlan(model).transform_upstream("tied", T.scale(0.5))

  def step(x):
    with plan.tape() as tape:
      loss = _loss(model(x))
    return tape.gradient(loss)

  got = (tf.function(step) if traced else step)(x)
  # The layer cannot run unintercepted: l1's kernel, read inside it, must
  # get half of what it gets there, as l1's output does.
  assert _intercept._READS_OWN[model.tied] is False  # pylint: disable=protected-access
  with tf.GradientTape() as tape:
    loss = _loss(model(x))
  plain = tape.gradient(loss, model.trainable_variables)
  mine = {id(v) for v in model.tied.trainable_variables}
  for v, a, p in zip(model.trainable_variables, got, plain):
    want = p if id(v) in mine else 0.5 * p
    np.testing.assert_allclose(_value(a, v), want, rtol=1e-5, atol=1e-6,
                               err_msg=v.name)


@pytest.mark.parametrize("transform", ["scale", "zero"])
def test_a_dense_layer_runs_unintercepted_in_eager_mode(transform):
  fn, c = LINEAR[transform]
  upstream, _, entries = CASES["chain"]
  model, x = Net("chain"), _inputs("chain")
  model(x)
  plan = gg.KerasPlan(model).transform_upstream("l2", fn)
  with plan.tape() as tape:
    loss = _loss(model(x))
  got = tape.gradient(loss)
  assert _intercept._READS_OWN[model.l2] is True  # pylint: disable=protected-access
  model.factors[entries[0]] = c
  with tf.GradientTape() as tape:
    loss = _loss(model(x))
  want = tape.gradient(loss, model.trainable_variables)
  for v, a, r in zip(model.trainable_variables, got, want):
    np.testing.assert_allclose(_value(a, v), _value(r, v), rtol=1e-5,
                               atol=1e-6, err_msg=v.name)
