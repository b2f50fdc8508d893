"""PlanTape: a ``tf.GradientTape`` that executes a KerasPlan's declarations.

The tape reads the plan only through the :class:`PlanView` the plan hands
it (declarations, model, layers, their variables). While it records, an
:class:`~graphgrad.keras._intercept.Interceptor` rewrites the named layers'
backward passes; :meth:`PlanTape.gradient` then runs the backward pass,
applies the task combinations (``core._task_combination``, with the task
losses of ``tape.gradient(task_losses=...)``) and the parameter transforms
(``core._layer_step``; under ``tf.distribute`` a non-linear one sees the sum
over the replicas), and collects the gradients of the variables the plan's
training methods own.
"""

import dataclasses
import functools
import logging
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

from graphgrad import _errors
from graphgrad.core._gradients import add_dense, dense
from graphgrad.core._layer_step import TraceRecord
from graphgrad.core._privacy import check_per_example_loss, private_gradients
from graphgrad.core._rules import ParameterRule, PlanRules
from graphgrad.core._task_combination import call_deltas, combined_parameters
from graphgrad.keras import _loss_scale, _privatize_tape, _tape_checks
from graphgrad.keras._intercept import BackwardStep, Interceptor
from graphgrad.keras._layer_index import tf_variable
from graphgrad.keras._tape_vjp import TapeVJP
from graphgrad.transforms._transforms import is_identity

log = logging.getLogger("graphgrad")

# The key of the parameter-level task losses in a ``task_losses`` dict.
PARAMETERS = "parameters"


def losses_by_layer(rules: PlanRules, task_losses):
  """``layer -> [task loss]`` for every task declaration, or raises.

  With a combination in parameter space declared, its losses are under the
  key :data:`PARAMETERS`.
  """
  parameters = rules.parameter_tasks is not None
  tasks = list(rules.tasks) + ([PARAMETERS] if parameters else [])
  if not tasks:
    if task_losses is not None:
      raise _errors.GraphGradError(
          "tape.gradient: `task_losses` was given, but the plan declares no "
          "task combination. Declare plan.project_conflicts(layer) or "
          "plan.combine_tasks(layer, method) first, or drop task_losses.")
    return {}
  if task_losses is None:
    raise _errors.GraphGradError(
        f"tape.gradient: the plan combines task gradients at "
        f"{', '.join(map(repr, sorted(tasks)))}, whose task losses only exist "
        f"in the training step. Pass them: tape.gradient(loss, "
        f"task_losses=[loss_a, loss_b]) (or a dict layer -> losses).")
  out = {}
  for layer in tasks:
    losses = (task_losses.get(layer) if isinstance(task_losses, dict)
              else task_losses)
    if (losses is None or tf.is_tensor(losses)
        or not isinstance(losses, (list, tuple)) or len(losses) < 2):
      what = (f"layer {layer!r}" if layer != PARAMETERS or not parameters
              else f"the combination at='parameters' (dict key "
                   f"{PARAMETERS!r})")
      raise _errors.GraphGradError(
          f"tape.gradient: `task_losses` must be a list of at least two "
          f"scalar task losses for {what}; got {losses!r}. Pass "
          f"e.g. task_losses=[loss_a, loss_b].")
    out[layer] = list(losses)
  return out


# Strategies whose replicas do not all-reduce gradients in replica context
# (ParameterServerStrategy applies each worker's own, TPUStrategy is
# untested): (name, classes, why a plan refuses it).
_REFUSED: Tuple[Tuple[str, Tuple[type, ...], str], ...] = (
    ("ParameterServerStrategy", (
        tf.distribute.experimental.ParameterServerStrategy,
        tf.compat.v1.distribute.experimental.ParameterServerStrategy), (
            "its workers apply their own gradients to the variables on the "
            "parameter servers, each on its own, and never all-reduce them, "
            "so a parameter transform could not see the global gradient")),
    ("TPUStrategy", (
        tf.distribute.TPUStrategy, tf.distribute.experimental.TPUStrategy,
        tf.compat.v1.distribute.experimental.TPUStrategy), (
            "a plan's layer interception and all-reduce are not tested under "
            "TPU replication, and graphgrad refuses to risk a wrong "
            "gradient")),
)


