"""Layer interception: what a plan tape does while the forward pass runs.

While the tape is open, the ``call`` of every layer the plan names is
replaced, on that layer instance only, by a wrapper; closing the tape
restores it. The wrapper

* counts the layer's calls, so that a layer that never ran is reported;
* for a layer whose one declaration is a linear upstream rewrite ``c * dy``
  and whose call reads only its own variables, runs the original ``call``
  on inputs whose gradient is weighted by ``c`` (see ``_linear``): the
  layer's own variables get the plain gradient, and nothing else is
  intercepted;
* for a layer whose backward pass the plan rewrites (an upstream transform,
  an incoming edge, a backward replacement, a task combination, an
  override, or the error layer a replacement reads), runs the original
  ``call`` inside ``tf.custom_gradient``, under an inner tape. The custom
  gradient receives ``dy``, the gradient at the layer's outputs already
  summed over all consumers, and hands it to
  :func:`~graphgrad.keras._backward.backward_of_call`.
  Bypass paths never pass through the custom op, so they stay unchanged;
* for the lower layer of an edge, starts a *glue tape* on the layer's
  outputs once it has run. Layers that hold variables pause glue tapes while
  they run, so a glue tape records only the variable-free ops (and
  variable-free layers) after the lower layer. The upper layer's custom
  gradient uses it to find the share of its input gradient that reaches the
  lower layer's outputs (see :func:`~graphgrad.keras._backward.edge_grads`).

Inside ``tf.function`` all of this happens once, while tracing.
"""

import collections
import contextlib
import logging
from typing import Dict, List, Optional

import tensorflow as tf

from graphgrad.keras import _linear, _methods
from graphgrad.keras._backward import backward_of_call, edge_grads, is_float
from graphgrad.keras._layer_tree import holds_variables
from graphgrad.methods._backward import completed_upstream
from graphgrad.transforms._context import TransformContext

log = logging.getLogger("graphgrad")


