"""KerasPlan: the declarations of GradientPlan, executed for TF2 Keras models.

TF2 code has no graph to analyse before it runs: a Keras model's layer
outputs exist only while the model is called. A :class:`KerasPlan` therefore
finds layers by their Keras name in the model's layer tree, holds its
declarations in the shared ``Declarations`` of ``graphgrad.core``
(declared and checked as ``GradientPlan``'s are, through the same
``core._declaring`` methods), and executes them while the forward
pass runs under :meth:`KerasPlan.tape` (see ``_tape`` and ``_intercept``).
The model's code is not changed, and everything is restored when the tape
closes.

It works with Keras 3 (``keras``, and ``tf.keras`` on TF 2.16+) and with
tf-keras, for subclassed, functional and ``Sequential`` models, eagerly and
inside ``tf.function``.
"""

import logging
import threading
from typing import Any, Dict, List, Optional, Tuple, Union

import tensorflow as tf

from graphgrad import _errors
from graphgrad.core import _logged_advice
from graphgrad.core._declaration_model import Declarations
from graphgrad.core._declaring import Declaring, LayerRef
from graphgrad.core._inert import bottom_layer_advice
from graphgrad.core._layer_step import TraceRecord
from graphgrad.core._privacy import NoiseCounter
from graphgrad.core._rules import CompiledRules, PlanRules
from graphgrad.keras import (
  _fit,
  _loss_scale,
  _methods,
  _step_summaries,
  _tape_recompute,
)
from graphgrad.keras._layer_index import (
  check_group_parameters,
  check_parameters,
  is_keras_layer,
  layer_variables,
  nothing_below,
  tf_variable,
)
from graphgrad.keras._layer_override import LayerOverriding
from graphgrad.keras._tape import PlanTape, PlanView
from graphgrad.methods import _pcgrad
from graphgrad.methods._replacement import as_replacement
from graphgrad.transforms._context import Resources

log = logging.getLogger("graphgrad")