def check_strategy(strategy) -> None:
  """Refuses a strategy a plan does not support (see ``_REFUSED``).

  Args:
    strategy: a ``tf.distribute.Strategy``, e.g. the current one.

  Raises:
    GraphGradError: for ``ParameterServerStrategy`` and ``TPUStrategy``,
      saying why and what to use instead.
  """
  for name, classes, why in _REFUSED:
    if isinstance(strategy, classes):
      raise _errors.GraphGradError(
          f"KerasPlan does not support {name} (got "
          f"{type(strategy).__name__}): {why}. Train the plan under "
          f"tf.distribute.MirroredStrategy or MultiWorkerMirroredStrategy, "
          f"where parameter transforms act on the all-reduced gradient, or "
          f"with tf.compat.v1 between-graph replication and a GradientPlan "
          f"(docs/distributed.md).")


def replicas_in_sync() -> int:
  """How many replicas the current step's gradients are summed over.

  1 outside ``strategy.run`` (the default strategy, or cross-replica
  context), else ``num_replicas_in_sync``.

  Raises:
    GraphGradError: under a strategy :func:`check_strategy` refuses.
  """
  check_strategy(tf.distribute.get_strategy())
  ctx = tf.distribute.get_replica_context()
  return 1 if ctx is None else int(ctx.num_replicas_in_sync)


def needs_sum(fns: Sequence) -> bool:
  """Whether transforms ``fns`` must see the sum over replicas.

  A linear transform ``c * g`` gives the same sum whether it acts on each
  replica's gradient or on their sum, so it acts per replica.
  """
  return any(fn.linear_factor is None for fn in fns)



@dataclasses.dataclass(frozen=True)
class PlanView:
  """What the TF2 executor reads of a KerasPlan.

  Attributes:
    rules: the plan, compiled (``graphgrad.core._rules``).
    model: the Keras model.
    name: the name scope of the ops the plan adds.
    resources: the plan's store of what its transforms create.
    method_variables: the variables of the plan's training methods.
    layers: the model's layers, as a replacement sees them (``net``).
    layer_names: paths of every layer in the model.
    layer: path -> the Keras layer.
    own_variables: path -> the layer's variables, nested layers' included.
    step_tensor: () -> the global step as a tensor, or ``None``.
    enter_tape: marks a tape open; raises while another one is.
    exit_tape: marks a tape closed.
    noise_counter: the ``NoiseCounter`` of ``plan.privatize`` (the noise is
      ``rules.privacy.noise``), or ``None``.
  """
  rules: PlanRules
  model: Any
  name: str
  resources: Any
  method_variables: Any
  layers: Any
  layer_names: Tuple[str, ...]
  layer: Callable[[str], Any]
  own_variables: Callable[[str], List[tf.Variable]]
  step_tensor: Callable[[], Any]
  enter_tape: Callable[[Any], None]
  exit_tape: Callable[[Any], None]
  noise_counter: Any = None


