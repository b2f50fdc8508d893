"""Random layer DAGs with skips and merges, built from one spec.

A :class:`DagSpec` describes a small network: dense layers ``l0 .. l{n-1}``,
each in its own variable scope, each fed by a merge (add or concat, inside or
outside the layer's scope) of the placeholder and earlier layers' outputs,
with ``tanh`` inside the scope, outside it as glue, or absent. Some layer
outputs, pre-activations and merges also feed the loss directly, some kernels
carry an L2 regularizer, and the loss is the sum of all those terms.

:func:`build` turns a spec into a graph. With ``upstream`` and ``edges`` it
builds the *reference*: the same network with gradient-scaling identities
``stop_gradient(t) + c * (t - stop_gradient(t))`` wired by hand onto the
inputs of the scaled layers and onto the scaled edges. It never imports
graphgrad, so ``tf.gradients`` of the reference loss is an independent
account of what a plan of scales must compute.

Initial weights, regularizer weights, targets and the input batch come from
numpy, seeded by the spec, so every graph built from one spec computes the
same numbers.
"""

import dataclasses
import math
from typing import Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf
from hypothesis import strategies as st

tf1 = tf.compat.v1

X = -1  # the placeholder, as a layer source
MERGES = ("add", "concat")
ACTIVATIONS = ("inside", "outside", "none")
SCALES = (0.0, 1.0, -1.0, 0.5, 2.0, -3.0, 0.25)

Edge = Tuple[str, str]


def layer_name(i: int) -> str:
  return f"l{i}"


@dataclasses.dataclass(frozen=True)
class LayerSpec:
  """One dense layer.

  Attributes:
    sources: what the layer reads: ``X`` (the placeholder) or indices of
      earlier layers, sorted, without repeats.
    merge: ``"add"`` or ``"concat"``; only used with several sources.
    merge_in_scope: whether the merge op sits in the layer's own scope.
    activation: ``"inside"`` (tanh in the layer's scope, so part of it),
      ``"outside"`` (tanh as glue) or ``"none"``.
    head: whether the layer's output also feeds the loss directly.
    pre_head: whether the pre-activation also feeds the loss. With tanh
      inside the scope the layer then has two outputs, one computed from
      the other.
    merge_head: whether the merge (of several sources) also feeds the loss.
      A merge in the layer's scope is then one of the layer's outputs; a
      merge outside is glue read by the layer and the loss.
  """
  sources: Tuple[int, ...]
  merge: str = "add"
  merge_in_scope: bool = False
  activation: str = "inside"
  head: bool = False
  pre_head: bool = False
  merge_head: bool = False


@dataclasses.dataclass(frozen=True)
class DagSpec:
  """A random network: layers, regularized kernels, dtype, seed."""
  layers: Tuple[LayerSpec, ...]
  width: int = 4
  batch: int = 3
  regularized: Tuple[int, ...] = ()
  dtype: str = "float64"
  seed: int = 0

  @property
  def names(self) -> Tuple[str, ...]:
    return tuple(layer_name(i) for i in range(len(self.layers)))

  def edges(self) -> FrozenSet[Edge]:
    """Layer-graph edges ``lower -> upper`` the spec wires."""
    return frozenset((layer_name(s), layer_name(i))
                     for i, l in enumerate(self.layers)
                     for s in l.sources if s != X)

  def heads(self) -> Tuple[int, ...]:
    """Layers whose output feeds the loss directly.

    Flagged heads, and every layer no later layer reads (so that every
    layer reaches the loss).
    """
    read = {s for l in self.layers for s in l.sources}
    return tuple(i for i, l in enumerate(self.layers)
                 if l.head or i not in read)


@dataclasses.dataclass
class Model:
  """A built network."""
  x: tf.Tensor
  loss: tf.Tensor
  variables: List[tf.Variable]
  outputs: Dict[str, tf.Tensor]  # layer name -> tensor its readers see
  feed: Dict[tf.Tensor, np.ndarray]


