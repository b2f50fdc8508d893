"""One phase of an attached fit under MirroredStrategy on 2 logical CPUs.

``python keras_fit_worker.py FLAVOUR PHASE OUT BACKUP``: PHASE is ``whole``
(four epochs), ``interrupt`` (stops by an exception at the end of epoch 2,
after BackupAndRestore's backup) or ``resume`` (the same fit again, which
BackupAndRestore resumes). The final weights go to OUT (.npz).
"""

import importlib.util
import os
import sys

FLAVOUR, PHASE, OUT, BACKUP = sys.argv[1:5]
# TensorFlow 2.15's tf.keras is the Keras 2 it bundles, without tf-keras.
if FLAVOUR == "tf_keras" and importlib.util.find_spec("tf_keras"):
  os.environ["TF_USE_LEGACY_KERAS"] = "1"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import graphgrad as gg  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
if FLAVOUR == "tf_keras":
  K = tf.keras
else:
  import keras as K  # noqa: E402


class Annealed(gg.transforms.Transform):
  """``g / sqrt(1 + t)``: reads the global step, deterministically."""
  name = "annealed"
  reads_global_step = True

  def apply_dense(self, grad, context):
    t = tf.cast(context.global_step, grad.dtype)
    return grad / tf.sqrt(1.0 + t)


class Stop(K.callbacks.Callback):
  def on_epoch_end(self, epoch, logs=None):
    if epoch == 1:
      raise RuntimeError("interrupted on purpose")


rng = np.random.default_rng(0)
x = rng.normal(size=(64, 3)).astype(np.float32)
y = rng.normal(size=(64, 2)).astype(np.float32)
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
with strategy.scope():
  init = K.initializers.RandomNormal(stddev=0.5, seed=3)
  model = K.Sequential([
      K.Input((3,)),
      K.layers.Dense(5, activation="tanh", name="l1", kernel_initializer=init),
      K.layers.Dense(2, name="l2", kernel_initializer=init)])
  optimizer = K.optimizers.SGD(0.1)
  model.compile(optimizer, loss="mse")
plan = (gg.KerasPlan(model, global_step=optimizer.iterations)
        .transform_upstream("l2", gg.transforms.clip_by_norm(0.02))
        .transform_gradients("l1", Annealed()))
plan.attach()
callbacks = [] if PHASE == "whole" else [K.callbacks.BackupAndRestore(BACKUP)]
if PHASE == "interrupt":
  callbacks.append(Stop())
try:
  model.fit(x, y, batch_size=16, epochs=4, shuffle=False, verbose=0,
            callbacks=callbacks)
except RuntimeError as e:
  if "on purpose" not in str(e):
    raise
  print("INTERRUPTED at step", int(optimizer.iterations.numpy()))
np.savez(OUT, *model.get_weights(), step=int(optimizer.iterations.numpy()))
