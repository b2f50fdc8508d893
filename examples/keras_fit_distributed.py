"""Trains a Keras model with ``model.fit`` through a KerasPlan, on 2 replicas.

``tf.distribute.MirroredStrategy`` over two logical CPUs (``--replicas``),
``plan.attach()`` so that ``fit`` runs the plan, and ``BackupAndRestore`` so
that an interrupted run resumes where it stopped. Run it from a checkout::

  python examples/keras_fit_distributed.py [--epochs 3] [--backup DIR]

It prints the loss of each epoch and, at the end, ``final loss``.
"""

import argparse
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--epochs", type=int, default=3)
  parser.add_argument("--replicas", type=int, default=2)
  parser.add_argument("--backup", default=None,
                      help="BackupAndRestore directory (default: a new "
                      "temporary one)")
  args = parser.parse_args(argv)
  cpu = tf.config.list_physical_devices("CPU")[0]
  tf.config.set_logical_device_configuration(
      cpu, [tf.config.LogicalDeviceConfiguration()] * args.replicas)
  import keras  # pylint: disable=g-import-not-at-top

  import graphgrad as gg  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(0)
  x = rng.normal(size=(256, 8)).astype(np.float32)
  y = (x[:, :1] > 0).astype(np.float32)
  devices = [f"/cpu:{i}" for i in range(args.replicas)]
  strategy = tf.distribute.MirroredStrategy(devices)
  with strategy.scope():
    model = keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(16, activation="relu", name="l1"),
        keras.layers.Dense(16, activation="relu", name="l2"),
        keras.layers.Dense(1, name="head")])
    model.compile(keras.optimizers.SGD(0.1),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True),
                  metrics=["accuracy"])
  plan = (gg.KerasPlan(model)
          .transform_upstream("head", gg.transforms.scale(0.5))
          .transform_upstream("l2", gg.transforms.clip_by_norm(1.0)))
  plan.attach()
  backup = args.backup or tempfile.mkdtemp(prefix="graphgrad-backup-")
  history = model.fit(x, y, batch_size=32, epochs=args.epochs, verbose=0,
                      callbacks=[keras.callbacks.BackupAndRestore(backup)])
  for epoch, loss in enumerate(history.history["loss"]):
    print(f"epoch {epoch + 1}: loss {loss:.4f}")
  print(f"final loss {history.history['loss'][-1]:.4f} on "
        f"{strategy.num_replicas_in_sync} replicas")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
