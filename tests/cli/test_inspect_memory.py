"""graphgrad inspect --memory: activation bytes and the recompute estimate."""

import re

import tensorflow as tf

from graphgrad.cli import _main as _cli
from helpers import dense

tf1 = tf.compat.v1


def test_inspect_memory_prints_bytes_and_both_peaks(tmp_path, capsys):
  with tf.Graph().as_default():
    x = tf1.placeholder(tf.float32, [None, 4], name="x")
    h = x
    for i in range(4):
      h = dense(h, 4, f"l{i}", tf.tanh)
    loss = tf.reduce_sum(tf.square(h), name="loss")
    tf1.add_to_collection(tf1.GraphKeys.LOSSES, loss)
    path = str(tmp_path / "model.meta")
    tf1.train.export_meta_graph(path)
  assert _cli.main(["inspect", path, "--memory-report"]) == 0
  out = capsys.readouterr().out
  # Per example (unknown batch): MatMul, BiasAdd, Tanh of 4 floats each.
  assert re.search(r"^  l0\s+48$", out, re.M), out
  assert "per example: the batch dimension is unknown" in out
  assert re.search(r"without recompute: [\d,]+ bytes", out)
  assert re.search(r"with recompute\(\):  [\d,]+ bytes \(\d+ kept", out)
