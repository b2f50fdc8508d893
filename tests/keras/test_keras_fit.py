"""plan.attach(): model.fit, train_on_batch and evaluate run the plan.

References: the same plan in a hand-written GradientTape loop (float32, one
device, same weights and batches), and plain fit for the identity plan.
"""

import importlib.util
import logging
import zipfile

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from keras_cases import is_keras3, normal_rows

ROWS, BATCH = 32, 8
# TensorBoard's callback needs the tensorboard package's summary ops.
TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


def _model(K, outputs=1):
  init = K.initializers.RandomNormal(stddev=0.5, seed=3)
  inp = K.Input((3,))
  h = K.layers.Dense(5, activation="tanh", name="l1",
                     kernel_initializer=init)(inp)
  h = K.layers.Dense(4, activation="tanh", name="l2",
                     kernel_initializer=init)(h)
  outs = [K.layers.Dense(2, name=f"out{i}", kernel_initializer=init)(h)
          for i in range(outputs)]
  return K.Model(inp, outs if outputs > 1 else outs[0])


def _data(outputs=1):
  x = normal_rows(0, (ROWS, 3)).numpy()
  ys = [normal_rows(1 + i, (ROWS, 2)).numpy() for i in range(outputs)]
  return x, (ys if outputs > 1 else ys[0])


def _declare(plan):
  return (plan.transform_upstream("l2", gg.transforms.clip_by_norm(0.02))
          .transform_gradients("l1", gg.transforms.clip_by_norm(0.05)))


def _twin(K, model, outputs=1):
  twin = _model(K, outputs)
  twin.set_weights(model.get_weights())
  return twin


def _hand_loop(K, model, plan, x, y, epochs, weights=None, lr=0.1):
  """The plan in a hand-written tape loop: mse, SGD, batches in order."""
  opt = K.optimizers.SGD(lr)
  for _ in range(epochs):
    for i in range(0, ROWS, BATCH):
      xb, yb = x[i:i + BATCH], y[i:i + BATCH]
      with plan.tape() as tape:
        err = tf.square(model(xb, training=True) - yb)
        per = tf.reduce_mean(err, -1)
        if weights is None:
          loss = tf.reduce_mean(per)
        else:  # Keras' sum_over_batch_size of weighted per-example losses
          loss = tf.reduce_sum(per * weights[i:i + BATCH]) / len(xb)
      opt.apply_gradients(tape.grads_and_vars(loss))


def _max_diff(a, b):
  return max(float(np.max(np.abs(u - v))) for u, v in
             zip(a.get_weights(), b.get_weights()))


def _close(a, b):
  for u, v in zip(a.get_weights(), b.get_weights()):
    np.testing.assert_allclose(u, v, rtol=1e-6, atol=1e-7)


def test_the_train_step_follows_the_keras_version(K):
  # TensorFlow 2.15's keras is Keras 2: tf-keras' train step, not Keras 3's.
  from graphgrad.keras import _fit
  if is_keras3(K):
    want = "keras3"
  else:
    want = "tf_keras" if K.__name__.startswith("tf_keras") else "keras2"
  assert _fit.flavour(_model(K)) == want


def test_identity_plan_fit_equals_plain_fit(K):
  model = _model(K)
  plain = _twin(K, model)
  plan = gg.KerasPlan(model).transform_upstream(
      "l2", gg.transforms.identity()).attach()
  x, y = _data()
  for m in (model, plain):
    m.compile(K.optimizers.SGD(0.1), loss="mse")
    m.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0)
  _close(model, plain)
  assert plan.attached


@pytest.mark.parametrize("extra", [
    dict(), dict(jit_compile=True), dict(steps_per_execution=2)],
    ids=["default", "jit", "steps_per_execution"])
