"""Regenerates the pictures of the documentation, with graphgrad's own tools.

Run from the repository root: ``python docs/make_images.py``. It writes

* ``docs/img/layer_graph.png``: the layer graph of a small network with a skip
  connection and two heads (``LayerGraph.draw``);
* ``docs/img/cuts.png``: the same layer graph with a plan's rewrites
  highlighted (``GradientPlan.draw``);
* ``docs/img/gradient_flow.png`` and ``docs/img/gradient_flow.txt``: the
  picture and table of ``graphgrad grads`` on a saved ResNet-style model.
"""

import os
import subprocess
import sys
import tempfile

import numpy as np
import tensorflow as tf

import graphgrad as gg

tf1 = tf.compat.v1
IMG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "img")


def _dense(x, units, name, activation=None):
  rng = np.random.default_rng(len(name))
  with tf1.variable_scope(name):
    w = tf1.get_variable("kernel", initializer=rng.normal(
        size=(int(x.shape[-1]), units)).astype(np.float32) * 0.3)
    b = tf1.get_variable("bias", initializer=np.zeros(units, np.float32))
    out = tf.nn.bias_add(x @ w, b)
  return activation(out) if activation else out


def layer_graph_pictures():
  with tf.Graph().as_default():
    x = tf1.placeholder(tf.float32, [None, 8], name="x")
    h = _dense(x, 16, "encoder", tf.nn.relu)
    f = _dense(h, 16, "features", tf.nn.relu)
    label = _dense(f + h, 3, "label_head")          # skip: h bypasses features
    domain = _dense(f, 2, "domain_head")
    loss = tf.reduce_mean(tf.square(label)) + tf.reduce_mean(tf.square(domain))
    net = gg.analyze(loss)
    net.draw(os.path.join(IMG, "layer_graph.png"))
    plan = (gg.GradientPlan(loss, net)
            .transform_upstream("features", gg.transforms.clip_by_norm(1.0))
            .transform_edge("features", "domain_head",
                            gg.transforms.reverse()))
    plan.draw(os.path.join(IMG, "cuts.png"))
    print(net.summary())


def _conv(x, filters, name, scale=1.0):
  rng = np.random.default_rng(sum(map(ord, name)))
  fan_in = 9 * int(x.shape[-1])
  with tf1.variable_scope(name):
    w = tf1.get_variable("weights", initializer=(rng.normal(
        size=(3, 3, int(x.shape[-1]), filters)) * scale
        * np.sqrt(2.0 / fan_in)).astype(np.float32))
    b = tf1.get_variable("biases", initializer=np.zeros(filters, np.float32))
    return tf.nn.bias_add(tf.nn.conv2d(x, w, 1, "SAME"), b)


def save_resnet(directory):
  """A ResNet-style model; block2's second conv is initialised 1000x small."""
  with tf.Graph().as_default():
    images = tf1.placeholder(tf.float32, [None, 16, 16, 3], name="images")
    labels = tf1.placeholder(tf.int32, [None], name="labels")
    h = tf.nn.relu(_conv(images, 16, "stem"))
    for i in range(4):
      with tf1.variable_scope(f"block{i}"):
        r = tf.nn.relu(_conv(h, 16, "conv1"))
        h = tf.nn.relu(h + _conv(r, 16, "conv2",
                                 scale=1e-3 if i == 2 else 1.0))
    with tf1.variable_scope("head"):
      w = tf1.get_variable("kernel", initializer=np.random.default_rng(0)
                           .normal(size=(16, 10)).astype(np.float32) * 0.25)
      logits = tf.reduce_mean(h, [1, 2]) @ w
    tf1.losses.sparse_softmax_cross_entropy(labels, logits)
    saver = tf1.train.Saver()
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      prefix = saver.save(sess, os.path.join(directory, "resnet"))
  rng = np.random.default_rng(1)
  feed = os.path.join(directory, "batch.npz")
  np.savez(feed, images=rng.normal(size=(32, 16, 16, 3)).astype(np.float32),
           labels=rng.integers(0, 10, size=32).astype(np.int32))
  return prefix, feed


def gradient_flow_picture():
  with tempfile.TemporaryDirectory() as d:
    prefix, feed = save_resnet(d)
    out = subprocess.run(
        [sys.executable, "-m", "graphgrad", "grads", prefix + ".meta",
         "--checkpoint", prefix, "--feed", feed,
         "--png", os.path.join(IMG, "gradient_flow.png")],
        check=True, capture_output=True, text=True,
        env=dict(os.environ, PYTHONPATH=os.getcwd(), TF_CPP_MIN_LOG_LEVEL="3"))
  text = out.stdout.replace(d, "/tmp/model").replace(os.getcwd() + "/", "")
  with open(os.path.join(IMG, "gradient_flow.txt"), "w") as f:
    f.write(text)
  print(text)


if __name__ == "__main__":
  os.makedirs(IMG, exist_ok=True)
  layer_graph_pictures()
  gradient_flow_picture()
