"""Recompute's policy: what the backward pass keeps, and which ops rerun.

Both executors recompute forward work in the backward pass: the TF1 plan
copies the forward ops between kept tensors (``plan._recompute``), the
Keras tape replays the layer calls between kept outputs
(``keras._tape_recompute``). Their shared rules are written here once,
against plain values: a tensor's bytes (:func:`tensor_bytes`), the items no
skip connection jumps over (:func:`articulations`), ``keep=None``'s choice
among them (:func:`spread_kept`), which op types may run a second time
(:func:`reruns`) and the kinds of a ``keep=`` item (:func:`keep_item_kind`).
Each executor reads its own structures (ops, layer calls) into these values.
"""

import math
from typing import Any, List, Sequence

import tensorflow as tf

__all__ = ["RANDOM", "VARIABLE_GATHERS", "VARIABLE_READS", "VARIABLE_WRITES",
           "articulations", "keep_item_kind", "reruns", "spread_kept",
           "tensor_bytes"]

# Stateful ops that read a variable at the ids an activation gives.
VARIABLE_GATHERS = frozenset({"ResourceGather", "ResourceGatherNd"})
# Stateful ops that only read (or name) a variable: run again in the
# backward pass, they give the forward's value (no update runs before the
# gradient is done).
VARIABLE_READS = VARIABLE_GATHERS | {"ReadVariableOp", "VarHandleOp"}
# Stateful ops that write a variable: run again, they write it twice,
# unless the executor restores what the forward left (a Keras replay does).
VARIABLE_WRITES = frozenset({"AssignVariableOp", "AssignAddVariableOp",
                             "AssignSubVariableOp"})
# Stateful random ops: run again, they draw new values.
RANDOM = frozenset({
    "RandomUniform", "RandomUniformInt", "RandomStandardNormal",
    "TruncatedNormal", "ParameterizedTruncatedNormal", "RandomGamma",
    "RandomPoisson", "RandomPoissonV2", "Multinomial", "RandomShuffle",
    "StatefulUniform", "StatefulUniformInt", "StatefulUniformFullInt",
    "StatefulStandardNormal", "StatefulStandardNormalV2",
    "StatefulTruncatedNormal", "StatefulRandomBinomial"})


def reruns(op_type: str, stateful: bool, restores_state: bool = False
           ) -> bool:
  """Whether an op may run a second time, in the backward pass.

  A stateless op may; so may a variable read. A variable write may only
  where the executor restores the state the forward left after the rerun.
  Any other stateful op (a random op, a counter, a queue, a stateful
  function call) would change its value or its effect.

  Args:
    op_type: the op's type (``op.type``).
    stateful: whether its op def is stateful (``op.op_def.is_stateful``).
    restores_state: whether the rerun's writes to variables are undone.

  Returns:
    True if the rerun gives the forward's values and effects.

  Example:
    >>> reruns("MatMul", False), reruns("ReadVariableOp", True)
    (True, True)
    >>> reruns("AssignVariableOp", True), reruns("RandomUniform", True)
    (False, False)
    >>> reruns("AssignVariableOp", True, restores_state=True)
    True
  """
  if not stateful or op_type in VARIABLE_READS:
    return True
  return restores_state and op_type in VARIABLE_WRITES


def tensor_bytes(t: Any) -> int:
  """Static size of ``t`` in bytes; an unknown dimension counts as 1.

  Args:
    t: a tensor (``shape`` and ``dtype``); of unknown rank, one element.

  Example:
    >>> tensor_bytes(tf.TensorSpec([None, 3], tf.float32))
    12
  """
  if t.shape.rank is None:
    return t.dtype.size
  return math.prod(d if d is not None else 1 for d in t.shape.as_list()) \
      * t.dtype.size


def articulations(last: Sequence[int]) -> List[int]:
  """The positions that no reader jumps over, in a forward order.

  Position ``i`` is one when everything made before it is read at ``i`` or
  before, and what it makes is read after it: only its outputs cross it (a
  residual unit's output, never a tensor inside the unit, which the skip
  connection jumps over).

  Args:
    last: for each position, the last position that reads what it makes
      (itself or less when nothing does).

  Returns:
    The articulation positions, in order.

  Example:
    >>> articulations([1, 2, 3, 3])  # a chain: each read by the next
    [0, 1, 2]
    >>> articulations([2, 2, 3, 3])  # 0 read by 1 and by 2: skips 1
    [0, 2]
  """
  found: List[int] = []
  reach = -1  # the last position that reads anything made so far
  for i, j in enumerate(last):
    if reach <= i and j > i:
      found.append(i)
    reach = max(reach, j)
  return found


def spread_kept(sizes: Sequence[int], candidates: Sequence[int], n: int
                ) -> List[int]:
  """``keep=None``'s choice: about ``sqrt(n)`` blocks of equal bytes.

  Walking the items in forward order, a block is closed at the first
  candidate where the bytes since the last kept item reach
  ``total / sqrt(n)`` (Chen et al. 2016's greedy choice).

  Args:
    sizes: each item's activation bytes, in forward order.
    candidates: the positions that may be kept (the :func:`articulations`,
      less what the executor cannot keep), in order.
    n: the count whose square root is the number of blocks (layers or
      layer calls).

  Returns:
    The kept positions, in order.

  Example:
    >>> spread_kept([4, 4, 4, 4, 4, 4, 4, 4, 4], range(8), 9)
    [2, 5]
  """
  budget = sum(sizes) / max(1.0, math.sqrt(n))
  allowed = set(candidates)
  kept: List[int] = []
  run = 0
  for i, size in enumerate(sizes):
    run += size
    if i in allowed and run >= budget:
      kept.append(i)
      run = 0
  return kept


def keep_item_kind(item: Any) -> str:
  """The kind of one item of ``recompute(keep=...)``, which a plan reads.

  Returns:
    ``"tensor name"`` for a string with a ``:`` (``"l1/Relu:0"``),
    ``"name"`` for another string (a layer's or an op's), ``"eager tensor"``
    for a ``tf.Tensor`` holding a value, ``"graph tensor"`` for a symbolic
    ``tf.Tensor`` (of a tf.Graph or a traced step), ``"symbolic"`` for
    another value with a shape and a dtype (a Keras tensor) and
    ``"reference"`` for anything else (a layer).

  Example:
    >>> [keep_item_kind(i) for i in ("l1/Relu:0", "l1", tf.ones([1]), 3)]
    ['tensor name', 'name', 'eager tensor', 'reference']
  """
  if isinstance(item, str):
    return "tensor name" if ":" in item else "name"
  if isinstance(item, tf.Tensor):
    return "graph tensor" if tf.is_symbolic_tensor(item) else "eager tensor"
  if hasattr(item, "shape") and hasattr(item, "dtype"):
    return "symbolic"
  return "reference"