def scaled_identity(t: tf.Tensor, c: float) -> tf.Tensor:
  """Forward: ``t``. Backward: ``c`` times the incoming gradient."""
  sg = tf.stop_gradient(t)
  # tf.constant, not tf.cast: a Python float cast to float64 would pass
  # through float32 first.
  return sg + tf.constant(c, dtype=t.dtype) * (t - sg)


def _numbers(spec: DagSpec):
  """Every number the graph needs, from the spec's seed."""
  rng = np.random.default_rng(spec.seed)
  dt = np.dtype(spec.dtype)
  w = spec.width
  params = []
  for l in spec.layers:
    fan_in = w * (len(l.sources) if l.merge == "concat" else 1)
    params.append((
        (rng.normal(size=(fan_in, w)) / math.sqrt(fan_in)).astype(dt),
        (0.1 * rng.normal(size=(w,))).astype(dt)))
  targets = [rng.normal(size=(spec.batch, w)).astype(dt)
             for _ in spec.layers]
  reg = [float(rng.uniform(0.1, 1.0)) for _ in spec.layers]
  x = rng.normal(size=(spec.batch, w)).astype(dt)
  return params, targets, reg, x


def build(spec: DagSpec,
          upstream: Optional[Mapping[str, float]] = None,
          edges: Optional[Mapping[Edge, float]] = None) -> Model:
  """Builds the network of ``spec`` in the default graph.

  Args:
    spec: the network.
    upstream: layer name -> scale. Every input of that layer, as the layer
      consumes it, goes through a scaled identity: the merge's operands when
      the merge is in the layer's scope, the merged tensor otherwise. The
      layer's parameters are untouched.
    edges: ``(lower, upper)`` -> scale. ``upper`` reads ``lower``'s output
      through a scaled identity; every other reader sees the plain tensor.

  Returns:
    A :class:`Model`.
  """
  upstream = dict(upstream or {})
  edges = dict(edges or {})
  dtype = tf.as_dtype(spec.dtype)
  params, targets, reg, x_value = _numbers(spec)
  x = tf1.placeholder(dtype, [None, spec.width], name="x")
  seen: Dict[int, tf.Tensor] = {X: x}
  variables: List[tf.Variable] = []
  outputs: Dict[str, tf.Tensor] = {}
  kernels = []
  terms = []

  for i, l in enumerate(spec.layers):
    name = layer_name(i)
    up = upstream.get(name)
    operands = []
    for s in l.sources:
      t = seen[s]
      c = edges.get((layer_name(s), name)) if s != X else None
      operands.append(t if c is None else scaled_identity(t, c))

    def merge(ts, l=l):
      if len(ts) == 1:
        return ts[0]
      return tf.add_n(ts) if l.merge == "add" else tf.concat(ts, axis=1)

    def upstream_identity(t, up=up):
      return t if up is None else scaled_identity(t, up)

    merge_head = l.merge_head and len(l.sources) > 1
    if l.merge_in_scope:
      operands = [upstream_identity(t) for t in operands]
    else:
      merged = merge(operands)
      h = upstream_identity(merged)
      if merge_head:
        # The loss reads the glue merge the layer reads, but through none
        # of the layer's scaled identities. Without edge identities (the
        # plain graph) that is the very same tensor.
        plain = [seen[s] for s in l.sources]
        if any(o is not p for o, p in zip(operands, plain)):
          merged = merge(plain)
        terms.append(tf.reduce_sum(tf.sin(merged)))
    with tf1.variable_scope(name):
      if l.merge_in_scope:
        h = merge(operands)
      kernel = tf1.get_variable("kernel", initializer=params[i][0])
      bias = tf1.get_variable("bias", initializer=params[i][1])
      pre = out = tf.nn.bias_add(tf.matmul(h, kernel), bias)
      if l.activation == "inside":
        out = tf.tanh(out)
    if l.pre_head:
      terms.append(0.25 * tf.reduce_sum(tf.square(pre)))
    if l.merge_in_scope and merge_head:
      # One of the layer's outputs: the loss's share through it enters the
      # layer, so the layer's upstream and edge scales apply to it.
      terms.append(tf.reduce_sum(tf.sin(h)))
    if l.activation == "outside":
      out = tf.tanh(out)
    variables += [kernel, bias]
    kernels.append(kernel)
    seen[i] = out
    outputs[name] = out

  for i in spec.heads():
    # A loss term per head: half squared error against a fixed target.
    terms.append(0.5 * tf.reduce_sum(tf.square(seen[i] - targets[i])))
  for i in spec.regularized:
    terms.append(tf.constant(reg[i], dtype) * tf.nn.l2_loss(kernels[i]))
  loss = tf.add_n(terms, name="loss")
  return Model(x=x, loss=loss, variables=variables, outputs=outputs,
               feed={x: x_value})