def test_fit_equals_the_plan_in_a_hand_loop(K, extra):
  model = _model(K)
  ref, plain = _twin(K, model), _twin(K, model)
  _declare(gg.KerasPlan(model)).attach()
  x, y = _data()
  model.compile(K.optimizers.SGD(0.1), loss="mse", metrics=["mae"], **extra)
  hist = model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False,
                   verbose=0, validation_data=(x[:8], y[:8]))
  _hand_loop(K, ref, _declare(gg.KerasPlan(ref)), x, y, 3)
  _close(model, ref)
  assert set(hist.history) >= {"loss", "mae", "val_loss", "val_mae"}
  # The plan matters: plain fit ends elsewhere.
  plain.compile(K.optimizers.SGD(0.1), loss="mse")
  plain.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0)
  assert _max_diff(model, plain) > 1e-3


def test_fit_with_sample_weight_callbacks_and_progress_bar(K, tmp_path):
  model = _model(K)
  ref = _twin(K, model)
  _declare(gg.KerasPlan(model)).attach()
  x, y = _data()
  w = np.linspace(0.5, 2.0, ROWS).astype(np.float32)
  model.compile(K.optimizers.SGD(0.1), loss="mse")
  suffix = ".weights.h5" if K.__name__.startswith("keras") else ".h5"
  callbacks = [
      K.callbacks.ModelCheckpoint(str(tmp_path / f"ckpt{suffix}"),
                                  save_weights_only=True),
      K.callbacks.EarlyStopping(monitor="loss", patience=5)]
  if TENSORBOARD:
    callbacks.append(K.callbacks.TensorBoard(str(tmp_path / "tb")))
  model.fit(x, y, sample_weight=w, batch_size=BATCH, epochs=2,
            shuffle=False, verbose=1, callbacks=callbacks)
  _hand_loop(K, ref, _declare(gg.KerasPlan(ref)), x, y, 2, weights=w)
  _close(model, ref)
  assert (tmp_path / f"ckpt{suffix}").exists()
  assert not TENSORBOARD or any((tmp_path / "tb").iterdir())


def test_train_on_batch_evaluate_and_detach(K):
  model = _model(K)
  ref, plain_ref = _twin(K, model), _twin(K, model)
  plan = _declare(gg.KerasPlan(model)).attach()
  x, y = _data()
  model.compile(K.optimizers.SGD(0.1), loss="mse")
  for i in range(0, ROWS, BATCH):
    model.train_on_batch(x[i:i + BATCH], y[i:i + BATCH])
  _hand_loop(K, ref, _declare(gg.KerasPlan(ref)), x, y, 1)
  _close(model, ref)
  loss = model.evaluate(x, y, verbose=0)
  expected = float(tf.reduce_mean(tf.square(ref(x) - y)))
  np.testing.assert_allclose(loss, expected, rtol=1e-5)
  # detach(): the model's own train_step again.
  plan.detach()
  assert not plan.attached and "train_step" not in model.__dict__
  plain_ref.set_weights(model.get_weights())
  model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
  plain_ref.compile(K.optimizers.SGD(0.1), loss="mse")
  plain_ref.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
  _close(model, plain_ref)


def _pcgrad_at(plan, at):
  layers = "l2" if at == "output" else None
  return plan.combine_tasks(layers, gg.mtl.pcgrad(), at=at)


@pytest.mark.parametrize("at", ["output", "parameters"])
def test_multi_output_tasks_come_from_the_compiled_losses(K, at):
  model = _model(K, outputs=2)
  ref = _twin(K, model, outputs=2)
  _pcgrad_at(gg.KerasPlan(model), at).attach()
  x, (ya, yb) = _data(outputs=2)
  model.compile(K.optimizers.SGD(0.1), loss=["mse", "mse"],
                loss_weights=[1.0, 0.5])
  model.fit(x, [ya, yb], batch_size=BATCH, epochs=2, shuffle=False,
            verbose=0)
  plan = _pcgrad_at(gg.KerasPlan(ref), at)
  opt = K.optimizers.SGD(0.1)
  for _ in range(2):
    for i in range(0, ROWS, BATCH):
      s = slice(i, i + BATCH)
      with plan.tape() as tape:
        pa, pb = ref(x[s], training=True)
        la = tf.reduce_mean(tf.square(pa - ya[s]))
        lb = tf.reduce_mean(tf.square(pb - yb[s]))
        loss = la + 0.5 * lb
      opt.apply_gradients(tape.grads_and_vars(loss, task_losses=[la, lb]))
  _close(model, ref)


