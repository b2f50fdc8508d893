"""The ways of building a train op that the benchmarks compare.

Each variant takes a :class:`~benchmarks._models.Built` model in its graph
and an optimizer, adds its train op, and returns it with notes. All use the
optimizer's default gating (``GATE_OP``) and run the graph's ``UPDATE_OPS``
(batch-norm statistics) before the update, as ``GradientPlan`` does.
"""

import logging
import time
from typing import Callable, Dict, List, Optional, Tuple

import tensorflow as tf

import graphgrad as gg

tf1 = tf.compat.v1
log = logging.getLogger("graphgrad.benchmarks")

VARIANTS = ("minimize", "naive", "gg_identity", "gg_all", "gg_cut", "gg_edge")
LABELS = {
    "minimize": "(a) minimize()",
    "naive": "(b) hand recipe, per boundary",
    "gg_identity": "(c) graphgrad, identity plan",
    "gg_all": "(d) graphgrad, scale+clip upstream of every layer",
    "gg_cut": "(d0) graphgrad, every layer cut, pass-through fn",
    "gg_edge": "(e) graphgrad, one edge transform",
}


# More variants, by name: (built, optimizer) -> (train op, notes). Suites
# with variants of their own register them here.
EXTRA: Dict[str, Callable] = {}


class Skip(Exception):
  """A variant that does not apply here; the message says why."""


def upstream_fn():
  """The rewrite used by (b) and (d): scale, then clip."""
  return gg.transforms.chain(gg.transforms.scale(0.5),
                             gg.transforms.clip_by_value(-1.0, 1.0))


def _with_updates(fn):
  updates = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
  with tf.control_dependencies(updates):
    return fn()


def _scope_vars(scope):
  return tf1.get_collection(tf1.GraphKeys.TRAINABLE_VARIABLES, scope + "/")


def naive_recipe(built, optimizer):
  """The seed's hand recipe at every boundary, each from the loss.

  For each boundary (lower, upper): ``g = tf.gradients(loss, upper_out)``,
  then ``tf.gradients(upper_out, lower_vars, grad_ys=f(g))``; the top layer
  gets ``compute_gradients(loss, top_vars)``. Every call starts at the loss,
  so the work above each boundary is rebuilt once per boundary.
  """
  f = upstream_fn()
  names = [n for n, _ in built.layers]
  outs = dict(built.layers)
  gv: List[Tuple] = []
  top = names[-1]
  gv += optimizer.compute_gradients(built.loss, var_list=_scope_vars(top))
  for lower, upper in zip(names[:-1], names[1:]):
    out = outs[upper]
    g = tf1.gradients(built.loss, out)[0]
    lower_vars = _scope_vars(lower)
    grads = tf1.gradients(out, lower_vars, grad_ys=f(g))
    gv += list(zip(grads, lower_vars))
  gv = [(g, v) for g, v in gv if g is not None]
  return _with_updates(lambda: optimizer.apply_gradients(gv))


def build(variant: str, built, optimizer) -> Tuple[tf.Operation, Dict]:
  """Adds ``variant``'s train op; returns it and timing notes.

  Raises:
    Skip: when the variant cannot apply to this model.
  """
  info: Dict = {}
  if variant in EXTRA:
    return EXTRA[variant](built, optimizer)
  if variant == "minimize":
    return _with_updates(lambda: optimizer.minimize(built.loss)), info
  if variant == "naive":
    return naive_recipe(built, optimizer), info
  t = time.perf_counter()
  net = gg.analyze(built.loss)
  info["analyze_s"] = time.perf_counter() - t
  plan = gg.GradientPlan(built.loss, net)
  below = [n for n in net.names if any(True for _ in net.graph.predecessors(n))]
  if variant == "gg_identity":
    for name in below:
      plan.transform_upstream(name, gg.transforms.identity())
  elif variant in ("gg_all", "gg_cut"):
    for name in below:
      # gg_cut: a plain callable that returns g unchanged is not known to be
      # the identity, so the plan cuts every layer as (d) does, but adds no
      # transform ops: (d) minus (d0) is the cost of the transforms alone.
      plan.transform_upstream(
          name, upstream_fn() if variant == "gg_all" else (lambda g: g))
    info["transformed"] = len(below)
    try:
      plan.compute_gradients()
    except gg.UnsupportedGraphError as e:
      # A layer inside a loop cannot be cut; keep the others.
      raise Skip(str(e).split(".")[0]) from None
  elif variant == "gg_edge":
    if not hasattr(gg.GradientPlan, "transform_edge"):
      raise Skip("GradientPlan has no transform_edge on this branch")
    edge = middle_edge(net)
    if edge is None:
      raise Skip("the layer graph has no edge")
    plan.transform_edge(edge[0], edge[1], gg.transforms.scale(0.5))
    info["edge"] = f"{edge[0]} -> {edge[1]}"
  else:
    raise ValueError(f"unknown variant {variant!r}; known: {VARIANTS}")
  return plan.apply_gradients(optimizer), info


def middle_edge(net) -> Optional[Tuple[str, str]]:
  order = {n: i for i, n in enumerate(net.names)}
  edges = sorted(net.graph.edges, key=lambda e: (order[e[1]], order[e[0]]))
  return edges[len(edges) // 2] if edges else None