class KerasPlan(tf.Module, Declaring, LayerOverriding):
  """Rewrites gradients at the layer boundaries of a Keras model.

  The declarations are those of :class:`GradientPlan`, with a layer being
  a Keras layer found by name (or ``"outer/inner"`` path), applied while
  the forward pass runs under :meth:`tape`.

  Semantics: see docs/concepts.md, "The semantics, exactly"; what differs
  in TF2: docs/keras.md.

  Args:
    model: a Keras model or layer (Keras 3 or tf-keras).
    global_step: optional step counter handed to transforms in their
      context, e.g. ``optimizer.iterations`` or a ``tf.Variable``.
    name: name scope for the ops graphgrad adds (a Python identifier).

  A linear upstream rewrite (``scale``, ``zero``, ``reverse`` with a number)
  weights one VJP of the layer by its factor, or runs the layer as it is on
  inputs whose gradient is weighted; any other rewrite is called on the
  gradient, with a second VJP.

  Raises:
    GraphGradError: if ``model`` is not a Keras layer or ``name`` is not an
      identifier.

  Example:
    >>> import tensorflow as tf, graphgrad as gg
    >>> model = tf.keras.Sequential([
    ...     tf.keras.layers.Dense(1, use_bias=False, kernel_initializer="ones",
    ...                           name="l1"),
    ...     tf.keras.layers.Dense(1, use_bias=False, kernel_initializer="ones",
    ...                           name="l2")])
    >>> plan = gg.KerasPlan(model).transform_upstream(
    ...     "l2", gg.transforms.scale(0.5))
    >>> with plan.tape() as tape:
    ...   loss = tf.reduce_sum(model(tf.constant([[2.0]])))
    >>> [g.numpy().tolist() for g in tape.gradient(loss)]
    [[[1.0]], [[2.0]]]
  """

  def __init__(self, model: Any, global_step=None, name: str = "graphgrad"):
    if not is_keras_layer(model):
      raise _errors.GraphGradError(
          f"`model` must be a Keras model or layer (Keras 3 or tf-keras); got "
          f"{type(model).__name__}. For a tf.compat.v1 graph use "
          f"gg.GradientPlan(loss).")
    if not isinstance(name, str) or not name.isidentifier():
      raise _errors.GraphGradError(
          f"`name` must be a Python identifier, the name scope of the ops "
          f"graphgrad adds; got {name!r}. Pass e.g. name='graphgrad'.")
    super().__init__(name=name)
    self._model = model
    self._global_step = global_step
    self._index = _methods.KerasLayers(model)
    self._declarations = Declarations(self._index.find, owner="KerasPlan")
    self._rules = CompiledRules(self._declarations, self._index)
    self._methods = _methods.MethodVariables()
    self._resources = Resources(modules=[self._methods])
    self._open_tape: Optional[PlanTape] = None
    # The last step's tape, for kept_tensors(), trace and summaries().
    self._last_tape: Optional[PlanTape] = None
    # Each replica's (each thread's) own last tape: the replicas of a
    # MirroredStrategy step run in threads of their own, interleaved.
    self._thread = threading.local()
    # The float16 warning, logged once per plan (a bool: tf.Module tracks
    # no bools).
    self._unscaled_warned = False
    self._unwritten_warned = False  # summaries() without a writer, once
    self._attached: Optional[_fit.Attachment] = None
    self._warned_bottom: set = set()
    # The steps privatize's noise has drawn for, kept across every tape.
    self._noise_counter: Optional[NoiseCounter] = None
    self._noise_step: Optional[tf.Variable] = None  # its variable, tracked
    self._eager_recompute_logged = False
    self._warned_adaptive = False

  # -- declaring -----------------------------------------------------------

  def project_conflicts(self, layer: LayerRef, losses=None,
                        shuffle: bool = False,
                        seed: Optional[int] = None) -> "KerasPlan":
    """Applies PCGrad's projection to the task gradients at a layer's outputs.

    ``combine_tasks(layer, gg.mtl.pcgrad(shuffle, seed))``, as
    ``GradientPlan.project_conflicts``: the output-level variant of PCGrad;
    the paper's, over all parameters, is ``combine_tasks(None,
    gg.mtl.pcgrad(), at="parameters")``. In TF2 the task losses exist only in
    the step: leave ``losses`` out here and pass them to
    ``tape.gradient(loss, task_losses=[loss_a, loss_b])``.

    Args:
      layer: the shared layer, whose outputs feed the task heads.
      losses: must be ``None`` on a KerasPlan.
      shuffle: take the other tasks in a random order at each step
        (``False`` by default: list order).
      seed: op-level seed of the shuffles.

    Returns:
      The plan, for chaining.

    Raises:
      LayerNotFoundError: if ``layer`` is not in the model.
      GraphGradError: if ``losses`` is given, the layer already combines
        task gradients, or a tape was opened.
    """
    if losses is not None:
      raise _errors.GraphGradError(
          "project_conflicts: on a KerasPlan the task losses only exist "
          "inside the training step, so `losses` must be None here. Pass "
          "them each step: tape.gradient(loss, task_losses=[loss_a, "
          "loss_b]).")
    return self.combine_tasks(layer, _pcgrad.pcgrad(shuffle, seed))

  def combine_tasks(self, layers, method, at: str = "output") -> "KerasPlan":
    """Combines the task gradients at a shared layer with ``method``.

    As ``GradientPlan.combine_tasks``. ``at="output"`` (the default): ``g``
    at ``layers``' outputs (one layer) becomes ``g - sum_i g_i +
    method.combine([g_1, ..., g_k])`` (a ``gg.mtl`` method; ``g_i``: task
    ``i``'s flattened gradients at every output of every call,
    concatenated), then the layer's upstream transform.
    ``at="parameters"``: the same for the gradients of the variables of
    ``layers`` (a layer, a list of them, or ``None`` for every trainable
    variable of the model among the gradient's sources), each task's
    gradients of all of them flattened into one vector, as the PCGrad
    authors' optimizer does; other variables keep the plan's gradient. It
    costs one more pass over the tape per task loss. Inside
    ``strategy.run`` each replica combines its own task gradients.

    A stateful method's state is made once per plan and layer (or once for
    the parameter level) in ``method_variables.states``, which
    ``tf.train.Checkpoint(plan=plan)`` saves. Task losses go to
    ``tape.gradient(loss, task_losses=[...])``.

    Example:
      >>> import tensorflow as tf, graphgrad as gg
      >>> model = tf.keras.Sequential([
      ...     tf.keras.Input((1,)), tf.keras.layers.Dense(
      ...         2, name="trunk", use_bias=False, kernel_initializer="ones")])
      >>> plan = gg.KerasPlan(model).combine_tasks("trunk", gg.mtl.pcgrad())
      >>> with plan.tape() as tape:
      ...   h = model(tf.constant([[1.0]]))  # [[1, 1]]
      ...   la, lb = h[0, 0], h[0, 1] - h[0, 0]  # gradients [1, 0], [-1, 1]
      ...   loss = la + lb
      >>> tape.gradient(loss, task_losses=[la, lb])[0].numpy().tolist()
      [[0.5, 1.5]]

    Raises:
      LayerNotFoundError: if a layer is not in the model.
      GraphGradError: if ``at`` is neither ``"output"`` nor
        ``"parameters"``, ``method`` has no ``combine``, the layer (or the
        plan, in parameter space) already combines task gradients, a listed
        built layer has no trainable variable, or a tape was opened.
    """
    return self._combine(layers, None, method, at)

  # -- checks of the declarations (core._declaring's hooks) ---------------

  def _check_upstream(self, name: str,
                      method: str = "transform_upstream") -> None:
    bottom, above = nothing_below(self._model, name)
    if bottom and (method, name) not in self._warned_bottom:
      self._warned_bottom.add((method, name))
      log.warning("%s", bottom_layer_advice(name, above, method))

  def _check_gradients(self, layers: Union[str, Tuple[str, ...]]) -> None:
    if isinstance(layers, tuple):
      check_group_parameters(self._index, layers)
    else:
      check_parameters(self._index, layers)

  def _check_backward(self, name: str, fn) -> None:
    as_replacement(fn).check(self._index, name)  # e.g. DFA's error layer

  def _check_parameter_tasks(self, names: Optional[Tuple[str, ...]]) -> None:
    # An unbuilt layer is not checked: its variables do not exist yet.
    empty = [n for n in names or ()
             if getattr(self._index[n], "built", False)
             and not self._index[n].trainable_weights]
    if empty:
      raise _errors.GraphGradError(
          f"combine_tasks(at='parameters'): layer(s) "
          f"{', '.join(map(repr, empty))} hold no trainable variable, so "
          f"there is nothing to combine there. Name layers with "
          f"trainable variables.")

  def _check_first(self, method: str, caller: str) -> None:
    if method == "recompute" and self._declarations.frozen:
      raise _errors.GraphGradError(
          "recompute: a tape of this plan was already opened, which fixes "
          "the plan. Declare recompute before the first step, or make a new "
          "KerasPlan.")
    private = self._declarations.privacy is not None
    if method == "privatize" and (
        private or self._declarations.frozen or self._attached is not None):
      raise _errors.GraphGradError(
          f"{caller}: the plan is already "
          f"{'private' if private else 'in use'}; declare "
          f"privatize once, before the first plan.tape() or attach().")

  def _check_recompute(self, keep: Optional[Tuple[str, ...]]) -> None:
    """Refuses a nested layer in ``recompute(keep=...)``."""
    if keep is not None:
      nested = [k for k in keep if "/" in k]
      if nested:
        tops = [p for p in self._index.paths if "/" not in p]
        raise _errors.GraphGradError(
            f"recompute: `keep` must name top-level layers of "
            f"{self._model.name} (the layers it calls directly), whose calls "
            f"are recomputed whole; got the nested {', '.join(nested)}. "
            f"Keep the layer that holds it instead: one of "
            f"{', '.join(tops)}.")

  def _keep_reader(self):
    tops = {p: self._index[p] for p in self._index.paths if "/" not in p}
    return lambda item: _tape_recompute.read_keep(self._model, tops, item)

  def kept_tensors(self) -> List[tf.Tensor]:
    """The tensors the last step's backward pass keeps under :meth:`recompute`.

    The outputs of the kept layer calls (those ``keep`` declared, or, with
    ``keep=None``, those the plan chose) of the last step run under
    :meth:`tape`; the calls between two of them are replayed in the
    backward pass. Calls that keep their activations anyway (a stateful
    random op) are not listed.

    Returns:
      The kept tensors, in forward order (the calls' order, each call's
      outputs flattened): in a traced step, symbolic ``tf.Tensor`` s of
      its graph; in an eager step, their values.

    Raises:
      GraphGradError: if the plan does not recompute, or no step has run
        under ``plan.tape()`` yet.

    Example:
      >>> import tensorflow as tf, graphgrad as gg
      >>> inp = tf.keras.Input((3,))
      >>> d1 = tf.keras.layers.Dense(4, name="d1")
      >>> out = tf.keras.layers.Dense(1, name="d2")(d1(inp))
      >>> model = tf.keras.Model(inp, out)
      >>> plan = gg.KerasPlan(model).recompute(keep=[d1.output])
      >>> with plan.tape() as tape:
      ...   loss = tf.reduce_sum(model(tf.ones([2, 3])))
      >>> _ = tape.gradient(loss)
      >>> [t.shape.as_list() for t in plan.kept_tensors()]
      [[2, 4]]
    """
    if self._declarations.recompute is None:
      raise _errors.GraphGradError(
          "kept_tensors: this KerasPlan does not recompute, so it keeps "
          "every activation. Declare plan.recompute(keep=...) first.")
    last = self._last()
    kept = None if last is None else last.kept
    if kept is None:
      raise _errors.GraphGradError(
          "kept_tensors: no step has run under this KerasPlan's tape yet, "
          "so no call was kept. Run one step (the forward pass under "
          "plan.tape(), then tape.gradient) first.")
    return list(kept)

  @property
  def trace(self) -> Tuple[TraceRecord, ...]:
    """``(context, before, after)`` of every transform the last step
    applied (the last ``tape.gradient`` under :meth:`tape`), as
    ``GradientPlan.trace``; empty before a step. In a traced step the
    tensors are that graph's."""
    last = self._last()
    return () if last is None else last.trace

  def summaries(self, step=None, histograms: bool = False,
                name: Optional[str] = None) -> Dict[str, tf.Tensor]:
    """TensorBoard summaries of what the plan did to the last step's
    gradient norms, as :meth:`GradientPlan.summaries`.

    Writes to the default ``tf.summary`` writer, with tags under
    ``graphgrad/``: ``grad_norm/<layer>/before|after`` (each layer's
    parameter-gradient norm before and after its ``transform_gradients``; a
    variable counts for the innermost layer holding it),
    ``upstream_norm/<layer>/before|after`` at every ``transform_upstream``
    and ``edge_norm/<lower>_to_<upper>/before|after`` on every transformed
    edge; ``histograms=True`` adds gradient histograms. Under a loss scale
    the figures are of the unscaled gradients. Inside ``strategy.run`` they
    are of the global batch: each parameter gradient summed over the
    replicas, each output gradient over all their examples (three more
    all-reduces; replica 0 writes). Call it after
    ``tape.gradient``, in the same step (inside its ``tf.function`` for a
    traced one); in ``fit``, ``plan.attach(summaries=logdir)`` calls it every
    step.

    Args:
      step: the summary step; defaults to the writer's
        (``writer.as_default(step=...)``).
      histograms: also write gradient histograms.
      name: the tags' first part; defaults to the plan's (``"graphgrad"``).

    Returns:
      ``tag -> norm``, the figures written (also without a writer).

    Raises:
      GraphGradError: before the first step, for a step that ran in
        another graph, or without a summary step.

    Example:
      >>> import tensorflow as tf, graphgrad as gg
      >>> inp = tf.keras.Input((2,))
      >>> ones = dict(use_bias=False, kernel_initializer="ones")
      >>> h = tf.keras.layers.Dense(1, name="l1", **ones)(inp)
      >>> model = tf.keras.Model(inp, tf.keras.layers.Dense(
      ...     1, name="l2", **ones)(h))
      >>> plan = gg.KerasPlan(model).transform_upstream(
      ...     "l2", gg.transforms.scale(0.5))
      >>> with plan.tape() as tape:
      ...   loss = tf.reduce_sum(model(tf.constant([[1.0, 2.0]])))
      >>> _ = tape.gradient(loss)
      >>> for tag, norm in plan.summaries(step=0).items():
      ...   print(tag, round(float(norm), 3))
      graphgrad/grad_norm/l1/before 1.118
      graphgrad/grad_norm/l1/after 1.118
      graphgrad/grad_norm/l2/before 3.0
      graphgrad/grad_norm/l2/after 3.0
      graphgrad/upstream_norm/l2/before 1.0
      graphgrad/upstream_norm/l2/after 0.5
    """
    tape = self._last()
    if tape is None or not tape.last_step.pairs:
      raise _errors.GraphGradError(
          "KerasPlan.summaries(): no step has computed gradients under "
          "this plan's tape yet. Run the forward pass under plan.tape() and "
          "call tape.gradient(loss) first, then plan.summaries().")
    paths = list(self._index.paths)
    layer_of = _step_summaries.layer_of_variables(
        paths, lambda p: layer_variables(self._index[p]))
    if not self._unwritten_warned:
      self._unwritten_warned = _step_summaries.warn_unwritten(self._model.name)
    return _step_summaries.write(tape.last_step, paths, layer_of, histograms,
                            name or self.name, at=step)

  def _privatized(self, privacy) -> None:
    # Made now, outside any step and under the strategy scope privatize is
    # declared in, for every tape to draw with.
    with tf.name_scope(self.name):
      self._noise_counter = NoiseCounter()
    # Tracked by the plan (a tf.Module): see noise_step.
    self._noise_step = self._noise_counter.variable

  # -- running -------------------------------------------------------------

  def tape(self, persistent: bool = False,
           watch_accessed_variables: bool = True, labels=None,
           loss_scale=None, batch_size: Optional[float] = None) -> PlanTape:
    """A ``tf.GradientTape`` that applies this plan.

    Run the forward pass inside ``with plan.tape() as tape:``, then call
    ``tape.gradient(loss)`` (the gradients of ``model.trainable_variables``)
    or ``tape.grads_and_vars(loss)`` (those pairs, then the methods' own
    variables'). Use it eagerly or inside a ``tf.function``; the plan is
    fixed once a tape is opened.

    Args:
      persistent: as for ``tf.GradientTape``.
      watch_accessed_variables: as for ``tf.GradientTape``.
      labels: a ``[batch, ...]`` tensor that ``synthetic`` modules are
        conditioned on (cDNI), e.g. the one-hot labels of the batch.
      loss_scale: for mixed precision: the loss-scale optimizer (or the
        scale, a number or scalar tensor) whose scaled loss the tape's
        gradient is taken of. Transforms then see the unscaled gradient in
        float32; the returned gradients stay scaled, for the optimizer to
        unscale and check (see docs/training-at-scale.md).
      batch_size: under ``privatize`` without ``expected_batch_size``: the
        divisor ``B`` of the noised sum, the same whatever the batch holds
        (``fit`` passes its batch size, so that a partial last batch gets
        the noise of a full one); ``None`` divides by the realized batch
        size.

    Returns:
      A :class:`PlanTape` context manager.

    Raises:
      GraphGradError: for a ``batch_size`` that is not a positive finite
        number or ``None``.
    """
    if batch_size is not None and (
        not isinstance(batch_size, (int, float)) or isinstance(batch_size, bool)
        or not 0 < batch_size < float("inf")):
      raise _errors.GraphGradError(
          f"KerasPlan.tape: `batch_size` must be a positive finite number "
          f"or None, the divisor of privatize's noised sum; got "
          f"{batch_size!r}. Pass the batch size of the training loop, e.g. "
          f"batch_size=64.")
    if not self._declarations.frozen:
      self._declarations.freeze()
      log.info("graphgrad KerasPlan on %s: %s", self._model.name,
               self._declarations.summary())
    rules = self._rules.rules(
        None if _loss_scale.scale_of(loss_scale) is None else loss_scale)
    if (rules.recompute is not None and tf.executing_eagerly()
        and not self._eager_recompute_logged):
      self._eager_recompute_logged = True
      log.info("graphgrad KerasPlan on %s: recompute saves memory only in a "
               "traced step (tf.function, fit, strategy.run); this eager "
               "step keeps every activation, with the same gradients.",
               self._model.name)
    if loss_scale is not None and hasattr(loss_scale, "apply_gradients"):
      self.check_optimizer(loss_scale)
    if loss_scale is None and not self._unscaled_warned:
      self._unscaled_warned = _loss_scale.warn_unscaled(self.model, rules)
    return PlanTape(self._view(rules), persistent, watch_accessed_variables,
                    labels, batch_size)

  def check_optimizer(self, optimizer) -> bool:
    """Logs once when ``optimizer`` largely cancels the plan's scales.

    An adaptive Keras optimizer (``Adam``, ``RMSprop``, ``Adagrad``,
    ``Adamax``, ``Adadelta``, ``Nadam`` and their subclasses, of Keras 3 or
    tf-keras, also inside a loss-scale optimizer) divides each parameter's
    step by a running estimate of its gradient's magnitude, so a constant
    positive scale declared by the plan changes little: the warning names
    the declarations and what to do instead, as
    ``GradientPlan.apply_gradients`` does. ``fit`` (after :meth:`attach`)
    and ``plan.tape(loss_scale=optimizer)`` check their optimizer; call it
    in a training loop of your own.

    Args:
      optimizer: the Keras optimizer that applies the plan's gradients.

    Returns:
      True when this call logged the warning.

    Example:
      >>> import tensorflow as tf, graphgrad as gg
      >>> model = tf.keras.Sequential([tf.keras.layers.Dense(1, name="l1")])
      >>> plan = gg.KerasPlan(model).transform_gradients(
      ...     "l1", gg.transforms.scale(0.5))
      >>> plan.check_optimizer(tf.keras.optimizers.Adam())  # logs once
      True
      >>> plan.check_optimizer(tf.keras.optimizers.Adam())
      False
    """
    if self._warned_adaptive:
      return False
    self._warned_adaptive = _logged_advice.warn_if_keras_scale_cancels(
        self.rules, optimizer)
    return self._warned_adaptive

  def attach(self, labels=None, summaries=None) -> "KerasPlan":
    """Makes the model's ``fit``, ``train_on_batch`` and ``evaluate`` use
    the plan.

    The model's ``train_step`` becomes the Keras flavour's own with this
    plan's tape: everything ``compile`` and ``fit`` take works as without a
    plan, mixed precision's loss-scale optimizer included. A plan with
    ``project_conflicts`` or ``combine_tasks`` takes its task losses from
    the compiled per-output losses (one per task output). With
    ``BackupAndRestore``, the plan's method variables and step are backed
    up and restored with the model. A private plan (``privatize``)
    differentiates the compiled loss of each example: each output's
    compiled loss unreduced, times its sample and loss weights, averaged
    over its non-batch axes and summed over outputs; the model's loss
    metric stays the compiled mean. Only this model instance changes; see
    docs/training-at-scale.md and docs/privacy.md.

    Args:
      labels: for ``synthetic`` modules conditioned on labels (cDNI): a
        callable ``(x, y) -> labels`` of each batch, or ``None``.
      summaries: a log directory or a ``tf.summary.SummaryWriter``: each
        step of ``fit`` writes :meth:`summaries` there, at the optimizer's
        step count (``optimizer.iterations`` before the step's update).

    Returns:
      The plan, for chaining.

    Raises:
      GraphGradError: if the plan is already attached, another plan is
        attached to the model (detach it first), the model is not a
        Keras 3 or tf-keras ``Model``, or ``summaries`` is neither a
        directory nor a writer; in ``fit``, for a private plan whose
        model adds losses (``add_loss``, regularizers: not per example).
    """
    if self.attached:
      raise _errors.GraphGradError(
          f"plan.attach(): this plan is already attached to "
          f"{self._model.name}; attaching again would apply it twice. Call "
          f"plan.detach() first.")
    attached = _fit.Attachment(self, labels, self._step_tensor,
                               _step_summaries.fit_writer(summaries))
    attached.install()
    self._attached = attached
    return self

  def detach(self) -> "KerasPlan":
    """Restores the model's own ``train_step``, ``fit`` and
    ``train_on_batch`` (after :meth:`attach`; otherwise does nothing)."""
    if self._attached is not None:
      self._attached.uninstall()
      self._attached = None
    return self

  @property
  def attached(self) -> bool:
    """True while the model's ``fit`` runs this plan: between
    :meth:`attach` and :meth:`detach`, unless the model's ``train_step`` was
    replaced since."""
    return self._attached is not None and self._attached.installed

  # -- public accessors ---------------------------------------------------

  @property
  def model(self):
    """The Keras model the plan rewrites."""
    return self._model

  @property
  def declarations(self) -> Declarations:
    """The plan's declarations, read-only once a tape was opened."""
    return self._declarations

  @property
  def global_step(self):
    """The step counter handed to transforms, or ``None``."""
    return self._global_step

  @property
  def layer_names(self) -> List[str]:
    """Paths of every layer in the model, e.g. ``["block", "block/dense"]``."""
    return list(self._index.paths)

  def layer(self, path: str):
    """The Keras layer at ``path``."""
    return self._index[path]

  @property
  def method_variables(self) -> _methods.MethodVariables:
    """The variables of the training methods, made on the first step."""
    return self._methods

  @property
  def noise_step(self) -> Optional[tf.Variable]:
    """The steps ``privatize``'s noise has drawn for (``None`` before
    ``privatize``): an int64 variable each private step increments, and
    the noise's seed with the key. ``tf.train.Checkpoint(plan=plan)`` and
    a ``fit``'s ``BackupAndRestore`` save it, so that a resumed run never
    draws a step's noise twice."""
    return self._noise_step

  @property
  def feedback_matrices(self) -> Dict[str, tf.Variable]:
    """``"<method key>/<layer>" -> B``: the fixed random feedback matrices."""
    return {k: v for k, v in self._methods.by_key.items()
            if not k.startswith("synthetic/")}

  @property
  def resources(self) -> Resources:
    """What the plan's transforms created, keyed by ``(layer, name)``."""
    return self._resources

  @property
  def trainable_variables(self):
    """The model's trainable variables, then the methods' (``tf.Module``)."""
    return tuple(self._model.trainable_variables) + tuple(
        v for v in self._methods.by_key.values() if v.trainable)

  # -- what the tape reads ------------------------------------------------

  @property
  def rules(self) -> PlanRules:
    """The plan's declarations, compiled (``graphgrad.core._rules``): what
    its tapes execute, without a loss scale. Compiled once for each state
    of the declarations."""
    return self._rules.rules()

  def _view(self, rules: PlanRules) -> PlanView:
    return PlanView(
        rules=rules, model=self._model, name=self.name,
        resources=self._resources, method_variables=self._methods,
        layers=self._index,
        layer_names=tuple(self._index.paths), layer=self.layer,
        own_variables=lambda path: layer_variables(self._index[path]),
        step_tensor=self._step_tensor,
        enter_tape=self._enter_tape, exit_tape=self._exit_tape,
        noise_counter=self._noise_counter)

  def _step_tensor(self):
    """``global_step`` as a ``tf.Variable`` or tensor (Keras 3 unwrapped)."""
    step = self._global_step
    var = tf_variable(step) if step is not None else None
    return step if var is None else var

  def _enter_tape(self, tape: PlanTape) -> None:
    if self._open_tape is not None:
      raise _errors.GraphGradError(
          "a tape of this KerasPlan is already open; a nested one would "
          "apply every transform twice (scale(0.5) would scale by 0.25). "
          "Close it first, or record an outer step with tf.GradientTape.")
    self._open_tape = tape

  def _exit_tape(self, tape: PlanTape) -> None:
    self._open_tape = None if self._open_tape is tape else self._open_tape
    self._last_tape = self._thread.tape = tape

  def _last(self) -> Optional[PlanTape]:
    """This thread's last tape, or the plan's last one."""
    return getattr(self._thread, "tape", None) or self._last_tape

  def __repr__(self):
    return (f"KerasPlan(model={self._model.name}, "
            f"{self._declarations.summary()})")