def _regularized(K, loss, loss_weights):
  """Two outputs and a kernel regularizer, compiled."""
  init = K.initializers.RandomNormal(stddev=0.5, seed=3)
  inp = K.Input((3,))
  h = K.layers.Dense(4, activation="tanh", name="l2", kernel_initializer=init,
                     kernel_regularizer=K.regularizers.L2(0.01))(inp)
  outs = [K.layers.Dense(2, name=f"out{i}", kernel_initializer=init)(h)
          for i in range(2)]
  model = K.Model(inp, outs)
  model.compile(K.optimizers.SGD(0.1), loss=loss, loss_weights=loss_weights)
  return model


@pytest.mark.parametrize("loss", [["mse", "mae"], "mse", "dict"])
def test_task_losses_sum_to_keras_own_compiled_loss(K, loss):
  from graphgrad.keras import _fit
  kind = "list" if isinstance(loss, list) else loss
  model = _regularized(K, loss, None)
  names = list(model.output_names)
  if loss == "dict":
    loss = {names[0]: "mae", names[1]: K.losses.MeanSquaredError()}
  weights = None if kind == "mse" else {names[0]: 0.3, names[1]: 2.0}
  wa, wb = (1.0, 1.0) if weights is None else (0.3, 2.0)
  model = _regularized(K, loss, weights)
  x, (ya, yb) = _data(outputs=2)
  sw = np.linspace(0.5, 1.5, ROWS).astype(np.float32)
  y_pred = model(x, training=True)
  targets = [tf.constant(ya), tf.constant(yb)]  # as fit passes them
  pairs = _fit.output_losses(model, targets, y_pred, tf.constant(sw),
                             model.get_compile_config()["loss_weights"])
  assert [w for _, w in pairs] == ([None, None] if weights is None
                                   else [0.3, 2.0])
  mine = _fit.compiled_total(model, pairs)
  keras_own = model.compute_loss(x, targets, y_pred, tf.constant(sw))
  np.testing.assert_allclose(float(mine), float(keras_own), rtol=1e-6)
  # Independently: numpy from the equations of mse, mae and the penalties.
  pa, pb = (np.asarray(p) for p in y_pred)
  fa, fb = {"list": (np.square, np.abs), "mse": (np.square, np.square),
            "dict": (np.abs, np.square)}[kind]
  per_a = fa(pa - ya).mean(-1)
  per_b = fb(pb - yb).mean(-1)
  kernel = np.asarray(model.layers[1].kernel)
  want = (wa * (per_a * sw).sum() / ROWS + wb * (per_b * sw).sum() / ROWS
          + 0.01 * np.square(kernel).sum())
  np.testing.assert_allclose(float(mine), want, rtol=1e-5)


def test_task_losses_refuse_what_they_cannot_resolve(K):
  model = _model(K, outputs=2)
  gg.KerasPlan(model).project_conflicts("l2").attach()
  model.compile(K.optimizers.SGD(0.1), loss=[["mse"], "mse"])
  x, (ya, yb) = _data(outputs=2)
  with pytest.raises(gg.GraphGradError, match=r"one loss per model output.*"
                     r"received loss=.*'mse'.*: a nested structure"):
    model.fit(x, [ya, yb], batch_size=BATCH, epochs=1, verbose=0)
  if is_keras3(K):
    model = _model(K, outputs=2)
    gg.KerasPlan(model).project_conflicts("l2").attach()
    model.compile(K.optimizers.SGD(0.1), loss=["crossentropy", "mse"])
    with pytest.raises(gg.GraphGradError, match="picks its loss from the "
                       "data; name the crossentropy"):
      model.fit(x, [ya, yb], batch_size=BATCH, epochs=1, verbose=0)

  from graphgrad.keras import _fit
  y_pred = model(x)
  with pytest.raises(gg.GraphGradError, match=r"loss keys \['nope'\] are "
                     r"not the output names"):
    model.loss = {"nope": "mse"}
    _fit.output_losses(model, [ya, yb], y_pred, None)
  with pytest.raises(gg.GraphGradError, match="1 targets for 2 outputs"):
    model.loss = ["mse", "mse"]
    _fit.output_losses(model, [ya], y_pred, None)

  class Own(K.Model):
    def compute_loss(self, *args, **kwargs):  # pylint: disable=useless-parent-delegation
      return super().compute_loss(*args, **kwargs)

  inner = _model(K, outputs=2)
  model = Own(inner.inputs, inner.outputs)
  gg.KerasPlan(model).project_conflicts("l2").attach()
  model.compile(K.optimizers.SGD(0.1), loss=["mse", "mse"])
  with pytest.raises(gg.GraphGradError, match="overrides compute_loss"):
    model.fit(x, [ya, yb], batch_size=BATCH, epochs=1, verbose=0)


