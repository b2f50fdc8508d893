"""PlanTape: a ``tf.GradientTape`` that applies a KerasPlan while it records.

While the tape is open, the ``call`` of every layer the plan names is
replaced, on that layer instance only, by a wrapper; closing the tape
restores it. The wrapper

* counts the layer's calls, so that a layer that never ran is reported;
* for a layer with an upstream transform or an incoming edge transform, runs
  the original ``call`` inside ``tf.custom_gradient``, under an inner tape.
  The custom gradient receives ``dy``, the gradient at the layer's outputs
  already summed over all consumers. It backpropagates ``dy`` through the
  layer to the layer's own variables and the transformed ``fn(dy)`` to its
  inputs (and to variables of other layers it reads). Bypass paths never
  pass through the custom op, so they stay unchanged;
* for the lower layer of an edge, starts a *glue tape* on the layer's
  outputs once it has run. Layers that hold variables pause glue tapes while
  they run, so a glue tape records only the variable-free ops (and
  variable-free layers) after the lower layer. The upper layer's custom
  gradient uses it to find the share of its input gradient that reaches the
  lower layer's outputs, rewrites that share with the edge transform, and
  hands the difference to the lower layer's outputs as extra inputs of the
  custom op.

Inside ``tf.function`` all of this happens once, while tracing.
"""

import collections
import contextlib
import logging
from typing import Any, Dict, List, Optional

import tensorflow as tf

from graphgrad import _errors
from graphgrad.keras import _linear
from graphgrad.transforms._checks import checked as _checked
from graphgrad.transforms._transforms import TransformContext, is_identity

log = logging.getLogger("graphgrad")


def children(layer) -> List[Any]:
  """The direct sublayers of a Keras 3 or tf-keras layer."""
  return list(layer._flatten_layers(include_self=False, recursive=False))  # pylint: disable=protected-access


def tf_variable(v) -> Optional[tf.Variable]:
  """The ``tf.Variable`` behind a tf-keras or Keras 3 variable."""
  if isinstance(v, tf.Variable):
    return v
  for attr in ("value", "_value"):  # Keras 3 wraps a tf.Variable
    inner = getattr(v, attr, None)
    if isinstance(inner, tf.Variable):
      return inner
  return None


def layer_variables(layer) -> List[tf.Variable]:
  """A layer's variables, nested layers' included, as ``tf.Variable``."""
  return [u for u in map(tf_variable, layer.weights) if u is not None]


def _is_float(t) -> bool:
  return tf.is_tensor(t) and (t.dtype.is_floating or t.dtype.is_complex)


def _dense(g):
  return tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g


def _add(parts):
  parts = [_dense(p) for p in parts if p is not None]
  if not parts:
    return None
  return parts[0] if len(parts) == 1 else tf.add_n(parts)


