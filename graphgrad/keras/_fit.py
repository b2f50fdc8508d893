"""``model.fit`` through a KerasPlan: ``plan.attach()`` and ``plan.detach()``.

``attach()`` sets, on the plan's model instance only, a ``train_step`` that
is the Keras flavour's own (Keras 3's or tf-keras') with ``plan.tape`` in
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
import logging
import os
from typing import Any, Dict, List, Optional

import tensorflow as tf

from graphgrad import _errors

log = logging.getLogger("graphgrad")

# The model methods attach() replaces on the instance.
_METHODS = ("train_step", "fit", "train_on_batch")


def flavour(model) -> str:
  """``"keras3"`` or ``"tf_keras"``: which Keras the model's class is of."""
  if callable(getattr(model, "train_step", None)):
    for cls in type(model).__mro__:
      top = cls.__module__.split(".", 1)[0]
      if top in ("keras", "tf_keras"):
        return "keras3" if top == "keras" else "tf_keras"
  raise _errors.GraphGradError(
      f"plan.attach(): the plan's model must be a Keras 3 or tf-keras Model "
      f"with a train_step; got {type(model).__name__}. Build the plan on "
      f"the keras.Model you call fit() on.")


class Attachment:
  """The state of one ``plan.attach()``: what ``detach()`` restores."""

  def __init__(self, plan, labels=None, step_tensor=lambda: None):
    model = plan.model
    self.plan = plan
    self.model = model
    self.flavour = flavour(model)
    self.labels = labels
    self.step_tensor = step_tensor
    self._saved: Dict[str, Any] = {}
    self._recorded: List[Any] = []
    step = (_keras3_step if self.flavour == "keras3" else _tf_keras_step)
    self._step = lambda data: step(self, data)

  # -- install -------------------------------------------------------------

  def install(self) -> None:
    model = self.model
    for name in _METHODS:
      self._saved[name] = model.__dict__.get(name, _MISSING)
    fit, train_on_batch = model.fit, model.train_on_batch

    def planned_fit(*args, **kwargs):
      self._prepare(args[0] if args else kwargs.get("x"),
                    kwargs.get("y", args[1] if len(args) > 1 else None),
                    kwargs.get("batch_size"))
      kwargs["callbacks"] = self._with_state(kwargs.get("callbacks"))
      return fit(*args, **kwargs)

    def planned_train_on_batch(x, y=None, *args, **kwargs):
      self._prepare(x, y, None)
      return train_on_batch(x, y, *args, **kwargs)

    object.__setattr__(model, "train_step", self._step)
    object.__setattr__(model, "fit", planned_fit)
    object.__setattr__(model, "train_on_batch", planned_train_on_batch)
    _reset_functions(model)

  def uninstall(self) -> None:
    model = self.model
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
    return self.plan.tape(labels=labels, loss_scale=self.model.optimizer)

  @property
  def has_tasks(self) -> bool:
    return bool(self.plan.declarations.tasks)

  def _prepare(self, x, y, batch_size) -> None:
    """Makes the methods' variables before the optimizer is built."""
    plan, model = self.plan, self.model
    optimizer = getattr(model, "optimizer", None)
    if (not plan.declarations.backward or optimizer is None
        or _built(optimizer)):
      return
    batch = _first_batch(x, y, batch_size)
    if batch is None:
      return
    bx, by, bw = _unpack(self.flavour, batch)
    with model.distribute_strategy.scope():
      with self.tape(bx, by) as tape:
        y_pred = model(bx, training=True)
        loss = _loss(self, bx, by, y_pred, bw)
      tape.grads_and_vars(loss, task_losses=self._task_losses())
      variables = list(plan.trainable_variables)
      if hasattr(optimizer, "build"):
        optimizer.build(variables)
    log.info("graphgrad KerasPlan on %s: optimizer built with %d method "
             "variables for fit", model.name,
             len(variables) - len(model.trainable_variables))

  def _task_losses(self) -> Optional[List[Any]]:
    return list(self._recorded) if self.has_tasks else None

  def _with_state(self, callbacks):
    callbacks = list(callbacks or [])
    at = [i for i, c in enumerate(callbacks) if _is_backup(c)]
    if at:  # right after the backup, so that both save at the same points
      callbacks.insert(at[0] + 1, PlanState(self, callbacks[at[0]]))
    return callbacks

  # -- per-output losses ---------------------------------------------------

  @contextlib.contextmanager
  def recording(self, y, y_pred):
    """Records each output's compiled loss while the step's loss is built."""
    if not self.has_tasks:
      yield
      return
    self._recorded = []
    with _recorded_losses(self.flavour, self.model, y, y_pred,
                          self._recorded):
      yield
    if len(self._recorded) < 2:
      raise _errors.GraphGradError(
          f"model.fit with combine_tasks/project_conflicts: the task losses "
          f"are the compiled per-output losses, but {len(self._recorded)} "
          f"output(s) have a loss. Compile a loss for each task output, "
          f"e.g. compile(loss=['mse', 'mse']) or a dict by output name.")