def test_synthetic_modules_are_trained_by_fit(K):
  model = _model(K)
  ref = _twin(K, model)
  plan = gg.KerasPlan(model).replace_backward(
      "l2", gg.backward.synthetic(seed=4)).attach()
  x, y = _data()
  model.compile(K.optimizers.SGD(0.1), loss="mse")
  model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
  ref_plan = gg.KerasPlan(ref).replace_backward(
      "l2", gg.backward.synthetic(seed=4))
  _hand_loop(K, ref, ref_plan, x, y, 2)
  _close(model, ref)
  mine = plan.method_variables.by_key
  theirs = ref_plan.method_variables.by_key
  assert mine and sorted(mine) == sorted(theirs)
  for key, var in mine.items():
    np.testing.assert_allclose(var.numpy(), theirs[key].numpy(), rtol=1e-6,
                               atol=1e-7)
  # The modules moved from their initial values.
  fresh = gg.KerasPlan(_twin(K, ref)).replace_backward(
      "l2", gg.backward.synthetic(seed=4))
  with fresh.tape() as tape:
    loss = tf.reduce_mean(tf.square(fresh.model(x[:BATCH]) - y[:BATCH]))
  tape.gradient(loss)
  assert any(np.max(np.abs(v.numpy() - fresh.method_variables.by_key[k]
                           .numpy())) > 1e-4 for k, v in mine.items())


class _Stop(Exception):
  pass


def _stopper(K, at_epoch):
  class Stop(K.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
      if epoch == at_epoch:
        raise _Stop()
  return Stop()


def test_backup_and_restore_resumes_gradvac_state_exactly(K, tmp_path):
  x, (ya, yb) = _data(outputs=2)

  def fit(model, callbacks, epochs=4):
    plan = gg.KerasPlan(model).combine_tasks("l2", gg.mtl.gradvac()).attach()
    model.compile(K.optimizers.SGD(0.1), loss=["mse", "mse"])
    model.fit(x, [ya, yb], batch_size=BATCH, epochs=epochs, shuffle=False,
              verbose=0, callbacks=callbacks)
    return plan

  whole = _model(K, outputs=2)
  start = whole.get_weights()
  fit(whole, [])
  backup = str(tmp_path / "backup")
  broken = _model(K, outputs=2)
  broken.set_weights(start)
  with pytest.raises(_Stop):
    fit(broken, [K.callbacks.BackupAndRestore(backup), _stopper(K, 1)])
  resumed = _model(K, outputs=2)
  resumed.set_weights(start)
  plan = fit(resumed, [K.callbacks.BackupAndRestore(backup)])
  _close(resumed, whole)
  assert plan.method_variables.states  # GradVac's state exists


def test_trained_model_saves_and_loads_with_keras_alone(K, tmp_path):
  model = _model(K)
  _declare(gg.KerasPlan(model)).attach()
  x, y = _data()
  model.compile(K.optimizers.SGD(0.1), loss="mse")
  model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
  path = str(tmp_path / "m.keras")
  model.save(path)
  with zipfile.ZipFile(path) as z:
    text = b"".join(z.read(n) for n in z.namelist())
  assert b"graphgrad" not in text
  loaded = K.models.load_model(path)
  _close(loaded, model)


def test_attach_errors(K):
  model = _model(K)
  plan = gg.KerasPlan(model).attach()
  with pytest.raises(gg.GraphGradError, match="already attached"):
    plan.attach()
  layer_plan = gg.KerasPlan(K.layers.Dense(2))
  with pytest.raises(gg.GraphGradError, match="must be a Keras 3 or tf-keras "
                     "Model with a train_step"):
    layer_plan.attach()
  one = _model(K)
  gg.KerasPlan(one).project_conflicts("l2").attach()
  one.compile(K.optimizers.SGD(0.1), loss="mse")
  x, y = _data()
  with pytest.raises(gg.GraphGradError, match="1 output"):
    one.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)