class Interceptor:
  """The per-tape state of one forward and backward pass under a plan."""

  def __init__(self, plan, labels=None):
    self.plan = plan
    self.labels = labels
    decl = plan.declarations
    self.edges = decl.edges
    # Layers whose backward pass needs more than an upstream transform.
    special = ({up for _, up in self.edges} | set(decl.backward)
               | set(decl.tasks) | set(plan.cut_layers)
               | {k for m, k in decl.overrides if m == "layer"})
    self.custom = set(decl.upstream) | special
    # Layers whose one declaration is a linear upstream rewrite: they may
    # run uninterrupted on inputs scaled in the backward pass (_linear).
    self.light = {p: fn.linear_factor for p, fn in decl.upstream.items()
                  if _linear.FUSE_LINEAR and fn.linear_factor is not None
                  and p not in special}
    self.calls: collections.Counter = collections.Counter()
    self.outputs: Dict[str, List[list]] = collections.defaultdict(list)
    self.plain = False  # True while task gradients are computed
    self.done: Dict[str, list] = {}  # gradients at rewritten layers' outputs
    self.task_deltas: Dict[str, List[list]] = {}
    self.extra: List[tuple] = []  # (grad, var) of the methods' variables
    self.edges_run: set = set()
    self.edges_fed: set = set()
    self._restore: List[tuple] = []
    self._glue: List[tf.GradientTape] = []
    self._lower_outputs: Dict[str, List[tuple]] = collections.defaultdict(list)
    self._pause_depth = 0
    self._paused: Optional[contextlib.ExitStack] = None
    self._no_pause: set = set()

  def targets(self) -> List[str]:
    """Every layer the plan names, and the layers its replacements read."""
    names = list(self.plan.declarations.layers) + list(self.plan.cut_layers)
    return list(dict.fromkeys(names))

  # -- patching ------------------------------------------------------------

  def patch(self) -> None:
    plan = self.plan
    paths = self.targets()
    if self.edges:
      # Every layer may have to pause glue tapes; ancestors of an edge's
      # ends must not, or the edge's own glue would be hidden.
      paths = list(dict.fromkeys(paths + list(plan.layer_names)))
      for lo, up in self.edges:
        for end in (lo, up):
          parts = end.split("/")
          self._no_pause |= {"/".join(parts[:k]) for k in range(1, len(parts))}
    for path in paths:
      layer = plan.layer(path)
      had = "call" in layer.__dict__
      self._restore.append((layer, had, layer.__dict__.get("call")))
      object.__setattr__(layer, "call", self._wrapper(path, layer, layer.call))
    log.debug("graphgrad KerasPlan tape: intercepting %d layers of %s",
              len(paths), plan.model.name)

  def unpatch(self) -> None:
    while self._restore:
      layer, had, call = self._restore.pop()
      if had:
        object.__setattr__(layer, "call", call)
      else:
        object.__delattr__(layer, "call")

  def close(self) -> None:
    self.unpatch()
    for glue in self._glue:
      glue.__exit__(None, None, None)

  def _wrapper(self, path: str, layer, call):
    custom = path in self.custom
    lower = any(lo == path for lo, _ in self.edges)

    def wrapped_call(*args, **kwargs):
      self.calls[path] += 1
      pause = (bool(self.edges) and path not in self._no_pause
               and holds_variables(layer))
      with self._pausing(pause):
        if path in self.light and _linear.reads_only_own(
            layer, call, args, kwargs, self.plan.own_variables(path)):
          out = self._scaled_call(path, call, args, kwargs)
        elif custom:
          out = self._custom_call(path, call, args, kwargs)
        else:
          out = call(*args, **kwargs)
      if lower:
        self._start_glue(path, out)
      return out

    return wrapped_call

  @contextlib.contextmanager
  def _pausing(self, pause: bool):
    if not pause:
      yield
      return
    if self._pause_depth == 0:
      self._paused = contextlib.ExitStack()
      for glue in self._glue:
        self._paused.enter_context(glue.stop_recording())
    self._pause_depth += 1
    try:
      yield
    finally:
      self._pause_depth -= 1
      if self._pause_depth == 0:
        paused, self._paused = self._paused, None
        if paused is not None:
          paused.close()

  def _start_glue(self, path: str, out) -> None:
    outs = [t for t in tf.nest.flatten(out) if is_float(t)]
    glue = tf.GradientTape(persistent=True, watch_accessed_variables=False)
    glue.__enter__()
    glue.watch(outs)
    if self._paused is not None:
      self._paused.enter_context(glue.stop_recording())
    self._glue.append(glue)
    self._lower_outputs[path].append((outs, glue))

  def _scaled_call(self, path: str, call, args, kwargs):
    """The layer as it is, on inputs whose gradient the factor weights."""
    factor = self.light[path]
    flat = [_linear.scaled_input(a, factor, lambda: self.plain)
            if is_float(a) else a for a in tf.nest.flatten((args, kwargs))]
    args_in, kwargs_in = tf.nest.pack_sequence_as((args, kwargs), flat)
    out = call(*args_in, **kwargs_in)
    self.outputs[path].append(tf.nest.flatten(out))
    return out

  def _custom_call(self, path: str, call, args, kwargs):
    flat = tf.nest.flatten((args, kwargs))
    idx = [i for i, a in enumerate(flat) if is_float(a)]
    xs = [flat[i] for i in idx]
    entries = [(lo, up, fn, outs, glue)
               for (lo, up), fn in self.edges.items() if up == path
               for outs, glue in self._lower_outputs.get(lo, ())]
    extra = [t for *_, outs, _ in entries for t in outs]
    n = len(xs)
    index = len(self.outputs[path])

    @tf.custom_gradient
    def layer_op(*inputs):
      xs_in = list(inputs[:n])
      flat_in = list(flat)
      for i, t in zip(idx, xs_in):
        flat_in[i] = t
      args_in, kwargs_in = tf.nest.pack_sequence_as((args, kwargs), flat_in)
      with tf.GradientTape(persistent=True) as inner:
        inner.watch(xs_in)
        out = call(*args_in, **kwargs_in)

      def grad(*dys, variables=None):
        with tf.name_scope(self.plan.name):
          dx, dv = backward_of_call(self, path, index, inner, out, xs_in,
                                    list(dys), list(variables or []))
          if not self.plain:
            self.edges_run.update(k for k in self.edges if k[1] == path)
          return dx + edge_grads(self, entries, xs, dx), dv

      return out, grad

    out = layer_op(*(xs + extra))
    self.outputs[path].append(tf.nest.flatten(out))
    return out

  # -- what backward_of_call asks for --------------------------------------

  def context(self, layer, role, **kw) -> TransformContext:
    t = kw.get("tensor")
    if t is not None and not tf.is_symbolic_tensor(t):
      kw["tensor"] = None  # eager tensors have no name to derive seeds from
    return TransformContext(layer=layer, role=role,
                            global_step=self.plan.step_tensor(),
                            resources=self.plan.resources, **kw)

  def combine_tasks(self, path: str, call: int, dys: list) -> list:
    """``dy - sum_i g_i + combine(g_i)`` at the outputs of a task layer."""
    deltas = self.task_deltas.get(path)
    if deltas is None:
      return dys
    return [dy if d is None else (d if dy is None else
                                  tf.convert_to_tensor(dy) + d)
            for dy, d in zip(dys, deltas[call])]

  def upstream_of(self, path: str) -> list:
    """The complete gradient at a rewritten layer's outputs above this one."""
    return completed_upstream(self.done, path)

  def replace(self, path, fn, xs, outs, upstream, chain_rule) -> list:
    plan = self.plan
    ctx = _methods.KerasBackwardContext(
        layer=plan.layer(path), name=path, inputs=tuple(xs),
        outputs=tuple(outs), upstream=tuple(upstream),
        upstream_of=self.upstream_of, chain_rule=chain_rule,
        variables=plan.method_variables, labels=self.labels)
    with tf.name_scope(f"replace_backward_{path}".replace("/", "_")):
      grads, extra = _methods.run(fn, ctx, plan.error_layer(path))
    self.extra += extra
    return grads
