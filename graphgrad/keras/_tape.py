"""PlanTape: a ``tf.GradientTape`` that executes a KerasPlan's declarations.

The tape reads the plan only through the :class:`PlanView` the plan hands
it (declarations, model, layers, their variables). While it records, an
:class:`~graphgrad.keras._intercept.Interceptor` rewrites the named layers'
backward passes; :meth:`PlanTape.gradient` then runs the backward pass,
applies the parameter transforms, and collects the gradients of the
variables the plan's training methods own.
"""

import contextlib
import dataclasses
import logging
from typing import Any, Callable, Dict, List, Tuple

import tensorflow as tf

from graphgrad import _errors
from graphgrad.core._gradients import add_dense
from graphgrad.core._parameters import transform_parameters
from graphgrad.core._privacy import check_per_example_loss, private_gradients
from graphgrad.core._rules import ParameterRule, PlanRules
from graphgrad.keras import _privatize_tape, _replicas, _tasks
from graphgrad.keras._intercept import BackwardStep, Interceptor
from graphgrad.keras._layer_index import tf_variable
from graphgrad.keras._tape_vjp import TapeVJP
from graphgrad.transforms._transforms import is_identity

log = logging.getLogger("graphgrad")


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
    noise: the ``Noise`` of ``plan.privatize``, or ``None``.
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
  noise: Any = None


