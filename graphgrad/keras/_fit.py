"""``model.fit`` through a KerasPlan: ``plan.attach()`` and ``plan.detach()``.

``attach()`` sets, on the plan's model instance only, a ``train_step`` that
is the Keras flavour's own (Keras 3's, or tf-keras' and that of the Keras 2
TensorFlow 2.15 bundles) with ``plan.tape`` in
place of ``tf.GradientTape``: compiled losses, metrics and loss weights,
sample weights, a loss-scale optimizer and every ``fit`` argument work as
without a plan. For task combinations the compiled per-output losses are
the task losses. Variables a method makes on its first step (synthetic
modules) are made before the optimizer is built, so that it trains them.
The plan's state (method variables, its own step) is saved with each
``BackupAndRestore`` backup and restored with it. ``detach()`` restores
the model's own methods; nothing of graphgrad is ever saved with the model.
"""

import contextlib
import importlib
import inspect
import logging
import os
import weakref
from typing import Any, Dict, List, Optional

import tensorflow as tf

from graphgrad import _compat, _errors
from graphgrad.keras import _step_summaries

log = logging.getLogger("graphgrad")

# The model methods attach() replaces on the instance.
_METHODS = ("train_step", "fit", "train_on_batch")

# id(model) -> the Attachment installed on it, so that a second plan is
# refused instead of silently replacing the first.
_INSTALLED: "weakref.WeakValueDictionary[int, Attachment]" = (
    weakref.WeakValueDictionary())


def flavour(model) -> str:
  """Which Keras the model's class is of: ``"keras3"``, ``"tf_keras"``, or
  ``"keras2"`` for the Keras 2 that TensorFlow 2.15 bundles as ``keras``
  (tf-keras' API and ``train_step``)."""
  if callable(getattr(model, "train_step", None)):
    for cls in type(model).__mro__:
      top = cls.__module__.split(".", 1)[0]
      if top == "tf_keras":
        return "tf_keras"
      if top == "keras":
        return "keras3" if _compat.is_keras3(top) else "keras2"
  raise _errors.GraphGradError(
      f"plan.attach(): the plan's model must be a Keras 3 or tf-keras Model "
      f"with a train_step; got {type(model).__name__}. Build the plan on "
      f"the keras.Model you call fit() on.")


