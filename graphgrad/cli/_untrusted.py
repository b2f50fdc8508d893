"""What ``graphgrad grads`` runs of a saved graph, and what it refuses to run.

``grads`` runs the variables' initializers, a restore of ``--checkpoint``
by its own ``Saver``, and the loss's forward and backward pass: the ops the
loss and those initializers depend on, through data inputs and control
dependencies, fed placeholders cut off. A graph from elsewhere can hide
anything there. :func:`refuse_io` refuses to run one that reads, writes or
lists files, reads a file-backed dataset or reader, saves or restores a
checkpoint, writes a summary or prints, unless ``--allow-io`` says so.
"""

from typing import Dict, Iterable, List, Optional, Set

import tensorflow as tf

# op type -> what it does. Resource-variant names (ReaderReadV2,
# WriteScalarSummary, ...) are matched by the prefixes below.
_IO_TYPES: Dict[str, str] = {
    "WriteFile": "writes a file",
    "ReadFile": "reads a file",
    "MatchingFiles": "lists files",
    "SaveV2": "saves a checkpoint", "Save": "saves a checkpoint",
    "SaveSlices": "saves a checkpoint",
    "MergeV2Checkpoints": "writes a checkpoint",
    "RestoreV2": "restores a checkpoint", "Restore": "restores a checkpoint",
    "RestoreSlice": "restores a checkpoint",
    "PrintV2": "prints", "Print": "prints",
    "TFRecordDataset": "reads files", "TFRecordDatasetV2": "reads files",
    "TextLineDataset": "reads files",
    "FixedLengthRecordDataset": "reads files",
    "FixedLengthRecordDatasetV2": "reads files",
    "OneShotIterator": "runs an input pipeline",
    "IteratorGetNext": "runs an input pipeline",
    "IteratorGetNextSync": "runs an input pipeline",
    "ImportEvent": "writes a summary",
}
_IO_PREFIXES = (("Write", "Summary", "writes a summary"),
                ("", "SummaryWriter", "writes a summary"),
                ("", "ReaderV2", "reads files"), ("", "Reader", "reads files"),
                ("ReaderRead", "", "reads files"),
                ("CreateSummary", "", "writes a summary"),
                ("FlushSummary", "", "writes a summary"),
                ("CloseSummary", "", "writes a summary"))
_CALLS = frozenset({"PartitionedCall", "StatefulPartitionedCall"})


def io_kind(op_type: str) -> Optional[str]:
  """What an op of ``op_type`` does outside the process, or ``None``.

  Example:
    >>> io_kind("WriteFile"), io_kind("WriteScalarSummary"), io_kind("MatMul")
    ('writes a file', 'writes a summary', None)
  """
  if op_type in _IO_TYPES:
    return _IO_TYPES[op_type]
  for head, tail, kind in _IO_PREFIXES:
    if op_type.startswith(head) and op_type.endswith(tail) and (head or tail):
      return kind
  return None


def ops_run(fetches: Iterable[tf.Operation],
            fed: Iterable[tf.Tensor] = ()) -> List[tf.Operation]:
  """The ops a ``Session.run`` of ``fetches`` runs: their data inputs and
  control dependencies, transitively, not behind a ``fed`` tensor."""
  fed_names = {t.name for t in fed}
  seen: Set[tf.Operation] = set()
  stack = list(fetches)
  while stack:
    op = stack.pop()
    if op in seen:
      continue
    seen.add(op)
    stack += [t.op for t in op.inputs if t.name not in fed_names]
    stack += list(op.control_inputs)
  return sorted(seen, key=lambda o: o.name)


def io_op(ops: List[tf.Operation]) -> Optional[tuple]:
  """``(op name, op type, what it does)`` of the first op in ``ops`` that
  does I/O, looking into the bodies of the functions they call; else
  ``None``."""
  for op in ops:
    kind = io_kind(op.type)
    if kind:
      return op.name, op.type, kind
  calls = [op for op in ops if op.type in _CALLS or op.type in (
      "If", "StatelessIf", "While", "StatelessWhile", "Case")]
  if not calls:
    return None
  library = {f.signature.name: f for f in
             calls[0].graph.as_graph_def().library.function}
  todo = [(op.name, a.func.name) for op in calls
          for a in op.node_def.attr.values() if a.func.name]
  seen = set()
  while todo:
    caller, name = todo.pop()
    if name in seen or name not in library:
      continue
    seen.add(name)
    for node in library[name].node_def:
      kind = io_kind(node.op)
      if kind:
        return f"{caller} (in {name}: {node.name})", node.op, kind
      todo += [(caller, a.func.name) for a in node.attr.values()
               if a.func.name]
  return None


def variables_read(graph: tf.Graph, loss: tf.Tensor, feed) -> List:
  """The global variables whose ops the loss's computation runs: the only
  ones ``grads`` initializes."""
  needed = set(ops_run([loss.op], list(feed)))
  return [v for v in graph.get_collection(
      tf.compat.v1.GraphKeys.GLOBAL_VARIABLES) if v.op in needed]
