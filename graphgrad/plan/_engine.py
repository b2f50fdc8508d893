"""Segmented backpropagation: one ``tf.gradients`` call per segment.

The plan hands this module the analysed layer graph, the variables to
differentiate, and where gradients must be rewritten. It cuts the forward
op graph at the tensors where a rewritten gradient enters or leaves:

* the outputs ``T`` and inputs ``I`` of every layer with an upstream
  rewrite or an incoming edge rewrite;
* the boundary tensors of every layer that feeds a layer with an edge
  rewrite (so that the edge's share can be told apart).

Each cut belongs to a *source group* (:mod:`graphgrad.plan._cuts`): the
outputs of one cut layer, the direct share of an edge's upper layer, or the
tensors of one op. A group's call starts from its tensors with the fully
accumulated gradient as ``grad_ys`` and stops, with ``stop_gradients``, at
the next cuts below it, where its results are added to their accumulators.
Groups run in topological order of a small DAG (a group runs after every
group that adds to it), so each accumulator is complete when it is read.

Every forward op is thus backpropagated by the one segment that contains it.
A layer with a nonlinear upstream rewrite ``f`` is backpropagated twice (once
with the plain gradient for its parameters, once with ``f(g)`` for what lies
below). A *linear* rewrite ``f(g) = c * g`` commutes with the linear backward
map, so the layer's segment runs once, and what it deposits below (and into
variables of other layers it reads) is weighted by ``c``; a factor of 0
builds nothing below. Such a layer's segment also takes in the glue that
feeds only it (an activation between two layers), which then needs no
segment of its own. A linear edge rewrite weights the edge's share instead
of rewriting it.

A run of such layers, each fed by the one above alone (``scale`` on every
boundary of an MLP), needs no call per layer: one call covers the run, from
the loss down, and inside it each layer's ops weight the gradient they hand
below the layer (``_chains``, ``_hooks``). What the plan adds to
``minimize()`` is then one ``Mul`` per boundary.

Where the order of a linear rewrite and another one on the same layer
matters (a backward replacement, which sees the rewritten gradient itself),
the engine calls ``fn`` as for a nonlinear rewrite.

Every segment calls ``gradients_fn`` (the plan's ``tf.gradients`` cut at the
ops it overrides, see ``_override``) instead of ``tf.gradients`` itself. With
no cuts at all the caller makes a single call instead, which is exactly what
``Optimizer.minimize`` builds.
"""

import dataclasses
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import tensorflow as tf

from graphgrad.analysis._layer_graph import LayerGraph
from graphgrad.methods._backward import completed_upstream
from graphgrad.plan import _hooks, _reach
from graphgrad.plan._backprop import Backprop, aggregate, is_zero
from graphgrad.plan._chains import Chains
from graphgrad.plan._cuts import CutPlan, Group, Kind, ancestors

__all__ = ["Rewrite", "Segments", "aggregate"]

# False: every linear rewrite takes the general path (a second backward pass
# with ``fn``), as a nonlinear one does. Exactness tests compare both paths.
FUSE_LINEAR = True


@dataclasses.dataclass(frozen=True)
class Rewrite:
  """An upstream or edge rewrite as the engine receives it.

  Attributes:
    fn: ``(grad, tensor) -> grad``, the rewrite with the plan's checks.
    factor: ``c`` when ``fn`` computes ``c * grad`` (a Python number, see
      ``Transform.linear_factor``), else ``None``. With a factor the engine
      never calls ``fn`` except where a backward replacement needs the
      rewritten gradient.
    observe: called as ``observe(grad, tensor)`` with each gradient that
      a linear rewrite weights instead of calling ``fn`` on (summaries).
  """
  fn: Callable
  factor: Optional[float] = None
  observe: Optional[Callable] = None


Entry = Union[Rewrite, Callable]


def _rewrite(entry: Entry, fuse: bool) -> Rewrite:
  rw = entry if isinstance(entry, Rewrite) else Rewrite(entry)
  return rw if fuse or rw.factor is None else Rewrite(rw.fn)


