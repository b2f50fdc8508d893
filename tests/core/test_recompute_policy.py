"""Recompute's policy: bytes, articulations, the keep=None choice, reruns.

References are counted by hand: the bytes from shapes, the articulations
from which item reads which, the kept blocks from running byte sums.
"""

import pytest
import tensorflow as tf

from graphgrad.core import _recompute_policy as policy

tf1 = tf.compat.v1


@pytest.mark.parametrize("shape,dtype,want", [
    ([4, 8], tf.float32, 128),
    ([None, 8], tf.float16, 16),  # the batch counts 1: per example
    ([], tf.float64, 8),
    (None, tf.float32, 4),  # unknown rank: one element
])
def test_tensor_bytes(shape, dtype, want):
  assert policy.tensor_bytes(tf.TensorSpec(shape, dtype)) == want


def test_articulations_of_a_chain_and_of_a_residual_unit():
  # 0 -> 1 -> 2 -> 3: every item but the last (read by nothing after it).
  assert policy.articulations([1, 2, 3, 3]) == [0, 1, 2]
  # stem 0, unit 1-2 with 0 read by the add at 3, then 4: the skip from 0
  # to 3 jumps over 1 and 2.
  assert policy.articulations([3, 2, 3, 4, 4]) == [0, 3]
  # A reader that jumps several items ahead still lets the item it starts
  # from be kept (only its outputs cross it).
  assert policy.articulations([0, 3, 3, 3]) == [1]


def test_spread_kept_closes_blocks_every_total_over_sqrt_n_bytes():
  # 16 items of 10 bytes, n=16: blocks of 160 / 4 = 40 bytes.
  assert policy.spread_kept([10] * 16, range(15), 16) == [3, 7, 11]
  # Only candidates end a block: the bytes run on until the next one.
  assert policy.spread_kept([10] * 16, [5, 6, 12], 16) == [5, 12]
  # 127 bytes, n=4: blocks of 63.5 bytes. Narrowing, the first item fills
  # one; widening, no candidate reaches one before the last item.
  assert policy.spread_kept([64, 32, 16, 8, 4, 2, 1], range(6), 4) == [0]
  assert policy.spread_kept([1, 2, 4, 8, 16, 32, 64], range(6), 4) == []
  assert policy.spread_kept([], [], 0) == []


def test_reruns():
  assert policy.reruns("MatMul", False)
  for op in ("ReadVariableOp", "VarHandleOp", "ResourceGather"):
    assert policy.reruns(op, True)
  assert not policy.reruns("AssignAddVariableOp", True)
  assert policy.reruns("AssignAddVariableOp", True, restores_state=True)
  for op in ("RandomUniform", "StatefulPartitionedCall", "QueueDequeueV2"):
    assert not policy.reruns(op, True, restores_state=True)


def test_every_random_op_is_stateful_and_reads_are_stateful():
  # The sets name real ops of their kind: a random op that were stateless
  # would rerun with the forward's values, and need no set.
  from tensorflow.python.framework import op_def_registry  # pylint: disable=g-direct-tensorflow-import
  for name in policy.RANDOM | policy.VARIABLE_READS | policy.VARIABLE_WRITES:
    assert op_def_registry.get(name).is_stateful, name


def test_keep_item_kind():
  with tf.Graph().as_default():
    graph_tensor = tf1.placeholder(tf.float32, [2])
  assert [policy.keep_item_kind(i) for i in (
      "l1/Relu:0", "l1", tf.ones([1]), graph_tensor,
      tf.TensorSpec([1], tf.float32), object())] == [
          "tensor name", "name", "eager tensor", "graph tensor", "symbolic",
          "reference"]