class PlanTape:
  """A ``tf.GradientTape`` that applies a :class:`KerasPlan`.

  Made by :meth:`KerasPlan.tape`; use it as a context manager around the
  forward pass, then call :meth:`gradient`.
  """

  def __init__(self, plan, persistent: bool, watch_accessed_variables: bool):
    self._plan = plan
    self._tape = tf.GradientTape(
        persistent=persistent,
        watch_accessed_variables=watch_accessed_variables)
    self._upstream = plan._upstream_fns()  # pylint: disable=protected-access
    self._edges = plan._edge_fns()  # pylint: disable=protected-access
    self._calls: collections.Counter = collections.Counter()
    self._restore: List[tuple] = []
    self._glue: List[tf.GradientTape] = []
    self._lower_outputs: Dict[str, List[tuple]] = collections.defaultdict(list)
    self._pause_depth = 0
    self._paused: Optional[contextlib.ExitStack] = None
    self._entered = False
    # Edges whose upper layer's backward ran, and those that found a share.
    self._edges_run: set = set()
    self._edges_fed: set = set()

  # -- GradientTape surface ------------------------------------------------

  def __enter__(self) -> "PlanTape":
    if self._entered:
      raise _errors.GraphGradError(
          "this plan tape was already used; open a new one with plan.tape() "
          "for each forward pass.")
    self._entered = True
    self._tape.__enter__()
    try:
      self._patch_layers()
    except BaseException:
      self._unpatch()
      self._tape.__exit__(None, None, None)
      raise
    return self

  def __exit__(self, *exc):
    self._unpatch()
    for glue in self._glue:
      glue.__exit__(None, None, None)
    return self._tape.__exit__(*exc)

  def watch(self, tensor) -> None:
    """Ensures ``tensor`` is traced by the tape, as ``GradientTape.watch``."""
    self._tape.watch(tensor)

  def stop_recording(self):
    """As ``GradientTape.stop_recording``."""
    return self._tape.stop_recording()

  def gradient(self, target, sources=None, output_gradients=None,
               unconnected_gradients=tf.UnconnectedGradients.NONE):
    """Gradients of ``target`` with the plan applied.

    Args:
      target: the loss (a tensor, or a structure of tensors).
      sources: variables or tensors; defaults to the model's
        ``trainable_variables``, so that the result zips with them.
      output_gradients: as for ``GradientTape.gradient``.
      unconnected_gradients: as for ``GradientTape.gradient``.

    Returns:
      Gradients in the structure of ``sources`` (a list for the default).

    Raises:
      GraphGradError: if a layer named by the plan never ran under this
        tape.
      IncompatibleGradientError: if a transform changes a shape or dtype.
    """
    self._check_ran()
    plan = self._plan
    if sources is None:
      sources = list(plan.model.trainable_variables)
    grads = self._tape.gradient(target, sources, output_gradients,
                                unconnected_gradients)
    self._check_edges()
    todo = [(p, fn) for p, fn in plan._gradients  # pylint: disable=protected-access
            if not is_identity(fn)]
    if not todo:
      return grads
    flat_s = tf.nest.flatten(sources)
    flat_g = tf.nest.flatten(grads)
    refs = [v.ref() if v is not None else None
            for v in map(tf_variable, flat_s)]
    with tf.name_scope(plan._name):  # pylint: disable=protected-access
      for path, fn in todo:
        own = plan._own_refs(path)  # pylint: disable=protected-access
        for i, ref in enumerate(refs):
          if ref in own and flat_g[i] is not None:
            var = tf_variable(flat_s[i])
            flat_g[i] = _checked(
                fn, flat_g[i], self._context(path, "gradients", variable=var),
                f"transform_gradients({path!r}) on {var.name}")
    return tf.nest.pack_sequence_as(grads, flat_g)

  # -- interception --------------------------------------------------------

  def _targets(self) -> List[str]:
    plan = self._plan
    names = list(plan._upstream)  # pylint: disable=protected-access
    names += [n for n, _ in plan._gradients]  # pylint: disable=protected-access
    names += [n for key in plan._edges for n in key]  # pylint: disable=protected-access
    return list(dict.fromkeys(names))

  def _patch_layers(self) -> None:
    plan = self._plan
    paths = self._targets()
    self._no_pause = set()
    if self._edges:
      # Every layer may have to pause glue tapes; ancestors of an edge's
      # ends must not, or the edge's own glue would be hidden.
      paths = list(dict.fromkeys(paths + list(plan._all_layers())))  # pylint: disable=protected-access
      for lo, up in self._edges:
        for end in (lo, up):
          parts = end.split("/")
          self._no_pause |= {"/".join(parts[:k]) for k in range(1, len(parts))}
    for path in paths:
      layer = plan._layer(path)  # pylint: disable=protected-access
      had = "call" in layer.__dict__
      self._restore.append((layer, had, layer.__dict__.get("call")))
      object.__setattr__(layer, "call", self._wrapper(path, layer, layer.call))
    log.debug("graphgrad KerasPlan tape: intercepting %d layers of %s",
              len(paths), plan.model.name)

  def _unpatch(self) -> None:
    while self._restore:
      layer, had, call = self._restore.pop()
      if had:
        object.__setattr__(layer, "call", call)
      else:
        object.__delattr__(layer, "call")

  def _wrapper(self, path: str, layer, call):
    custom = path in self._upstream or any(
        up == path for _, up in self._edges)
    lower = any(lo == path for lo, _ in self._edges)

    def wrapped_call(*args, **kwargs):
      self._calls[path] += 1
      pause = (bool(self._edges) and path not in self._no_pause
               and _holds_variables(layer))
      with self._pausing(pause):
        if custom:
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
        self._paused.close()
        self._paused = None

  def _start_glue(self, path: str, out) -> None:
    outs = [t for t in tf.nest.flatten(out) if _is_float(t)]
    glue = tf.GradientTape(persistent=True, watch_accessed_variables=False)
    glue.__enter__()
    glue.watch(outs)
    if self._paused is not None:
      self._paused.enter_context(glue.stop_recording())
    self._glue.append(glue)
    self._lower_outputs[path].append((outs, glue))

  def _custom_call(self, path: str, call, args, kwargs):
    flat = tf.nest.flatten((args, kwargs))
    idx = [i for i, a in enumerate(flat) if _is_float(a)]
    xs = [flat[i] for i in idx]
    entries = [(lo, up, fn, outs, glue)
               for (lo, up), fn in self._edges.items() if up == path
               for outs, glue in self._lower_outputs.get(lo, ())]
    extra = [t for *_, outs, _ in entries for t in outs]
    n = len(xs)

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
        with tf.name_scope(self._plan._name):  # pylint: disable=protected-access
          dx, dv = self._backward(path, inner, out, xs_in, dys,
                                  list(variables or []))
          self._edges_run.update(k for k in self._edges if k[1] == path)
          return dx + self._edge_grads(entries, xs, dx), dv

      return out, grad

    return layer_op(*(xs + extra))

  # -- backward ------------------------------------------------------------

  def _backward(self, path, inner, out, xs, dys, variables):
    """Input and variable gradients of one call of a rewritten layer."""
    pairs = [(o, dy) for o, dy in zip(tf.nest.flatten(out), dys)
             if _is_float(o) and dy is not None]
    outs = [o for o, _ in pairs]
    dys = [dy for _, dy in pairs]
    n = len(xs)
    fn = self._upstream.get(path)
    if fn is None or not outs:
      g = (inner.gradient(outs, xs + variables, output_gradients=dys)
           if outs else [None] * (n + len(variables)))
      return list(g[:n]), list(g[n:])
    tdys = [_checked(fn, dy, self._context(path, "upstream", tensor=o),
                     f"transform_upstream({path!r}) on {_describe(o)}")
            for o, dy in zip(outs, dys)]
    own_refs = self._plan._own_refs(path)  # pylint: disable=protected-access
    own = [i for i, v in enumerate(variables) if v.ref() in own_refs]
    other = [i for i in range(len(variables)) if i not in set(own)]
    if _linear.FUSE_LINEAR and fn.linear_factor is not None:
      return _linear.backward(inner, outs, dys, xs, variables, set(own),
                              fn.linear_factor)
    dv = [None] * len(variables)
    if own:
      for i, g in zip(own, inner.gradient(
          outs, [variables[i] for i in own], output_gradients=dys)):
        dv[i] = g
    below = inner.gradient(outs, xs + [variables[i] for i in other],
                           output_gradients=tdys)
    for i, g in zip(other, below[n:]):
      dv[i] = g
    return list(below[:n]), dv

  def _edge_grads(self, entries, xs, dx) -> List:
    """Gradients for the lower layers' outputs, the extra inputs of an edge.

    ``dx`` is rewritten in place: an input that *is* a lower layer's output
    passes its whole gradient through the extra input instead.
    """
    extra, direct_inputs = [], set()
    for lo, upper, fn, outs, glue in entries:
      direct = collections.defaultdict(list)
      glued = []
      for i, x in enumerate(xs):
        js = [j for j, t in enumerate(outs) if t is x]
        if js:
          direct[js[0]].append(i)
        elif dx[i] is not None:
          glued.append(i)
      shares = (glue.gradient([xs[i] for i in glued], outs,
                              output_gradients=[_dense(dx[i]) for i in glued])
                if glued else [None] * len(outs))
      for j, t in enumerate(outs):
        via_glue = shares[j]
        total = _add([dx[i] for i in direct[j]] + [via_glue])
        if total is None:
          extra.append(None)
          continue
        new = _checked(fn, total,
                       self._context(lo, "edge", tensor=t, edge=(lo, upper)),
                       f"transform_edge({lo!r}, {upper!r}) on {_describe(t)}")
        extra.append(new if via_glue is None else _dense(new) - via_glue)
        direct_inputs.update(direct[j])
        self._edges_fed.add((lo, upper))
    for i in direct_inputs:
      dx[i] = None
    return extra

  # -- helpers -------------------------------------------------------------

  def _check_ran(self) -> None:
    never = [p for p in self._targets() if not self._calls[p]]
    if never:
      raise _errors.NotConnectedError(
          f"layer(s) {', '.join(map(repr, never))} never ran in the forward "
          f"pass under this tape, so the plan has nothing to rewrite there. "
          f"Call the model inside `with plan.tape() as tape:` (the forward "
          f"pass must run under the tape), or drop the transforms on layers "
          f"this model's call does not use.")

  def _check_edges(self) -> None:
    for lo, up in sorted(self._edges_run - self._edges_fed):
      raise _errors.NotConnectedError(
          f"transform_edge({lo!r}, {up!r}): {up!r} ran, but no gradient "
          f"from it reached {lo!r}'s outputs through ops and layers without "
          f"variables, so the edge carries nothing. Name a `lower` whose "
          f"output feeds `upper` directly (activations, additions, "
          f"concatenations in between are fine), or use "
          f"transform_upstream on the layer in between.")

  def _context(self, layer, role, **kw) -> TransformContext:
    t = kw.get("tensor")
    if t is not None and not tf.is_symbolic_tensor(t):
      kw["tensor"] = None  # eager tensors have no name to derive seeds from
    plan = self._plan
    return TransformContext(layer=layer, role=role,
                            global_step=plan.global_step,
                            state=plan._state, **kw)  # pylint: disable=protected-access


def _holds_variables(layer) -> bool:
  """True when ``layer`` holds variables directly, not only in sublayers."""
  own = {v.ref() for v in layer_variables(layer)}
  for child in children(layer):
    own -= {v.ref() for v in layer_variables(child)}
  return bool(own)


def _describe(t) -> str:
  return t.name if tf.is_symbolic_tensor(t) else f"an output of shape {t.shape}"
