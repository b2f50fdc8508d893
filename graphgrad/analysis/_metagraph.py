"""Saved MetaGraphs: load one into a fresh graph and find its loss.

Used by ``graphgrad inspect``. A legacy TF1 training graph rarely says which
tensor is its loss, so :func:`guess_loss` looks where TF1 code puts it: the
``LOSSES`` collection that ``tf.compat.v1.losses`` fills, and otherwise a
scalar floating-point op whose name says ``loss`` or ``cost``.
"""

import os
import re
from typing import List, Tuple

import tensorflow as tf

from graphgrad import _compat, _errors
from graphgrad.analysis import _graph_util

_LOSS_NAME = re.compile(r"(loss|cost|objective)", re.IGNORECASE)
# Scopes of ops that a training graph adds after the loss.
_AFTER_LOSS = re.compile(r"(^|/)(gradients|train|Adam|RMSProp|Adagrad|Momentum|"
                         r"GradientDescent|save|report_uninitialized)"
                         r"(_\d+)?(/|$)")


class MetaGraphError(_errors.GraphGradError, ValueError):
  """A MetaGraph file that is missing, unreadable, or has no usable loss."""


def load(path: str) -> tf.Graph:
  """Imports the MetaGraph at ``path`` into a new ``tf.Graph``.

  Raises:
    MetaGraphError: if the file is missing or is not a MetaGraph.
  """
  if not os.path.isfile(path):
    raise MetaGraphError(
        f"no such file: {path!r}. Pass the .meta file that "
        f"tf.compat.v1.train.Saver.save wrote next to the checkpoint.")
  graph = tf.Graph()
  with graph.as_default():
    try:
      tf.compat.v1.train.import_meta_graph(path, clear_devices=True)
    except Exception as e:  # pylint: disable=broad-except
      first = (str(e).strip().splitlines() or [""])[0][:160]
      raise MetaGraphError(
          f"cannot read {path!r} as a MetaGraph ({type(e).__name__}: "
          f"{first}). Pass a .meta file written by "
          f"tf.compat.v1.train.Saver or export_meta_graph.") from None
  if not graph.get_operations():  # an empty file parses as an empty proto
    raise MetaGraphError(
        f"{path!r} is not a MetaGraph: it holds no graph (an empty file, or "
        f"another kind of protocol buffer). Pass a .meta file written by "
        f"tf.compat.v1.train.Saver or export_meta_graph.")
  return graph


def _scalar_float(t: tf.Tensor) -> bool:
  return t.dtype.is_floating and t.shape.rank == 0


def _reached_variables(t: tf.Tensor, trainable: set) -> int:
  return sum(1 for op in _graph_util.forward_ops(t) if op.name in trainable)


def loss_candidates(graph: tf.Graph) -> List[tf.Tensor]:
  """Scalar float tensors named like a loss that depend on a trainable variable.

  Ordered best first: most trainable variables reached, then latest in the
  graph (a total loss comes after the terms it sums).
  """
  trainable = {v.op.name for v in _graph_util.trainable_variables(graph)}
  found = []
  for op in graph.get_operations():
    if (op.type in ("Const", "Placeholder", "PlaceholderWithDefault")
        or _AFTER_LOSS.search(op.name)
        or not _LOSS_NAME.search(op.name)):
      continue
    for t in op.outputs:
      if _scalar_float(t):
        n = _reached_variables(t, trainable)
        if n:
          found.append((n, _compat.op_id(op), t))
  found.sort(key=lambda x: (-x[0], -x[1]))
  return [t for _, _, t in found]


def guess_loss(graph: tf.Graph) -> Tuple[tf.Tensor, str]:
  """Finds the loss of a training graph.

  Returns:
    ``(loss, reason)``: the tensor and a sentence on why it was chosen.

  Raises:
    MetaGraphError: when no candidate is found.
  """
  losses = [t for t in graph.get_collection(tf.compat.v1.GraphKeys.LOSSES)
            if isinstance(t, tf.Tensor) and t.dtype.is_floating]
  if len(losses) == 1:
    return losses[0], "the only tensor in the LOSSES collection"
  if len(losses) > 1:
    with graph.as_default():
      total = tf.add_n([tf.reduce_sum(t) for t in losses],
                       name="graphgrad_total_loss")
    return total, (f"the sum of the {len(losses)} tensors in the LOSSES "
                   f"collection ({', '.join(t.name for t in losses)})")
  candidates = loss_candidates(graph)
  if candidates:
    others = ", ".join(t.name for t in candidates[1:4])
    return candidates[0], (
        "the LOSSES collection is empty; the scalar float tensor named like a "
        "loss that reaches the most trainable variables"
        + (f" (other candidates: {others})" if others else ""))
  raise MetaGraphError(
      "found no loss: the LOSSES collection is empty and no scalar "
      "floating-point op named like a loss (loss, cost, objective) depends on "
      "a trainable variable. Pass the loss tensor's name with --loss NAME.")


def find_loss(graph: tf.Graph, name: str) -> tf.Tensor:
  """The tensor ``name`` (``"loss"`` or ``"loss:0"``) of ``graph``.

  Raises:
    MetaGraphError: if there is no such floating-point tensor.
  """
  tensor_name = name if ":" in name else name + ":0"
  try:
    t = graph.get_tensor_by_name(tensor_name)
  except (KeyError, ValueError):
    hints = ", ".join(t.name for t in loss_candidates(graph)[:5])
    raise MetaGraphError(
        f"--loss {name!r}: the graph has no tensor {tensor_name!r}. "
        f"Tensors named like a loss: {hints or '(none)'}.") from None
  if not t.dtype.is_floating:
    raise MetaGraphError(
        f"--loss {name!r}: {t.name} has dtype {t.dtype.name}; a loss must be "
        f"a floating-point tensor. Pass the float loss tensor's name.")
  return t