class Segments:
  """Plans and builds the segmented backward pass of one gradient plan.

  Args:
    net: the analysed layer graph.
    variables: the variables to differentiate.
    upstream: layer name -> :class:`Rewrite`, or a callable
      ``(grad, tensor) -> grad``, applied to the upstream gradient of each
      output tensor.
    edges: ``(lower, upper)`` -> :class:`Rewrite` or callable, applied to the
      gradient ``upper`` sends directly into ``lower``'s tensor.
    options: keyword arguments for ``tf.gradients``.
    backward: layer name -> callable replacing the chain rule from the
      layer's outputs to its inputs. It is called with keywords ``layer``,
      ``outputs``, ``upstream`` (the gradients at ``outputs`` after the
      upstream rewrite), ``inputs``, ``chain_rule`` (a function building
      what the chain rule would give) and ``upstream_of`` (layer name -> the
      complete gradients at that cut layer's outputs), and returns one
      gradient per input.
    outputs_fn: layer name -> callable ``(grads, outputs) -> grads`` applied
      to the total gradient at the layer's outputs before anything else: the
      layer's own parameters and everything below see its result.
    cuts: more layers to cut, whose output gradients ``upstream_of`` reads.
    fuse_linear: weight linear rewrites instead of a second backward pass;
      defaults to the module's ``FUSE_LINEAR``.
    gradients_fn: what each segment calls instead of ``tf.gradients``, with
      the same arguments (the plan's gradient overrides, see ``_override``).
  """

  def __init__(self, net: LayerGraph, variables,
               upstream: Dict[str, Entry],
               edges: Dict[Tuple[str, str], Entry], options: dict,
               backward: Optional[Dict[str, Callable]] = None,
               outputs_fn: Optional[Dict[str, Callable]] = None,
               cuts: Sequence[str] = (), fuse_linear: Optional[bool] = None,
               gradients_fn: Optional[Callable] = None):
    fuse = FUSE_LINEAR if fuse_linear is None else fuse_linear
    self.net = net
    self.gradients_fn = gradients_fn or tf.compat.v1.gradients
    self.variables = {v.op.name: v for v in variables}
    self.upstream = {k: _rewrite(e, fuse) for k, e in upstream.items()}
    self.edges = {k: _rewrite(e, fuse) for k, e in edges.items()}
    self.options = options
    self.backward = dict(backward or {})
    self.outputs_fn = dict(outputs_fn or {})
    self.edge_uppers = {up for _, up in edges}
    cut_layers = (set(upstream) | self.edge_uppers | set(self.backward)
                  | set(self.outputs_fn) | set(cuts))
    # A layer whose only rewrite is linear also backpropagates the glue
    # that feeds it alone: one segment per layer, not one more per glue op.
    special = self.edge_uppers | set(self.backward) | set(self.outputs_fn)
    self._special = special | set(cuts)
    absorbing = [n for n, rw in self.upstream.items()
                 if rw.factor is not None and n not in self._special]
    self.cuts = CutPlan(net, self.variables, cut_layers, self.edge_uppers,
                        absorbing)
    # Each segment call walks only the ops behind its ys (see _reach).
    self._bound = _reach.can_bound(
        d["op"] for _, d in net.op_graph.nodes(data=True))
    self._done: Dict[str, List] = {}
    # Chains of linear layers run as one call only with TF's own
    # tf.gradients (an override splits calls at its ops, past any hook).
    self._chains = Chains(
        net, self.cuts, self.variables,
        {n: rw.factor for n, rw in self.upstream.items()
         if rw.factor is not None}, self._special,
        enabled=(fuse and self.gradients_fn is tf.compat.v1.gradients
                 and _hooks.available()))

  @property
  def cut_layers(self):
    return self.cuts.cut_layers

  def schedule(self) -> List[Group]:
    """Returns the source groups in execution order, with their regions."""
    return self.cuts.schedule()

  def build(self, seed: tf.Tensor,
            reduce: Optional[Callable] = None) -> Dict[str, List]:
    """Builds the backward pass; returns variable name -> contributions.

    Args:
      seed: the gradient of the loss.
      reduce: optional ``(var_names, grads) -> grads``, applied to the
        parameter gradients each ``tf.gradients`` call (segment) produces,
        before they join the variables' contributions.
    """
    bp = Backprop(self.variables, self.options, self._bound, reduce,
                  gradients_fn=self.gradients_fn)
    bp.acc[self.net.loss.name].append(seed)
    self._done = {}
    run = {Kind.LAYER: self._run_layer, Kind.SHARE: self._run_share,
           Kind.OP: self._run_op}
    order = self.schedule()
    chains = self._chains.find(order)
    covered = {g.key for chain in chains.values() for g in chain[1:]}
    for group in order:
      if group.key in chains:
        self._run_chain(chains[group.key], bp)
      elif group.key not in covered:
        run[group.key.kind](group, bp)
    bp.fill_zeros(lambda ts: ancestors(self.net, ts))
    return bp.var_grads

  # -- chains of linear layers (see _chains) ---------------------------------

  def _run_chain(self, chain: List[Group], bp: Backprop) -> None:
    """One call from the first group's sources to the last one's targets."""
    head, last = chain[0], chain[-1]
    g = bp.total(head.sources)
    if head.key.kind is Kind.LAYER:
      self._observe(head.key.name, head.sources, g)
    seen: Dict[str, object] = {}
    hooks = self._chains.hooks(chain, bp.weigh, seen.setdefault)
    variables = list(dict.fromkeys(n for x in chain for n in x.variables))
    with _hooks.hooked(hooks):
      res = bp.call(head.sources, g, last.targets, variables,
                    stops=last.targets)
    bp.deposit(last.targets, variables, res)
    for group in chain[1:]:
      self._observe(group.key.name, group.sources,
                    [seen.get(t.name) for t in group.sources])

  def _observe(self, name: str, ys: Sequence[tf.Tensor], g: List) -> None:
    self._done[name] = g
    rw = self.upstream.get(name)
    if rw is not None and rw.observe is not None:
      for y, gy in zip(ys, g):
        rw.observe(gy, y)

  # -- one method per kind of source group -----------------------------------

  def _run_op(self, group: Group, bp: Backprop) -> None:
    ys = group.sources
    res = bp.call(ys, bp.total(ys), group.targets, group.variables)
    bp.deposit(group.targets, group.variables, res)

  def _run_layer(self, group: Group, bp: Backprop) -> None:
    name, ys = group.key.name, group.sources
    g = bp.total(ys)
    if name in self.outputs_fn:
      g = self.outputs_fn[name](g, ys)
    self._done[name] = g
    own = [n for n in group.variables
           if self.net.layer_of_variable(self.variables[n]) == name]
    other = [n for n in group.variables if n not in own]
    store = bp.shares[name] if name in self.edge_uppers else None
    targets = self._live_inputs(group, bp)
    rw = self.upstream.get(name)
    replace = self.backward.get(name)
    if replace is not None:
      self._run_replaced(group, bp, g, own, other, store)
    elif rw is None or rw.factor is not None:
      factor = None if rw is None else rw.factor
      if rw is not None and rw.observe is not None:
        for y, gy in zip(ys, g):
          rw.observe(gy, y)
      if is_zero(factor):
        # Nothing is built below: the layer's parameters alone.
        bp.deposit([], own, bp.call(ys, g, [], own, stops=group.targets))
        bp.drop(targets, other)
        return
      res = bp.call(ys, g, targets, own + other, stops=group.targets)
      bp.deposit(targets, own + other, res, store=store, factor=factor,
                 plain=own)
    else:
      # The layer's own parameters see the plain upstream gradient; what
      # lies below sees the rewritten one.
      bp.deposit([], own, bp.call(ys, g, [], own, stops=group.targets))
      modified = [rw.fn(gy, y) for y, gy in zip(ys, g)]
      res = bp.call(ys, modified, targets, other, stops=group.targets)
      bp.deposit(targets, other, res, store=store)

  def _live_inputs(self, group: Group, bp: Backprop) -> List[tf.Tensor]:
    """The layer's targets, less direct shares that a zero edge removes."""
    name = group.key.name
    if name not in self.edge_uppers:
      return group.targets
    return self._not_zeroed(group.targets, name, bp)

  def _not_zeroed(self, targets, upper: str, bp: Backprop) -> List[tf.Tensor]:
    """``targets`` but those whose edge into ``upper`` is ``zero()``."""
    live = []
    for t in targets:
      rw = self._edge_of(t, upper)
      if rw is not None and is_zero(rw.factor):
        bp.drop([t])
      else:
        live.append(t)
    return live

  def _edge_of(self, t: tf.Tensor, upper: str) -> Optional[Rewrite]:
    lower = self.net.layer_of(t.op)
    return None if lower is None else self.edges.get((lower, upper))

  def _run_replaced(self, group: Group, bp: Backprop, g: List, own, other,
                    store) -> None:
    """A layer whose chain rule a backward replacement takes over."""
    name, ys, targets = group.key.name, group.sources, group.targets
    bp.deposit([], own, bp.call(ys, g, [], own, stops=targets))
    rw = self.upstream.get(name)
    # The replacement sees the rewritten gradient itself, in the documented
    # order (upstream rewrite first): a linear factor cannot be moved past
    # it.
    modified = [rw.fn(gy, y) for y, gy in zip(ys, g)] if rw else g
    res = self.backward[name](
        layer=name, outputs=ys, upstream=modified, inputs=targets,
        upstream_of=self._upstream_of,
        chain_rule=lambda: bp.call(ys, modified, targets, []))
    bp.deposit(targets, [], res, store=store)
    if other:
      bp.deposit([], other, bp.call(ys, modified, [], other, stops=targets))

  def _upstream_of(self, layer: str) -> List:
    return completed_upstream(self._done, layer)

  def _run_share(self, group: Group, bp: Backprop) -> None:
    """Hands an upper layer's direct share to each lower layer, rewritten."""
    name, store = group.key.name, bp.shares[group.key.name]
    for t in group.direct:
      bp.add(t, self._edge(t, name, aggregate(store.get(t.name, ()), like=t),
                           bp))
    live = self._not_zeroed(group.targets, name, bp)
    glue = group.glue
    res = bp.call(glue, bp.total(glue, store), live, group.variables,
                  stops=group.targets)
    for t, r in zip(live, res):
      bp.add(t, self._edge(t, name, r, bp))
    bp.deposit([], group.variables, res[len(live):])

  def _edge(self, t: tf.Tensor, upper: str, grad, bp: Backprop):
    rw = self._edge_of(t, upper)
    if rw is None or grad is None:
      return grad
    if rw.factor is None:
      return rw.fn(grad, t)
    if rw.observe is not None:
      rw.observe(grad, t)
    return bp.weigh(grad, rw.factor)