_MISSING = object()


def _reset_functions(model) -> None:
  """Drops the traced train step, so that the next fit traces the new one."""
  for name in ("train_function", "_train_function_cache"):
    if name in model.__dict__ or hasattr(model, name):
      try:
        setattr(model, name, None)
      except AttributeError:
        pass


def _built(optimizer) -> bool:
  inner = getattr(optimizer, "inner_optimizer", None)
  if getattr(optimizer, "built", False) or getattr(optimizer, "_built", False):
    return True
  return inner is not None and _built(inner)


def _first_batch(x, y, batch_size):
  if x is None:
    return None
  if isinstance(x, tf.data.Dataset):
    return next(iter(x))
  n = batch_size or 32
  head = lambda t: tf.nest.map_structure(  # noqa: E731
      lambda a: tf.convert_to_tensor(a[:n]), t)
  return (head(x),) if y is None else (head(x), head(y))


def _unpack(which: str, data):
  if which == "keras3":
    import keras  # pylint: disable=g-import-not-at-top
    return keras.utils.unpack_x_y_sample_weight(data)
  import tf_keras  # pylint: disable=g-import-not-at-top
  return tf_keras.utils.unpack_x_y_sample_weight(data)


def _loss(att: Attachment, x, y, y_pred, sample_weight):
  model = att.model
  with att.recording(y, y_pred):
    if att.flavour == "keras3":
      return model._compute_loss(  # pylint: disable=protected-access
          x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
    return model.compute_loss(x, y, y_pred, sample_weight)


@contextlib.contextmanager
def _recorded_losses(which: str, model, y, y_pred, out: list):
  """Wraps the compiled per-output loss functions to record their values.

  Keras computes the compiled losses output by output and returns only
  their weighted sum; the task losses of a combination are those values.
  """
  if which == "keras3":
    container = model._compile_loss  # pylint: disable=protected-access
    attr = "_flat_losses"
  else:
    container = model.compiled_loss
    attr = "_losses"
  if container is None:
    yield
    return
  if which == "keras3" and not container.built:
    container.build(y, y_pred)
  elif which == "tf_keras" and not container._built:  # pylint: disable=protected-access
    container.build(y_pred)  # as its __call__ does first
  entries = getattr(container, attr, None) or []

  def recorder(fn):
    def loss(*args, **kwargs):
      value = fn(*args, **kwargs)
      out.append(value)
      return value
    return loss

  saved = list(entries)
  if which == "keras3":
    entries[:] = [(path, recorder(fn), w, name)
                  for path, fn, w, name in saved]
  else:
    entries[:] = [None if fn is None else _Recorded(fn, recorder(fn))
                  for fn in saved]
  try:
    yield
  finally:
    entries[:] = saved


class _Recorded:
  """A tf-keras loss object whose call records; its other fields delegate."""

  def __init__(self, loss_obj, call):
    self._loss_obj = loss_obj
    self._call = call

  def __call__(self, *args, **kwargs):
    return self._call(*args, **kwargs)

  def __getattr__(self, name):
    return getattr(self._loss_obj, name)


# -- the train steps ---------------------------------------------------------

def _keras3_step(att: Attachment, data):
  """Keras 3's ``Model.train_step`` (TensorFlow backend) with the plan."""
  from keras.src import tree  # pylint: disable=g-import-not-at-top
  from keras.src.losses import loss as loss_module  # pylint: disable=g-import-not-at-top
  model = att.model
  x, y, sample_weight = _unpack("keras3", data)
  with att.tape(x, y) as tape:
    if model._call_has_training_arg:  # pylint: disable=protected-access
      y_pred = model(x, training=True)
    else:
      y_pred = model(x)
    loss = _loss(att, x, y, y_pred, sample_weight)
    model._loss_tracker.update_state(  # pylint: disable=protected-access
        loss_module.unscale_loss_for_distribution(loss),
        sample_weight=tf.shape(
            next(i for i in tree.flatten(x) if i is not None))[0])
    if model.optimizer is not None:
      loss = model.optimizer.scale_loss(loss)
  if model.trainable_weights:
    model.optimizer.apply_gradients(
        tape.grads_and_vars(loss, task_losses=att._task_losses()))  # pylint: disable=protected-access
  else:
    log.warning("graphgrad KerasPlan on %s: the model has no trainable "
                "weights.", model.name)
  return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


def _tf_keras_step(att: Attachment, data):
  """tf-keras' ``Model.train_step`` with the plan.

  ``optimizer.minimize(loss, tape=tape)`` is spelled out: scale the loss
  (a loss-scale optimizer), take the plan's gradients, unscale, apply.
  """
  model = att.model
  optimizer = model.optimizer
  x, y, sample_weight = _unpack("tf_keras", data)
  scaling = hasattr(optimizer, "get_scaled_loss")
  with att.tape(x, y) as tape:
    y_pred = model(x, training=True)
    loss = _loss(att, x, y, y_pred, sample_weight)
    target = optimizer.get_scaled_loss(loss) if scaling else loss
  model._validate_target_and_loss(y, loss)  # pylint: disable=protected-access
  pairs = tape.grads_and_vars(target, task_losses=att._task_losses())  # pylint: disable=protected-access
  if scaling:
    grads = optimizer.get_unscaled_gradients([g for g, _ in pairs])
    pairs = list(zip(grads, [v for _, v in pairs]))
  optimizer.apply_gradients(pairs)
  return model.compute_metrics(x, y, y_pred, sample_weight)


# -- the plan's state in BackupAndRestore's backups --------------------------

def _is_backup(callback) -> bool:
  return type(callback).__name__ == "BackupAndRestore" and hasattr(
      callback, "backup_dir")


def _tracked(attached: "Attachment") -> Dict[str, Any]:
  """What of the plan a backup saves: method variables and a step of its
  own (``optimizer.iterations`` is saved with the optimizer already)."""
  out: Dict[str, Any] = {"methods": attached.plan.method_variables}
  step = attached.step_tensor()
  if isinstance(step, tf.Variable):
    out["step"] = step
  return out


def _callback_base(backup):
  return type(backup).__mro__[1]


class PlanState:
  """Saves the plan's state beside a ``BackupAndRestore`` backup.

  Made by the attached ``fit`` when its callbacks hold a
  ``BackupAndRestore``; runs after it, on its schedule: it restores at the
  start of training what the last backup saved, saves after each epoch
  (and each ``save_freq`` batches) and deletes its files when training
  ends, as the backup does.
  """

  def __new__(cls, attached, backup):
    base = _callback_base(backup)
    kind = type("PlanStateCallback", (_PlanStateMixin, base), {})
    return kind(attached, backup)


class _PlanStateMixin:
  """The callback behind :class:`PlanState`, of the backup's Keras."""

  def __init__(self, attached, backup):
    super().__init__()
    self._attached = attached
    self._backup = backup
    self._dir = os.path.join(backup.backup_dir, "graphgrad_plan")
    self._batches = 0
    self._status = None

  def _checkpoint(self):
    return tf.train.Checkpoint(**_tracked(self._attached))

  def _prefix(self):
    return os.path.join(self._dir, "state")

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
    self._checkpoint().write(self._prefix())
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