class Attachment:
  """The state of one ``plan.attach()``: what ``detach()`` restores."""

  def __init__(self, plan, labels=None, step_tensor=lambda: None,
               writer=None):
    model = self.model = plan.model
    self.plan, self.labels, self.writer = plan, labels, writer
    self.flavour, self.step_tensor = flavour(model), step_tensor
    self._saved: Dict[str, Any] = {}
    self._recorded: List[Any] = []
    self._loss_weights: Any = None
    # The divisor of privatize's noised sum in this fit (fit_batch_size).
    self._batch_size: Optional[float] = None
    step = (_keras3_step if self.flavour == "keras3" else _tf_keras_step)
    self._step = lambda data: step(self, data)

  # -- install -------------------------------------------------------------

  @property
  def installed(self) -> bool:
    """True while the model's ``fit`` runs this attachment's step."""
    return (self.model.__dict__.get("train_step") is self._step
            and _INSTALLED.get(id(self.model)) is self)

  def install(self) -> None:
    model = self.model
    other = _INSTALLED.get(id(model))
    if other is not None and other.installed:
      raise _errors.GraphGradError(
          f"plan.attach(): the model {model.name} already has a plan "
          f"attached ({other.plan!r}); attaching a second would replace it "
          f"while the first still said it was attached. Call detach() on "
          f"the attached plan first, or add this plan's declarations to it.")
    for name in _METHODS:
      self._saved[name] = model.__dict__.get(name, _MISSING)
    fit, train_on_batch = model.fit, model.train_on_batch

    def planned_fit(*args, **kwargs):
      x = args[0] if args else kwargs.get("x")
      batch_size = kwargs.get("batch_size",
                              args[2] if len(args) > 2 else None)
      self._divide_by(fit_batch_size(self.plan, x, batch_size))
      self._prepare(x, kwargs.get("y", args[1] if len(args) > 1 else None),
                    batch_size)
      kwargs["callbacks"] = self._with_state(kwargs.get("callbacks"))
      return fit(*args, **kwargs)

    def planned_train_on_batch(x, y=None, *args, **kwargs):
      self._divide_by(None)  # the caller's batch is the batch
      self._prepare(x, y, None)
      return train_on_batch(x, y, *args, **kwargs)

    object.__setattr__(model, "train_step", self._step)
    object.__setattr__(model, "fit", planned_fit)
    object.__setattr__(model, "train_on_batch", planned_train_on_batch)
    _INSTALLED[id(model)] = self
    _reset_functions(model)

  def uninstall(self) -> None:
    """Restores the model's own methods, unless they were replaced since
    (then they are not this attachment's to restore)."""
    model = self.model
    if not self.installed:
      return
    del _INSTALLED[id(model)]
    for name, saved in self._saved.items():
      if saved is _MISSING:
        model.__dict__.pop(name, None)
      else:
        object.__setattr__(model, name, saved)
    self._saved = {}
    _reset_functions(model)

  # -- what the step needs ---------------------------------------------------

  def tape(self, x, y):
    labels = self.labels(x, y) if callable(self.labels) else self.labels
    return self.plan.tape(labels=labels, loss_scale=self.model.optimizer,
                          batch_size=self._batch_size)

  def _divide_by(self, batch_size: Optional[float]) -> None:
    """Sets the divisor of the noised sum; a new one retraces the step,
    whose trace holds it as a constant."""
    if batch_size != self._batch_size:
      self._batch_size = batch_size
      _reset_functions(self.model)

  @property
  def has_tasks(self) -> bool:
    return self.plan.rules.has_tasks

  def _prepare(self, x, y, batch_size) -> None:
    """Makes the methods' variables before the optimizer is built."""
    plan, model = self.plan, self.model
    check_gradient_step(getattr(model, "optimizer", None))
    if self.has_tasks or plan.rules.privacy is not None:
      # eagerly: the config serializes the optimizer
      self._loss_weights = model.get_compile_config().get("loss_weights")
    optimizer = getattr(model, "optimizer", None)
    if (not plan.rules.replacements or optimizer is None
        or _built(optimizer) or self._made(optimizer)):
      return
    batch = _first_batch(x, y, batch_size)
    if batch is None:
      return
    bx, by, bw = _unpack(self.flavour, batch)
    with model.distribute_strategy.scope():
      with self.tape(bx, by) as tape:
        y_pred = model(bx, training=True)
        loss = self.losses(bx, by, y_pred, bw)
      tape.grads_and_vars(loss[1], task_losses=self.task_losses())
      variables = list(plan.trainable_variables)
      if hasattr(optimizer, "build"):
        optimizer.build(variables)
    log.info("graphgrad KerasPlan on %s: optimizer built with %d method "
             "variables for fit", model.name,
             len(variables) - len(model.trainable_variables))

  def _made(self, optimizer) -> bool:
    """A tf-keras optimizer (no public ``built``; it builds from the
    variables it is given) once the methods' variables are made."""
    return not hasattr(optimizer, "built") and len(
        self.plan.trainable_variables) > len(self.model.trainable_variables)

  def task_losses(self) -> Optional[List[Any]]:
    """The task losses of this step, for ``tape.grads_and_vars``."""
    return list(self._recorded) if self.has_tasks else None

  def _with_state(self, callbacks):
    callbacks = list(callbacks or [])
    at = [i for i, c in enumerate(callbacks) if _is_backup(c)]
    if at:  # right after the backup, so that both save at the same points
      callbacks.insert(at[0] + 1, _plan_state(self, callbacks[at[0]]))
    return callbacks

  # -- per-output losses ---------------------------------------------------

  def losses(self, x, y, y_pred, sample_weight):
    """The model's own loss (its metrics and checks) and the loss to
    differentiate: with tasks, the same sum spelled out over the task
    losses, so that the plan sees each.

    The task losses are the compiled per-output losses of this step, kept
    for :meth:`task_losses`; the loss to differentiate is their weighted
    sum.
    """
    model = self.model
    if self.flavour == "keras3" and "training" in inspect.signature(
        model.compute_loss).parameters:
      loss = model.compute_loss(
          x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
    else:
      loss = model.compute_loss(x, y, y_pred, sample_weight)
    if self.plan.rules.privacy is not None:
      return loss, per_example_loss(model, y, y_pred, sample_weight,
                                    self._loss_weights)
    if not self.has_tasks:
      return loss, loss
    pairs = output_losses(self.model, y, y_pred, sample_weight,
                          self._loss_weights)
    self._recorded = [value for value, _ in pairs]
    if len(self._recorded) < 2:
      raise _errors.GraphGradError(
          f"model.fit with combine_tasks/project_conflicts: the task losses "
          f"are the compiled per-output losses, but {len(self._recorded)} "
          f"output(s) have a loss. Compile a loss for each task output, "
          f"e.g. compile(loss=['mse', 'mse']) or a dict by output name.")
    return loss, compiled_total(self.model, pairs)


_MISSING = object()


def _reset_functions(model) -> None:
  """Drops the traced train step, so that the next fit traces the new one."""
  with contextlib.suppress(AttributeError):
    model.train_function = None


def _built(optimizer) -> bool:
  """Keras 3's public ``built``; tf-keras' optimizers have none, and their
  ``build`` does nothing once built."""
  inner = getattr(optimizer, "inner_optimizer", None)
  if getattr(optimizer, "built", False):
    return True
  return inner is not None and _built(inner)


def fit_batch_size(plan, x, batch_size) -> Optional[float]:
  """The divisor ``B`` of a private plan's noised sum in ``fit(x, ...,
  batch_size=batch_size)``, the same for every batch: a partial last batch
  of ``b`` examples gets the noise ``sigma C / B`` of a full one, not
  ``sigma C / b``.

  ``None`` (the plan's own rule) without ``privatize`` or with its
  ``expected_batch_size``. Arrays are cut into ``batch_size`` (Keras'
  default 32, at most the number of examples) rows; a ``tf.data.Dataset``
  gives its batch size when its element spec knows it (batched with
  ``drop_remainder=True``).

  Raises:
    GraphGradError: when the batch size cannot be known (a dataset of
      unknown batch size, a generator): pass ``expected_batch_size``.
  """
  privacy = plan.rules.privacy
  if privacy is None or privacy.declared.expected_batch_size is not None:
    return None
  if isinstance(x, tf.data.Dataset):
    sizes = {s.shape[0] if s.shape.rank else None
             for s in tf.nest.flatten(x.element_spec)
             if isinstance(s, tf.TensorSpec)}
    known = sizes.pop() if len(sizes) == 1 else None
    if known is not None:
      return float(known)
    what = "a tf.data.Dataset whose batch size its element spec does not know"
  else:
    leaves = tf.nest.flatten(x)
    if leaves and all(getattr(a, "shape", None) is not None
                      and len(a.shape) > 0 for a in leaves):
      n = leaves[0].shape[0]
      size = batch_size or 32
      return float(size if n is None else min(size, int(n)))
    what = f"{type(x).__name__} data"
  raise _errors.GraphGradError(
      f"model.fit with privatize: the noised sum is divided by the batch "
      f"size B, the same for every batch (a partial batch divided by its own "
      f"size would carry more noise), but fit was given {what}. Pass "
      f"privatize(..., expected_batch_size=B) with the batch size, or batch "
      f"the dataset with drop_remainder=True.")


def _first_batch(x, y, batch_size):
  if x is None:
    return None
  if isinstance(x, tf.data.Dataset):
    return next(iter(x))
  n = batch_size or 32
  head = lambda t: tf.nest.map_structure(  # noqa: E731
      lambda a: tf.convert_to_tensor(a[:n]), t)
  return (head(x),) if y is None else (head(x), head(y))


def _package(which: str):
  """The Keras package of a flavour: ``keras`` or ``tf_keras``."""
  return importlib.import_module("tf_keras" if which == "tf_keras" else "keras")


def _unpack(which: str, data):
  return _package(which).utils.unpack_x_y_sample_weight(data)


# Where a Keras optimizer computes gradients itself; the plan's step calls
# only apply_gradients, as Keras 3's own train_step does.
_COMPUTE = ("minimize", "compute_gradients", "_compute_gradients",
            "get_gradients")


def check_gradient_step(optimizer) -> None:
  """Refuses an optimizer whose class, outside Keras, overrides a method
  that computes gradients (a differential-privacy Keras optimizer clips and
  noises there): the plan's ``fit`` step calls only ``apply_gradients``, so
  that work would be skipped. One that also reduces in
  ``_aggregate_gradients`` (Horovod's), which ``apply_gradients`` calls,
  is accepted.

  Raises:
    GraphGradError: naming the class, the method and what to do instead.
  """
  if optimizer is None:
    return
  own = []
  for cls in type(optimizer).__mro__:
    if cls.__module__.split(".")[0] in ("keras", "tf_keras", "tensorflow"):
      break
    own.append(cls)
  found = [(m, c) for m in _COMPUTE for c in own if m in vars(c)]
  if not found or any("_aggregate_gradients" in vars(c) for c in own):
    return
  method, cls = found[0]
  name = type(optimizer).__name__
  raise _errors.GraphGradError(
      f"model.fit with a KerasPlan: the optimizer {name} overrides {method} "
      f"(in {cls.__name__}), which the plan's train step never calls: it "
      f"computes the gradients with the plan's tape and calls only "
      f"optimizer.apply_gradients, as Keras 3's own train_step does, so that "
      f"method's work would be skipped. Declare it in the plan and compile "
      f"the optimizer it wraps: for differential privacy, "
      f"plan.privatize(l2_norm_clip, noise_multiplier); for PCGrad, "
      f"plan.combine_tasks(layers, gg.mtl.pcgrad(), at=\"parameters\").")


def _refuse(model, reason: str, head: str):
  return _errors.GraphGradError(
      f"model.fit with {head}: compile(loss=...) of {model.name} must give "
      f"one loss per model output (a list or tuple in output order, a dict "
      f"by output name, or one loss for all); "
      f"received loss={model.loss!r}: {reason}. Compile one loss (a name, "
      f"a function or a Loss object) per output, or None for an output "
      f"without a loss.")


def _by_output(model, value, n: int, what: str, head: str) -> list:
  """``value`` (one per output, a dict by output name, or one for all) as a
  list in output order."""
  names = list(getattr(model, "output_names", None) or [])
  if isinstance(value, dict):
    if not names or set(value) - set(names):
      raise _refuse(model, f"{what} keys {sorted(value)} are not the "
                    f"output names {names}", head)
    return [value.get(name) for name in names]
  if isinstance(value, (list, tuple)):
    return list(value)
  return [value] * n


def output_losses(model, y, y_pred, sample_weight, loss_weights=None,
                  reduce: bool = True,
                  head: str = "combine_tasks/project_conflicts") -> List[Any]:
  """Each model output's compiled loss and its loss weight (or None).

  Resolved from the public ``model.loss`` (compile's ``loss`` argument) and
  ``loss_weights`` (``model.get_compile_config()["loss_weights"]``, read
  eagerly) as Keras resolves them, with each output's targets and sample
  weights; with ``reduce=False``, each loss unreduced. ``head`` names the
  declaration that needs them in a refusal.

  Raises:
    GraphGradError: a ``loss`` structure other than one loss per output,
      or a model whose ``compute_loss`` is its own.
  """
  which = flavour(model)
  package = _package(which)
  if type(model).compute_loss is not package.Model.compute_loss:
    raise _refuse(model, "the model overrides compute_loss, whose "
                  "per-output losses graphgrad cannot see", head)
  nest = package.tree if which == "keras3" else tf.nest
  preds = nest.flatten(y_pred)
  n = len(preds)
  losses = _by_output(model, model.loss, n, "loss", head)
  if len(losses) != n:
    raise _refuse(model, f"{len(losses)} losses for {n} outputs", head)
  if any(isinstance(l, (list, tuple, dict)) for l in losses):
    raise _refuse(model, "a nested structure, an output's loss is itself a "
                  "list or dict", head)
  targets = (_by_output(model, y, n, "y", head) if isinstance(y, dict)
             else nest.flatten(y))
  if len(targets) != n:
    raise _refuse(model, f"{len(targets)} targets for {n} outputs", head)
  weights = (_by_output(model, sample_weight, n, "sample_weight", head)
             if isinstance(sample_weight, (dict, list, tuple))
             else [sample_weight] * n)
  factors = ([None] * n if loss_weights is None
             else _by_output(model, loss_weights, n, "loss_weights", head))
  out = []
  for loss, target, pred, weight, factor in zip(losses, targets, preds,
                                                weights, factors):
    if loss is None or target is None:
      continue
    fn = _resolved(which, model, loss, reduce, head)
    out.append((fn(target, pred, sample_weight=weight), factor))
  return out


def per_example_loss(model, y, y_pred, sample_weight, loss_weights=None):
  """The compiled loss of each example, ``[B]``, for a private plan.

  Each output's compiled loss unreduced (the same Loss objects as
  :func:`output_losses`, with reduction ``None``), times its sample weights,
  averaged over its non-batch axes (as the compiled mean averages them),
  weighted by ``loss_weights`` and summed over outputs: the compiled loss is
  the mean of this vector over the batch.

  Raises:
    GraphGradError: for a model with ``add_loss`` terms (a weight penalty
      is not per example), a compiled loss that reduces over the batch, no
      output with both a loss and targets, or as :func:`output_losses`.
  """
  if model.losses:
    raise _not_per_example(model, "the model adds losses (add_loss, a "
                           "kernel regularizer), which are not per example",
                           "Apply weight decay in the optimizer (e.g. AdamW) "
                           "or with plan.transform_gradients.")
  total = None
  for value, factor in output_losses(model, y, y_pred, sample_weight,
                                     loss_weights, False, "privatize"):
    rank = value.shape.rank
    if rank is None or rank < 1:
      raise _not_per_example(
          model, f"a compiled loss gave shape {value.shape}, not one value "
          f"per example", "Compile a loss that keeps the batch axis: a "
          "built-in one such as 'mse', a Loss object, or a function that "
          "reduces over the last axes only (axis=-1), not over the batch.")
    if rank > 1:
      value = tf.reduce_mean(value, axis=list(range(1, rank)))
    if factor is not None:
      value = value * tf.cast(factor, value.dtype)
    total = value if total is None else total + tf.cast(value, total.dtype)
  if total is None:
    got = ("no targets" if y is None else f"targets for {sorted(y)}"
           if isinstance(y, dict) else "targets")
    raise _not_per_example(
        model, f"no output has both a compiled loss and targets (fit got "
        f"{got})", "Pass fit() the targets (y, or (x, y) batches of a "
        "dataset) of each output with a loss.")
  return total


def _not_per_example(model, reason: str, fix: str):
  return _errors.GraphGradError(
      f"model.fit with privatize on {model.name}: privatize clips each "
      f"example's gradient, so it needs one loss per example from "
      f"compile(loss={model.loss!r}); {reason}. {fix}")


def _unreduced(fn):
  """A compiled loss's Loss object as a function ``(y_true, y_pred,
  sample_weight)`` of one value per example (and per non-batch position):
  its ``call``, the sample weights broadcast over the trailing axes. Keras
  3 first converts both to the loss's dtype, as its ``Loss.__call__`` does.
  """
  dtype = getattr(fn, "dtype", None)

  def values(y_true, y_pred, sample_weight=None):
    if isinstance(dtype, str):  # Keras 3
      y_true = tf.cast(y_true, dtype)
      y_pred = tf.cast(y_pred, dtype)
    out = fn.call(y_true, y_pred)
    if sample_weight is None:
      return out
    w = tf.cast(sample_weight, out.dtype)
    if w.shape.rank is not None and out.shape.rank is not None:
      w = tf.reshape(w, tf.concat(
          [tf.shape(w), tf.ones([max(out.shape.rank - w.shape.rank, 0)],
                                tf.int32)], 0))
    return out * w

  return values


def compiled_total(model, pairs):
  """The compiled loss from ``output_losses``' pairs and ``model.losses``,
  in the operations and order of the model's Keras."""
  replicas = tf.distribute.get_strategy().num_replicas_in_sync
  if flavour(model) == "keras3":
    import keras  # pylint: disable=g-import-not-at-top
    floatx = keras.backend.floatx()
    values = []
    for value, factor in pairs:
      value = tf.cast(value, floatx)
      values.append(value if factor is None else tf.multiply(value, factor))
    losses = [sum(values)]
    for extra in model.losses:
      if not extra.dtype.is_floating:
        extra = tf.cast(extra, floatx)
      extra = tf.reduce_sum(extra)
      if replicas > 1:
        extra = tf.multiply(extra, tf.cast(1.0 / replicas, extra.dtype))
      losses.append(extra)
    return losses[0] if len(losses) == 1 else tf.reduce_sum(losses)
  scale = (lambda v: v * (1.0 / replicas)) if replicas > 1 else (
      lambda v: v)
  values = []
  for value, factor in pairs:
    values.append(scale(value if factor is None else value * factor))
  if model.losses:
    extras = list(model.losses)
    dtype = extras[0].dtype
    values.append(scale(tf.add_n([tf.cast(e, dtype) for e in extras])))
  return tf.add_n(values)


def _resolved(which: str, model, loss, reduce: bool, head: str):
  """A compiled loss as the Loss object Keras makes of it (unreduced when
  not ``reduce``)."""
  if which == "keras3" and isinstance(loss, str) and loss.lower() in (
      "crossentropy", "ce"):
    raise _refuse(model, f"{loss!r} picks its loss from the data; name "
                  f"the crossentropy, e.g. 'binary_crossentropy'", head)
  losses = _package(which).losses
  fn = losses.get(loss)
  if isinstance(fn, losses.Loss):
    return fn if reduce else _unreduced(fn)
  if which == "keras3":
    fn = _keras3_function_loss(fn, loss if isinstance(loss, str) else
                               getattr(fn, "__name__", "loss"))
    return fn if reduce else _unreduced(fn)
  return _tf_keras_function_loss(_package(which), fn, reduce)


def _keras3_function_loss(fn, name: str):
  """Keras 3's wrapper of a loss function: the ranks of targets and
  predictions made equal, then Loss's reduction and replica scaling."""
  import keras  # pylint: disable=g-import-not-at-top

  class FunctionLoss(keras.losses.Loss):

    def call(self, y_true, y_pred):
      y_true, y_pred = _same_rank(y_true, y_pred)
      return fn(y_true, y_pred)

  return FunctionLoss(name=name)


def _same_rank(a, b):
  """Squeezes or expands a trailing 1 where the ranks differ by one."""
  ra, rb = len(a.shape), len(b.shape)
  if ra == rb + 1 and a.shape[-1] == 1:
    return (a, tf.expand_dims(b, -1)) if rb == 1 else (tf.squeeze(a, -1), b)
  if rb == ra + 1 and b.shape[-1] == 1:
    return (tf.expand_dims(a, -1), b) if ra == 1 else (a, tf.squeeze(b, -1))
  return a, b


def _tf_keras_function_loss(package, fn, reduce: bool = True):
  """tf-keras' wrapper of a loss function (``package``: tf-keras, or
  TensorFlow 2.15's Keras 2), with its mean over the batch spelled out:
  tf-keras refuses that reduction in a replica context unless the loss
  comes from compile(). Unreduced when not ``reduce``."""

  class PerExample(package.losses.Loss):

    def call(self, y_true, y_pred):
      ry, rp = len(y_true.shape), len(y_pred.shape)
      if rp == ry + 1 and y_pred.shape[-1] == 1:
        y_pred = tf.squeeze(y_pred, -1)
      elif ry == rp + 1 and y_true.shape[-1] == 1:
        y_true = tf.squeeze(y_true, -1)
      return fn(y_true, y_pred)

  per_example = PerExample(reduction=package.losses.Reduction.NONE)
  if not reduce:
    return _unreduced(per_example)

  def loss(y_true, y_pred, sample_weight=None):
    values = per_example(y_true, y_pred, sample_weight=sample_weight)
    return tf.math.divide_no_nan(tf.reduce_sum(values),
                                 tf.cast(tf.size(values), values.dtype))

  return loss


# -- the train steps ---------------------------------------------------------

def _keras3_step(att: Attachment, data):
  """Keras 3's ``Model.train_step`` (TensorFlow backend) with the plan."""
  import keras  # pylint: disable=g-import-not-at-top
  model = att.model
  x, y, sample_weight = _unpack("keras3", data)
  with att.tape(x, y) as tape:
    if "training" in _call_parameters(model):
      y_pred = model(x, training=True)
    else:
      y_pred = model(x)
    loss, target = att.losses(x, y, y_pred, sample_weight)
    tracker = _loss_tracker(model)
    if tracker is not None:
      tracker.update_state(
          _unscaled_for_replicas(loss),
          sample_weight=tf.shape(
              next(i for i in keras.tree.flatten(x) if i is not None))[0])
    if model.optimizer is not None:
      target = model.optimizer.scale_loss(target)
  if model.trainable_weights:
    pairs = tape.grads_and_vars(target, task_losses=att.task_losses())
    _step_summaries.in_fit(att.plan, att.writer, model.optimizer)
    model.optimizer.apply_gradients(pairs)
  else:
    log.warning("graphgrad KerasPlan on %s: the model has no trainable "
                "weights.", model.name)
  return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


def _call_parameters(model):
  params = getattr(model, "call_signature_parameters", None)
  if params is None:
    params = list(inspect.signature(model.call).parameters)
  return params


def _loss_tracker(model):
  """The mean of the loss that ``fit`` logs: the metric named ``loss``."""
  return next((m for m in model.metrics if m.name == "loss"), None)


def _unscaled_for_replicas(loss):
  """The loss times the number of replicas, as Keras logs it: each
  replica's loss is divided by that number for the sum over replicas."""
  replicas = tf.distribute.get_strategy().num_replicas_in_sync
  if replicas > 1:
    return tf.multiply(loss, tf.cast(replicas, loss.dtype))
  return loss


def _validated(model, y, loss):
  """tf-keras' own checks of a step's targets and loss."""
  if model.loss and y is None:
    raise _errors.GraphGradError(
        f"model.fit on {model.name}: y (the targets) must be given, since "
        f"the model is compiled with loss={model.loss!r}; received no "
        f"targets. Pass y to fit(), or (x, y) batches of a dataset.")
  if loss is None:
    raise _errors.GraphGradError(
        f"model.fit on {model.name}: the model must have a loss; received "
        f"none from compile() or add_loss(). Pass compile(loss=...).")


def _tf_keras_step(att: Attachment, data):
  """tf-keras' ``Model.train_step`` (and Keras 2's) with the plan.

  ``optimizer.minimize(loss, tape=tape)`` is spelled out: scale the loss
  (a loss-scale optimizer), take the plan's gradients, unscale, apply.
  """
  model = att.model
  optimizer = model.optimizer
  x, y, sample_weight = _unpack(att.flavour, data)
  scaling = hasattr(optimizer, "get_scaled_loss")
  with att.tape(x, y) as tape:
    y_pred = model(x, training=True)
    loss, total = att.losses(x, y, y_pred, sample_weight)
    target = optimizer.get_scaled_loss(total) if scaling else total
  _validated(model, y, loss)
  pairs = tape.grads_and_vars(target, task_losses=att.task_losses())
  _step_summaries.in_fit(att.plan, att.writer, optimizer)
  if scaling:
    grads = optimizer.get_unscaled_gradients([g for g, _ in pairs])
    pairs = list(zip(grads, [v for _, v in pairs]))
  optimizer.apply_gradients(pairs)
  return model.compute_metrics(x, y, y_pred, sample_weight)


# -- the plan's state in BackupAndRestore's backups --------------------------

def _is_backup(callback) -> bool:
  return type(callback).__name__ == "BackupAndRestore" and hasattr(
      callback, "backup_dir")


def _plan_state(attached, backup):
  """A callback that saves the plan's state beside a ``BackupAndRestore``
  backup, of the backup's Keras.

  Made by the attached ``fit`` when its callbacks hold a
  ``BackupAndRestore``; runs after it, on its schedule: it restores at the
  start of training what the last backup saved, saves after each epoch
  (and each ``save_freq`` batches) and deletes its files when training
  ends, as the backup does.
  """
  base = type(backup).__mro__[1]
  return type("PlanStateCallback", (_PlanStateMixin, base), {})(attached,
                                                                backup)


class _PlanStateMixin:
  """The callback behind :func:`_plan_state`, of the backup's Keras."""

  def __init__(self, attached, backup):
    super().__init__()
    self._attached = attached
    self._backup = backup
    self._dir = os.path.join(backup.backup_dir, "graphgrad_plan")
    self._batches = 0
    self._status = None

  def _checkpoint(self):
    """What of the plan a backup saves: method variables, a step of its
    own (``optimizer.iterations`` is saved with the optimizer already) and
    ``privatize``'s noise step."""
    plan = self._attached.plan
    tracked: Dict[str, Any] = {"methods": plan.method_variables}
    step = self._attached.step_tensor()
    if isinstance(step, tf.Variable):
      tracked["step"] = step
    if plan.noise_step is not None:
      tracked["noise_step"] = plan.noise_step
    return tf.train.Checkpoint(**tracked)

  def on_train_begin(self, logs=None):
    latest = tf.train.latest_checkpoint(self._dir)
    if latest is not None:
      # Kept: variables a method makes on its first step are restored when
      # they are made (deferred restoration).
      self._status = self._checkpoint().read(latest)
      self._status.expect_partial()
      log.info("graphgrad KerasPlan: plan state restored from %s", latest)

  def _save(self):
    if not tf.distribute.get_strategy().extended.should_checkpoint:
      return
    tf.io.gfile.makedirs(self._dir)
    self._checkpoint().write(os.path.join(self._dir, "state"))
    # What tf.train.latest_checkpoint reads; write() alone does not keep it.
    with open(os.path.join(self._dir, "checkpoint"), "w") as f:
      f.write('model_checkpoint_path: "state"\n')

  def on_epoch_end(self, epoch, logs=None):
    freq = getattr(self._backup, "save_freq", "epoch")
    if freq == "epoch" or freq is False:
      self._save()

  def on_train_batch_end(self, batch, logs=None):
    freq = getattr(self._backup, "save_freq", "epoch")
    if isinstance(freq, int) and not isinstance(freq, bool) and freq > 0:
      self._batches += 1
      if self._batches % freq == 0:
        self._save()

  def on_train_end(self, logs=None):
    if (getattr(self._backup, "delete_checkpoint", True)
        and tf.io.gfile.exists(self._dir)):
      tf.io.gfile.rmtree(self._dir)