class PlanTape:
  """A ``tf.GradientTape`` that applies a :class:`KerasPlan`.

  Made by :meth:`KerasPlan.tape`; use it as a context manager around the
  forward pass, then call :meth:`gradient` (or :meth:`grads_and_vars`).
  """

  def __init__(self, plan: PlanView, persistent: bool,
               watch_accessed_variables: bool, labels=None,
               batch_size: Optional[float] = None):
    self._plan = plan
    self._batch_size = batch_size
    self._run = Interceptor(plan, labels)
    rules = plan.rules
    self._private = (None if rules.privacy is None else
                     _privatize_tape.Recorder(plan.model))
    # Task gradients and privatize take extra backward passes over the same
    # recording.
    self._persistent = persistent
    self._tape: Any = tf.GradientTape(
        persistent=(persistent or rules.has_tasks
                    or self._private is not None),
        watch_accessed_variables=watch_accessed_variables)
    self._vjp: Any = TapeVJP.outer(self._tape)
    self._entered = self._inside = False
    self._last = self._run.step()

  # -- GradientTape surface ------------------------------------------------

  def __enter__(self) -> "PlanTape":
    if self._entered:
      raise _errors.GraphGradError(
          "this plan tape was already used; open a new one with plan.tape() "
          "for each forward pass.")
    self._plan.enter_tape(self)  # raises while another tape is open
    self._entered = self._inside = True
    self._tape.__enter__()
    try:
      self._run.patch()
      if self._private is not None:
        self._private.patch()
    except BaseException:
      if self._private is not None:
        self._private.unpatch()
      self._run.close()
      self._tape.__exit__(None, None, None)
      self._plan.exit_tape(self)
      raise
    return self

  def __exit__(self, *exc):
    self._inside = False
    self._plan.exit_tape(self)
    if self._private is not None:
      self._private.unpatch()
    self._run.close()
    try:
      return self._tape.__exit__(*exc)
    finally:
      if self._last.finished:  # the gradient was taken inside the block
        self._release()

  @property
  def kept(self):
    """Under ``plan.recompute``, the tensors this step keeps, in forward
    order; else ``None``."""
    return self._run.kept

  @property
  def trace(self) -> Tuple[TraceRecord, ...]:
    """``(context, before, after)`` of every transform the last
    :meth:`gradient` applied, as ``GradientPlan.trace``; empty before."""
    return tuple(self._last.trace)

  @property
  def last_step(self) -> BackwardStep:
    """The last :meth:`gradient`'s step: its trace and final pairs."""
    return self._last

  def watch(self, tensor) -> None:
    """Ensures ``tensor`` is traced by the tape, as ``GradientTape.watch``."""
    self._tape.watch(tensor)

  def stop_recording(self):
    """As ``GradientTape.stop_recording``."""
    return self._tape.stop_recording()

  def gradient(self, target, sources=None, output_gradients=None,
               unconnected_gradients=tf.UnconnectedGradients.NONE,
               task_losses=None):
    """Gradients of ``target`` with the plan applied.

    Args:
      target: the loss (a tensor, or a structure of tensors).
      sources: variables or tensors; defaults to the model's
        ``trainable_variables``, so that the result zips with them.
      output_gradients: as for ``GradientTape.gradient``.
      unconnected_gradients: as for ``GradientTape.gradient``.
      task_losses: for a plan with ``project_conflicts`` or
        ``combine_tasks``: the task losses of this step, a list (for every
        such layer) or a dict ``layer -> list``. The loss must be their
        (weighted) sum, plus terms that pass unprojected.

    Returns:
      Gradients in the structure of ``sources`` (a list for the default).
      The gradients of the training methods' own variables (synthetic
      gradient modules) are in :attr:`extra_grads_and_vars` afterwards, and
      in the result for those among ``sources`` (as in
      ``plan.trainable_variables`` after the first step, which makes them).
      Inside ``strategy.run`` (``MirroredStrategy``,
      ``MultiWorkerMirroredStrategy``) they are this replica's contribution:
      their sum over replicas, which the optimizer's ``apply_gradients``
      takes, is the plan's gradient for the global batch, with parameter
      transforms applied to the summed gradient (docs/distributed-keras.md).

    Raises:
      GraphGradError: if a layer named by the plan never ran under this
        tape, ``task_losses`` does not match the task declarations, or the
        strategy is a ``ParameterServerStrategy`` or ``TPUStrategy``.
      IncompatibleGradientError: if a transform changes a shape or dtype.
    """
    grads = self._planned(target, sources, output_gradients,
                          unconnected_gradients, task_losses)
    self._release()
    return grads

  def _release(self) -> None:
    """Lets go of the recording once its one gradient is taken, unless the
    tape was opened ``persistent``: a tape the plan made persistent for
    itself (tasks, privatize) and the edges' glue tapes hold the forward
    pass's activations, which the plan keeps (``plan.trace``) past the
    step."""
    if not self._persistent and not self._inside:
      self._tape = self._vjp = self._private = None
      self._run.release()

  def _loss_scale(self):
    """The loss scale ``S`` of this step, or ``None``. With a loss scale
    (``plan.tape(loss_scale=...)``, compiled into the plan's rules) the
    target is the scaled loss (``optimizer.scale_loss(loss)`` in Keras 3,
    ``optimizer.get_scaled_loss(loss)`` in tf-keras) and each transform
    sees ``g / S``, the scale read when the gradients are computed."""
    scale = self._plan.rules.loss_scale
    return None if scale is None else _loss_scale.scale_of(scale.scale)

  def _planned(self, target, sources, output_gradients, unconnected_gradients,
               task_losses):
    if self._tape is None or (self._last.finished and not self._persistent):
      raise _errors.GraphGradError(
          "this plan tape's gradient was already taken, and its recording "
          "let go. A tape gives one gradient, as a tf.GradientTape does; "
          "open it with plan.tape(persistent=True) to take several.")
    self._check_ran()
    plan = self._plan
    if sources is None:
      sources = list(plan.model.trainable_variables)
    by_layer = losses_by_layer(plan.rules, task_losses)
    step = self._run.step(task_deltas=self._task_deltas(target, by_layer),
                          scale=self._loss_scale())
    with self._run.backward(step):
      if self._private is None:
        grads = self._vjp.backprop(target, sources, output_gradients,
                                   unconnected_gradients)
      else:  # DP-SGD's gradients (core._privacy)
        check_per_example_loss(target, "KerasPlan.privatize")
        if tf.executing_eagerly():  # traced, the whole loss is checked
          self._private.refuse_mixing()
        flat_s = tf.nest.flatten(sources)
        # The target is the scaled loss under a loss scale: S times
        # DP-SGD's gradient, for the optimizer to unscale.
        privacy = plan.rules.privacy
        assert privacy is not None  # a recorder is made for a private plan
        flat_g = private_gradients(self._vjp, target, flat_s, self._private,
                                   privacy.noise, self._plan.noise_counter,
                                   scale=step.scale,
                                   batch_size=self._batch_size)
        if unconnected_gradients == tf.UnconnectedGradients.ZERO:
          flat_g = [tf.zeros_like(tf.convert_to_tensor(s)) if g is None
                    else g for g, s in zip(flat_g, flat_s)]
        grads = tf.nest.pack_sequence_as(sources, flat_g)
    self._last = step
    self._check_edges(step)
    _tape_checks.warn_without_gradient(
        plan, target, tf.nest.flatten(sources), tf.nest.flatten(grads))
    # Each layer's own transforms, then those of several layers at once.
    todo = [r for r in plan.rules.parameters
            if not is_identity(r.transform)]
    params = plan.rules.parameter_tasks
    flat_s = tf.nest.flatten(sources)
    if not todo and not step.extra and params is None:
      flat_g = tf.nest.flatten(grads)
      step.finish(flat_s, flat_g, flat_g)
      return grads
    flat_g = tf.nest.flatten(grads)
    if params is not None:
      flat_g = self._parameter_tasks(params, target, by_layer[PARAMETERS],
                                     flat_s, flat_g)
    self._methods_grads(step, flat_s, flat_g)
    raw = list(flat_g)
    flat_g = self._transform_parameters(step, flat_s, flat_g, todo)
    step.finish(flat_s, raw, flat_g)
    return tf.nest.pack_sequence_as(grads, flat_g)

  def grads_and_vars(self, target, task_losses=None) -> List[Tuple[Any, Any]]:
    """``(gradient, variable)`` pairs of the model and the plan's methods.

    The model's trainable variables with their planned gradients, then the
    training methods' own variables (synthetic-gradient modules) with theirs,
    ready for ``optimizer.apply_gradients``: the analogue of
    ``GradientPlan.compute_gradients()``. The modules' variables are made on
    the first step, so a Keras 3 optimizer must build on its first
    ``apply_gradients`` (its default), not before with the model's
    variables only.

    Args:
      target: the loss.
      task_losses: as for :meth:`gradient`.

    Returns:
      A list of ``(gradient, variable)`` pairs.
    """
    variables = list(self._plan.model.trainable_variables)
    grads = self._planned(target, variables, None,
                          tf.UnconnectedGradients.NONE, task_losses)
    self._release()
    return list(zip(grads, variables)) + self.extra_grads_and_vars

  @property
  def extra_grads_and_vars(self) -> List[Tuple[Any, tf.Variable]]:
    """``(grad, var)`` of the methods' variables from the last gradient."""
    return list(self._last.extra)

  # -- helpers -------------------------------------------------------------

  def _methods_grads(self, step: BackwardStep, flat_s, flat_g) -> None:
    """Puts the gradients of the methods' own variables among ``sources``.

    The forward pass never reads a synthetic module's variables, so the
    recording tape has no gradient for them: their gradients come from the
    replacement, in the backward pass.
    """
    by_ref: Dict[Any, list] = {}
    for g, v in step.extra:
      by_ref.setdefault(v.ref(), []).append(g)
    for i, s in enumerate(flat_s):
      v = tf_variable(s)
      if v is not None and v.ref() in by_ref:
        flat_g[i] = add_dense(by_ref[v.ref()])

  # Python over the plan's rules, nothing to convert; AutoGraph cannot
  # convert the closures over ``refs`` and would warn at every trace.
  @tf.autograph.experimental.do_not_convert
  def _transform_parameters(self, step: BackwardStep, flat_s, flat_g,
                            todo: List[ParameterRule]) -> list:
    """``flat_g`` after the parameter transforms ``todo``
    (``core._layer_step``), replica-aware.

    Inside ``strategy.run`` each replica backpropagates its own examples,
    and the gradients a plan tape returns are that replica's
    *contribution*: summed over the replicas, as every Keras optimizer does
    in ``apply_gradients``, they give the plan's gradients for the global
    batch. For a variable whose parameter transform is not linear (a clip,
    a group transform, noise), the variable's gradient is first summed over
    the replicas (``ReplicaContext.all_reduce``), the sum is transformed,
    and the first replica contributes the result while the others
    contribute zeros: the optimizer's own sum then gives exactly the
    transformed global gradient, for any number of replicas, and random
    transforms are drawn once. Every other gradient passes unreduced, for
    the optimizer to sum as usual.

    Raises:
      GraphGradError: under a strategy :func:`check_strategy` refuses.
    """
    count = replicas_in_sync()
    if not todo:
      return flat_g
    refs: Dict[str, set] = {}

    def own(path: str) -> set:
      """The refs of the variables of the layer ``path``, nested layers'
      included."""
      if path not in refs:
        refs[path] = {v.ref() for v in self._plan.own_variables(path)}
      return refs[path]

    def layer_among(v, layers):
      return next((path for path in layers if v.ref() in own(path)), None)

    with tf.name_scope(self._plan.name):
      summed: List[int] = []
      if count > 1:
        by_layers: dict = {}
        for rule in todo:
          by_layers.setdefault(rule.layers, []).append(rule.transform)
        wait = set().union(*(own(path) for layers, fns in by_layers.items()
                             if needs_sum(fns) for path in layers))
        for i, s in enumerate(flat_s):
          v = tf_variable(s)
          if v is not None and v.ref() in wait and flat_g[i] is not None:
            summed.append(i)
      ctx = tf.distribute.get_replica_context()
      if summed:
        with tf.name_scope("all_reduce"):
          total = ctx.all_reduce(tf.distribute.ReduceOp.SUM,
                                 [dense(flat_g[i]) for i in summed])
        for i, g in zip(summed, total):
          flat_g[i] = g
      pairs = [(g, tf_variable(s)) for s, g in zip(flat_s, flat_g)]
      flat_g = step.transform_parameters(todo, pairs, layer_among)
      for i in summed:
        if flat_g[i] is not None:
          g = dense(flat_g[i])
          first = tf.equal(ctx.replica_id_in_sync_group, 0)
          flat_g[i] = tf.where(first, g, tf.zeros_like(g))
    return flat_g

  def _parameter_tasks(self, declared, target, losses, flat_s, flat_g):
    """``flat_g`` with the task combination in parameter space
    (``core._task_combination.combined_parameters``) applied to the chosen
    sources: the variables of its layers (every variable for
    ``layers=None``). A stateful method's state is made once per plan in
    its ``method_variables``."""
    if declared.layers is None:
      chosen = [i for i, x in enumerate(flat_s) if tf_variable(x) is not None]
    else:
      mine = {v.ref() for p in declared.layers
              for v in self._plan.own_variables(p)}
      chosen = [i for i, x in enumerate(flat_s) if tf_variable(x) is not None
                and tf_variable(x).ref() in mine]
    out = list(flat_g)
    if not chosen:
      return out
    state_of = functools.partial(self._plan.method_variables.state,
                                 "combine_tasks/parameters")
    with self._run.backward(self._run.step(plain=True)), tf.name_scope(
        self._plan.name):
      new = combined_parameters(
          self._vjp, target, losses, [flat_s[i] for i in chosen],
          [flat_g[i] for i in chosen], declared.method, state_of)
    for i, g in zip(chosen, new):
      out[i] = g
    return out

  def _task_deltas(self, target, by_layer) -> Dict[str, List[list]]:
    """Task layer -> per call and output: ``combine(g_i) - sum_i g_i``, or
    ``None`` (``core._task_combination.call_deltas`` over every call's
    outputs at once). A stateful method's state is made once per plan and
    layer in its ``method_variables``."""
    deltas: Dict[str, List[list]] = {}
    with self._run.backward(self._run.step(plain=True)):
      for path, rule in self._plan.rules.tasks.items():
        deltas[path] = call_deltas(
            self._vjp, target, path, by_layer[path], self._run.outputs[path],
            rule.method, functools.partial(self._plan.method_variables.state,
                                           f"combine_tasks/{path}"))
    return deltas

  def _check_ran(self) -> None:
    never = [p for p in self._plan.rules.named if not self._run.calls[p]]
    if never:
      raise _errors.NotConnectedError(
          f"layer(s) {', '.join(map(repr, never))} never ran in the forward "
          f"pass under this tape, so the plan has nothing to rewrite there. "
          f"Call the model inside `with plan.tape() as tape:` (the forward "
          f"pass must run under the tape), or drop the transforms on layers "
          f"this model's call does not use.")

  def _check_edges(self, step: BackwardStep) -> None:
    for lo, up in sorted(step.edges_run - step.edges_fed):
      raise _errors.NotConnectedError(
          f"transform_edge({lo!r}, {up!r}): {up!r} ran, but no gradient "
          f"from it reached {lo!r}'s outputs through ops and layers without "
          f"variables, so the edge carries nothing. Name a `lower` whose "
          f"output feeds `upper` directly (activations, additions, "
          f"concatenations in between are fine), or use "
          f"transform_upstream on the layer in between.")