# -- strategies ------------------------------------------------------------


@st.composite
def dag_specs(draw, min_layers: int = 2, max_layers: int = 6,
              dtypes: Sequence[str] = ("float64",)) -> DagSpec:
  """Random :class:`DagSpec` with skips, merges, heads and regularizers."""
  n = draw(st.integers(min_layers, max_layers))
  layers = []
  for i in range(n):
    if i == 0:
      sources = (X,)
    else:
      pool = [X] + list(range(i))
      sources = tuple(sorted(draw(st.sets(
          st.sampled_from(pool), min_size=1, max_size=min(3, len(pool))))))
    layers.append(LayerSpec(
        sources=sources,
        merge=draw(st.sampled_from(MERGES)),
        merge_in_scope=draw(st.booleans()),
        activation=draw(st.sampled_from(ACTIVATIONS)),
        head=draw(st.booleans()),
        pre_head=draw(st.booleans()),
        merge_head=draw(st.booleans())))
  regularized = tuple(sorted(draw(st.sets(st.integers(0, n - 1)))))
  return DagSpec(
      layers=tuple(layers),
      width=draw(st.integers(3, 5)),
      batch=draw(st.integers(1, 4)),
      regularized=regularized,
      dtype=draw(st.sampled_from(tuple(dtypes))),
      seed=draw(st.integers(0, 2**16)))


def scales() -> st.SearchStrategy:
  """A scale: mostly simple values (0, 1, negative), sometimes any float."""
  return st.one_of(st.sampled_from(SCALES),
                   st.floats(-4.0, 4.0, allow_nan=False))


def scale_chains(max_size: int = 2) -> st.SearchStrategy:
  """One or more scales declared in order on the same layer or edge."""
  return st.lists(scales(), min_size=1, max_size=max_size).map(tuple)


def upstream_plans(spec: DagSpec, min_size: int = 1,
                   chains: Optional[st.SearchStrategy] = None
                   ) -> st.SearchStrategy:
  """Layer name -> tuple of upstream scales."""
  if chains is None:
    chains = scale_chains()
  return st.dictionaries(st.sampled_from(spec.names), chains,
                         min_size=min_size, max_size=len(spec.names))


def edge_plans(spec: DagSpec, min_size: int = 1,
               chains: Optional[st.SearchStrategy] = None
               ) -> st.SearchStrategy:
  """Edge -> tuple of edge scales, on the spec's existing edges."""
  edges = sorted(spec.edges())
  if not edges:
    return st.just({})
  if chains is None:
    chains = scale_chains()
  return st.dictionaries(st.sampled_from(edges), chains,
                         min_size=min(min_size, len(edges)),
                         max_size=len(edges))


# How a plan declares one scale c: as gg.transforms.scale(c) (linear, so the
# engine weights one backward pass), as an undeclared callable ``c * g``, or
# chained with a clip too wide to act (both nonlinear to the engine, so the
# layer is cut). The reference is the same for all three.
KINDS = ("linear", "opaque", "clip")


def mixed_chains(max_size: int = 2) -> st.SearchStrategy:
  """Scale chains whose entries are ``(c, kind)``, kind from ``KINDS``."""
  entry = st.tuples(scales(), st.sampled_from(KINDS))
  return st.lists(entry, min_size=1, max_size=max_size).map(tuple)


def _scale_of(entry) -> float:
  return entry[0] if isinstance(entry, tuple) else entry


def product(chains: Mapping) -> Dict:
  """Collapses each chain of scales into the one scale it amounts to."""
  return {k: float(np.prod([_scale_of(c) for c in v], dtype=np.float64))
          for k, v in chains.items()}