def test_tf_keras_fit_without_targets_is_refused():
  K = pytest.importorskip("tf_keras")
  model = _model(K)
  gg.KerasPlan(model).attach()
  model.compile(K.optimizers.SGD(0.1), loss="mse")
  x, _ = _data()
  with pytest.raises(gg.GraphGradError, match="y \\(the targets\\) must be "
                     "given.*received no targets"):
    model.fit(x, batch_size=BATCH, epochs=1, verbose=0)


def test_fit_logs_nothing_at_warning_level(K, caplog):
  model = _model(K)
  _declare(gg.KerasPlan(model)).attach()
  x, y = _data()
  model.compile(K.optimizers.SGD(0.1), loss="mse")
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
  assert not caplog.records


def test_a_second_plan_is_refused_and_attached_tells_what_fit_runs(K):
  model = _model(K)
  model.compile(K.optimizers.SGD(0.1), loss="mse")
  x, y = _data()
  first = gg.KerasPlan(model).attach()
  # The second plan freezes l2: its parameters get a zero gradient.
  second = gg.KerasPlan(model).transform_gradients("l2", gg.transforms.zero())
  with pytest.raises(gg.GraphGradError,
                     match=r"plan\.attach\(\): the model \S+ already has a "
                     r"plan attached \(KerasPlan.*\); attaching a second "
                     r"would replace it .* Call detach\(\) on the attached "
                     r"plan first"):
    second.attach()
  assert first.attached and not second.attached
  first.detach()
  second.attach()
  assert second.attached and not first.attached
  first.detach()  # not attached: changes nothing
  assert second.attached
  l2 = [w.numpy() for w in model.get_layer("l2").weights]
  l1 = [w.numpy() for w in model.get_layer("l1").weights]
  model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
  for before, w in zip(l2, model.get_layer("l2").weights):
    np.testing.assert_array_equal(before, w.numpy())  # second's plan ran
  assert any(not np.array_equal(a, w.numpy())
             for a, w in zip(l1, model.get_layer("l1").weights))
  # A train_step put on the model since: the plan no longer runs in fit.
  model.__dict__.pop("train_step")
  assert not second.attached


def test_an_optimizer_acting_in_compute_gradients_is_refused(K):
  """As tensorflow_privacy's DP Keras optimizers: clip and noise where the
  gradients are computed, which the plan's step never calls."""
  base = K.optimizers.SGD

  class DPSGDLike(base):
    def compute_gradients(self, *args, **kwargs):  # tf-keras' hook
      raise AssertionError("never called by a plan")

    def get_gradients(self, *args, **kwargs):
      raise AssertionError("never called by a plan")

  class HorovodLike(DPSGDLike):
    def _aggregate_gradients(self, grads_and_vars):  # reduces here too
      return [g for g, _ in grads_and_vars]

  model = _model(K)
  gg.KerasPlan(model).attach()
  x, y = _data()
  model.compile(DPSGDLike(0.1), loss="mse")
  with pytest.raises(gg.GraphGradError,
                     match=r"the optimizer DPSGDLike overrides "
                     r"compute_gradients \(in DPSGDLike\), which the plan's "
                     r"train step never calls.*plan\.privatize\(l2_norm_clip, "
                     r"noise_multiplier\)"):
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
  from graphgrad.keras import _fit  # pylint: disable=g-import-not-at-top
  _fit.check_gradient_step(HorovodLike(0.1))  # accepted
  _fit.check_gradient_step(K.optimizers.Adam(0.1))
