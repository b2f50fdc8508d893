"""Saved graphs: load one into a fresh graph and find its loss.

Used by ``graphgrad inspect``, which reads the three forms a legacy TF1
model comes in: a MetaGraph (``.meta``, from ``Saver``), a v1 SavedModel
directory (``simple_save`` or ``SavedModelBuilder``; one of its MetaGraphs,
chosen by tag), and a frozen GraphDef (``.pb``), which is thawed
(:func:`graphgrad.thaw`) so that its weights form layers again.

A legacy TF1 training graph rarely says which tensor is its loss, so
:func:`guess_loss` looks where TF1 code puts it: the ``LOSSES`` collection
that ``tf.compat.v1.losses`` fills, and otherwise a scalar floating-point op
whose name says ``loss`` or ``cost``. An inference graph has none; its
outputs are offered instead (:func:`output_candidates`).
"""

import os
import re
from typing import List, Tuple

import tensorflow as tf

from graphgrad import _errors
from graphgrad.analysis import _graph_util, _thaw

_LOSS_NAME = re.compile(r"(loss|cost|objective)", re.IGNORECASE)
# Scopes of ops that a training graph adds after the loss.
_AFTER_LOSS = re.compile(r"(^|/)(gradients|train|Adam|RMSProp|Adagrad|Momentum|"
                         r"GradientDescent|save|report_uninitialized)"
                         r"(_\d+)?(/|$)")


class MetaGraphError(_errors.GraphGradError, ValueError):
  """A MetaGraph file that is missing, unreadable, or has no usable loss."""


def kind_of(path: str) -> str:
  """``"SavedModel"``, ``"frozen GraphDef"`` or ``"MetaGraph"``, by path."""
  if os.path.isdir(path):
    return "SavedModel"
  return "frozen GraphDef" if path.lower().endswith(".pb") else "MetaGraph"


def load(path: str, tag: str = "serve") -> tf.Graph:
  """Imports the MetaGraph, SavedModel or frozen graph at ``path``.

  Args:
    path: a ``.meta`` file, a SavedModel directory, or a frozen ``.pb``.
    tag: the tag of the SavedModel's MetaGraph to load.

  Returns:
    A new ``tf.Graph``; a frozen graph's weights are variables in it.

  Raises:
    MetaGraphError: if the path is missing or is not what its form says.
    GraphGradError: if a frozen ``.pb`` cannot be thawed.
  """
  kind = kind_of(path)
  if kind == "SavedModel":
    return _load_saved_model(path, tag)
  if not os.path.isfile(path):
    raise MetaGraphError(
        f"no such file: {path!r}. Pass the .meta file that "
        f"tf.compat.v1.train.Saver.save wrote next to the checkpoint, a "
        f"SavedModel directory, or a frozen .pb.")
  graph = tf.Graph()
  with graph.as_default():
    if kind == "frozen GraphDef":
      _thaw.thaw(path)
      return graph
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


def _load_saved_model(path: str, tag: str) -> tf.Graph:
  """Imports the MetaGraph tagged ``tag`` of a SavedModel, without weights."""
  from tensorflow.core.protobuf import saved_model_pb2  # pylint: disable=g-import-not-at-top
  file = os.path.join(path, "saved_model.pb")
  if not os.path.isfile(file):
    raise MetaGraphError(
        f"{path!r} is a directory without saved_model.pb, so not a "
        f"SavedModel. Pass the directory that "
        f"tf.compat.v1.saved_model.simple_save or SavedModelBuilder wrote, "
        f"or a .meta or frozen .pb file.")
  model = saved_model_pb2.SavedModel()
  with open(file, "rb") as f:
    model.ParseFromString(f.read())
  tags = [sorted(m.meta_info_def.tags) for m in model.meta_graphs]
  found = [m for m in model.meta_graphs if tag in m.meta_info_def.tags]
  if not found:
    raise MetaGraphError(
        f"--tag {tag!r}: the SavedModel {path!r} has no MetaGraph with that "
        f"tag; its MetaGraphs have the tags {tags}. Pass one with --tag.")
  graph = tf.Graph()
  with graph.as_default():
    tf.compat.v1.train.import_meta_graph(found[0], clear_devices=True)
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
          found.append((n, _graph_util.op_id(op), t))
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
  outputs = ", ".join(t.name for t in output_candidates(graph)[:4])
  raise MetaGraphError(
      "found no loss: the LOSSES collection is empty and no scalar "
      "floating-point op named like a loss (loss, cost, objective) depends on "
      "a trainable variable. Pass the loss tensor's name with --loss NAME, "
      "or, for an inference graph, an output with --output NAME (outputs: "
      f"{outputs or '(none)'}).")


def output_candidates(graph: tf.Graph) -> List[tf.Tensor]:
  """Float tensors nothing consumes that depend on a trainable variable.

  Ordered best first: most trainable variables reached, then latest.
  """
  trainable = {v.op.name for v in _graph_util.trainable_variables(graph)}
  found = []
  for op in graph.get_operations():
    if (op.type in ("Const", "Placeholder", "PlaceholderWithDefault",
                    "VarHandleOp", "VariableV2", "AssignVariableOp", "NoOp")
        or _AFTER_LOSS.search(op.name) or "/Initializer/" in op.name
        or _graph_util.read_variable_source(op) is not None):
      continue
    for t in op.outputs:
      if t.dtype.is_floating and not t.consumers():
        n = _reached_variables(t, trainable)
        if n:
          found.append((n, _graph_util.op_id(op), t))
  found.sort(key=lambda x: (-x[0], -x[1]))
  return [t for _, _, t in found]


def find_loss(graph: tf.Graph, name: str, flag: str = "--loss") -> tf.Tensor:
  """The tensor ``name`` (``"loss"`` or ``"loss:0"``) of ``graph``.

  Args:
    graph: the loaded graph.
    name: a tensor or op name.
    flag: the command-line flag that gave it, for the messages.

  Raises:
    MetaGraphError: if there is no such floating-point tensor.
  """
  tensor_name = name if ":" in name else name + ":0"
  try:
    t = graph.get_tensor_by_name(tensor_name)
  except (KeyError, ValueError):
    found = (loss_candidates(graph) if flag == "--loss"
             else output_candidates(graph))
    hints = ", ".join(t.name for t in found[:5])
    raise MetaGraphError(
        f"{flag} {name!r}: the graph has no tensor {tensor_name!r}. "
        f"Tensors named like a {'loss' if flag == '--loss' else 'model output'}"
        f": {hints or '(none)'}.") from None
  if not t.dtype.is_floating:
    what = "a loss" if flag == "--loss" else "an output to analyse"
    raise MetaGraphError(
        f"{flag} {name!r}: {t.name} has dtype {t.dtype.name}; {what} must be "
        f"a floating-point tensor. Pass a float tensor's name.")
  return t