class PlanTape:
  """A ``tf.GradientTape`` that applies a :class:`KerasPlan`.

  Made by :meth:`KerasPlan.tape`; use it as a context manager around the
  forward pass, then call :meth:`gradient` (or :meth:`grads_and_vars`).
  """

  def __init__(self, plan: PlanView, persistent: bool,
               watch_accessed_variables: bool, labels=None):
    self._plan = plan
    self._run = Interceptor(plan, labels)
    rules = plan.rules
    self._private = (None if rules.privacy is None else
                     _privatize_tape.Recorder(plan.model))
    # Task gradients and privatize take extra backward passes over the same
    # recording.
    self._tape = tf.GradientTape(
        persistent=(persistent or rules.has_tasks
                    or self._private is not None),
        watch_accessed_variables=watch_accessed_variables)
    self._vjp = TapeVJP.outer(self._tape)
    self._entered = False
    self._last = BackwardStep()

  # -- GradientTape surface ------------------------------------------------

  def __enter__(self) -> "PlanTape":
    if self._entered:
      raise _errors.GraphGradError(
          "this plan tape was already used; open a new one with plan.tape() "
          "for each forward pass.")
    self._plan.enter_tape(self)  # raises while another tape is open
    self._entered = True
    self._tape.__enter__()
    try:
      self._run.patch()
      if self._private is not None:
        self._private.patch()
    except BaseException:
      if self._private is not None:
        self._private.unpatch()
      self._run.unpatch()
      self._tape.__exit__(None, None, None)
      self._plan.exit_tape(self)
      raise
    return self

  def __exit__(self, *exc):
    self._plan.exit_tape(self)
    if self._private is not None:
      self._private.unpatch()
    self._run.close()
    return self._tape.__exit__(*exc)

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
    with self._scaled():
      return self._planned(target, sources, output_gradients,
                           unconnected_gradients, task_losses)

  def _private_grads(self, uses, target, sources: list, unconnected
                     ) -> list:
    """DP-SGD's gradients of ``sources`` (core._privacy), ``unconnected``
    for those the loss does not reach."""
    check_per_example_loss(target, "KerasPlan.privatize")
    grads = private_gradients(self._vjp, target, sources, uses,
                              self._plan.noise)
    if unconnected == tf.UnconnectedGradients.ZERO:
      grads = [tf.zeros_like(tf.convert_to_tensor(s)) if g is None else g
               for g, s in zip(grads, sources)]
    return grads

  def _scaled(self):
    """The context the plan's gradient is computed in (a loss scale's)."""
    return contextlib.nullcontext()

  def _planned(self, target, sources, output_gradients, unconnected_gradients,
               task_losses):
    self._check_ran()
    plan = self._plan
    if sources is None:
      sources = list(plan.model.trainable_variables)
    by_layer = _tasks.losses_by_layer(
        plan.rules.tasks, task_losses,
        parameters=plan.rules.parameter_tasks is not None)
    step = BackwardStep(task_deltas=self._task_deltas(target, by_layer))
    with self._run.backward(step):
      if self._private is None:
        grads = self._vjp.backprop(target, sources, output_gradients,
                                   unconnected_gradients)
      else:
        grads = tf.nest.pack_sequence_as(
            sources, self._private_grads(self._private, target,
                                         tf.nest.flatten(sources),
                                         unconnected_gradients))
    self._last = step
    self._check_edges(step)
    # Each layer's own transforms, then those of several layers at once.
    todo = [r for r in plan.rules.parameters
            if not is_identity(r.transform)]
    params = plan.rules.parameter_tasks
    if not todo and not step.extra and params is None:
      return grads
    flat_s = tf.nest.flatten(sources)
    flat_g = tf.nest.flatten(grads)
    if params is not None:
      flat_g = self._parameter_tasks(params, target,
                                     by_layer[_tasks.PARAMETERS], flat_s,
                                     flat_g)
    self._methods_grads(step, flat_s, flat_g)
    # Under tf.distribute: the transforms see the sum over replicas.
    flat_g = _replicas.transform_parameters(
        flat_s, flat_g, todo, self._transformed(todo), self._own_variables,
        plan.name)
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
    with self._scaled():
      grads = self._planned(target, variables, None,
                            tf.UnconnectedGradients.NONE, task_losses)
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

  def _own_variables(self, path: str) -> List[tf.Variable]:
    """The variables of the layer ``path``, nested layers' included."""
    return list(self._plan.own_variables(path))

  def _transformed(self, todo: List[ParameterRule]) -> Callable:
    """``(flat_sources, flat_grads) -> flat_grads`` after the parameter
    transforms ``todo`` (``core._parameters``)."""
    refs: Dict[str, set] = {}

    def layer_among(v, layers):
      for path in layers:
        if path not in refs:
          refs[path] = {w.ref() for w in self._own_variables(path)}
        if v.ref() in refs[path]:
          return path
      return None

    def transform(flat_s, flat_g):
      pairs = [(g, tf_variable(s)) for s, g in zip(flat_s, flat_g)]
      return transform_parameters(todo, pairs, layer_among, self._run.context)

    return transform

  def _parameter_tasks(self, declared, target, losses, flat_s, flat_g):
    """The task combination in parameter space, on the chosen sources:
    the variables of its layers (every variable for ``layers=None``)."""
    if declared.layers is None:
      chosen = [i for i, x in enumerate(flat_s) if tf_variable(x) is not None]
    else:
      mine = {v.ref() for p in declared.layers
              for v in self._plan.own_variables(p)}
      chosen = [i for i, x in enumerate(flat_s) if tf_variable(x) is not None
                and tf_variable(x).ref() in mine]
    with self._run.backward(BackwardStep(plain=True)), tf.name_scope(
        self._plan.name):
      return _tasks.parameter_grads(self._vjp, target, losses, flat_s,
                                    flat_g, chosen, declared.method,
                                    self._plan.method_variables)

  def _task_deltas(self, target, by_layer) -> Dict[str, List[list]]:
    """Task layer -> what its task combination adds, per call and output."""
    tasks = self._plan.rules.tasks
    deltas: Dict[str, List[list]] = {}
    with self._run.backward(BackwardStep(plain=True)):
      for path in tasks:
        losses = by_layer[path]
        deltas[path] = _tasks.task_deltas(
            self._vjp, target, losses, self._run.outputs[path],
            tasks[path].method, path, self._plan.method_variables)
    return deltas

  def _check_ran(self) -> None:
    never = [p for p in self._run.targets() if not self._run.calls[p]]
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

