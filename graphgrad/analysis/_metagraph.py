"""Saved graphs: load one into a fresh graph and find its loss.

Used by ``graphgrad inspect`` and ``grads``, which read a MetaGraph
(``.meta``, from ``Saver``), a SavedModel directory (one of its MetaGraphs,
chosen by tag; a TF2 one's signature is inlined by ``_signature_graph``),
and a frozen GraphDef (``.pb``), thawed (:func:`graphgrad.thaw`) so that its
weights form layers again; each binary or text. Each is decoded and checked
(``_graph_limits``) before anything imports it.

A legacy TF1 training graph rarely says which tensor is its loss, so
:func:`guess_loss` looks where TF1 code puts it: the ``LOSSES`` collection
that ``tf.compat.v1.losses`` fills, and otherwise a scalar floating-point op
whose name says ``loss`` or ``cost``. An inference graph has none; its
outputs are offered instead (:func:`output_candidates`).
"""

import os
import re
from typing import List, NamedTuple, Optional, Tuple

import tensorflow as tf

from graphgrad import _errors
from graphgrad.analysis import (
  _graph_limits,
  _graph_util,
  _signature_graph,
  _thaw,
)

_LOSS_NAME = re.compile(r"(loss|cost|objective)", re.IGNORECASE)
# Scopes of ops that a training graph adds after the loss.
_AFTER_LOSS = re.compile(r"(^|/)(gradients|train|Adam|RMSProp|Adagrad|Momentum|"
                         r"GradientDescent|save|report_uninitialized)"
                         r"(_\d+)?(/|$)")


class MetaGraphError(_errors.GraphGradError, ValueError):
  """A MetaGraph file that is missing, unreadable, or has no usable loss."""


_GRAPH_DEF_FIELDS = ("node", "library", "versions", "version")
TF2 = "TF2 SavedModel"


class Model(NamedTuple):
  """A loaded model.

  Attributes:
    graph: the new ``tf.Graph`` it was imported into.
    kind: ``"MetaGraph"``, ``"SavedModel"`` (TF1), ``"TF2 SavedModel"`` or
      ``"frozen GraphDef"``.
    signature: a TF2 SavedModel's inlined signature, else ``None``.
  """
  graph: tf.Graph
  kind: str
  signature: Optional[_signature_graph.Signature] = None


def kind_of(path: str) -> str:
  """``"SavedModel"``, ``"frozen GraphDef"`` or ``"MetaGraph"``: the form
  of ``path`` by its name (a SavedModel's MetaGraph says if TF2 saved it).

  A directory is a SavedModel, a ``.pb`` a frozen GraphDef; a ``.pbtxt``
  is a frozen GraphDef when its first field is one of a GraphDef's
  (``node``, ``library``, ``versions``), else a MetaGraph; anything else is
  a MetaGraph.
  """
  if os.path.isdir(path):
    return "SavedModel"
  lower = path.lower()
  if lower.endswith(".pb"):
    return "frozen GraphDef"
  if lower.endswith(".pbtxt") and _first_field(path) in _GRAPH_DEF_FIELDS:
    return "frozen GraphDef"
  return "MetaGraph"


def _first_field(path: str) -> str:
  """The name of the first field of a text-format protocol buffer file."""
  try:
    with open(path, encoding="utf-8", errors="replace") as f:
      head = f.read(4096)
  except OSError:
    return ""
  for line in head.splitlines():
    line = line.strip()
    if line and not line.startswith("#"):
      return re.split(r"[\s:{<]", line, maxsplit=1)[0]
  return ""


def load(path: str, tag: str = "serve",
         memory_bytes: int = _graph_limits.DEFAULT_MEMORY_BYTES,
         batch: int = 1, checks: bool = True,
         signature: Optional[str] = None) -> Model:
  """Imports the MetaGraph, SavedModel or frozen graph at ``path``.

  Args:
    path: a ``.meta`` file, a SavedModel directory, or a frozen ``.pb``.
    tag: the tag of the SavedModel's MetaGraph to load.
    signature: the signature of a TF2 SavedModel to inline (default
      ``serving_default``); refused for the other forms.
    memory_bytes: the most one tensor of the graph may take, in bytes
      (:func:`graphgrad.analysis._graph_limits.check`).
    batch: what an unknown placeholder dimension counts as in that check:
      the batch of the random inputs ``graphgrad grads`` makes.
    checks: ``False`` skips that check (``--no-checks``: the sandbox alone
      confines the import; thawing a frozen graph still checks its
      constants).

  Returns:
    The :class:`Model`; a frozen graph's weights and a TF2 SavedModel's
    captured variables are variables in its graph.

  Raises:
    MetaGraphError: if the path is missing or is not what its form says.
    SignatureError: if a TF2 SavedModel's signature cannot be inlined.
    GraphLimitError: if the graph asks for more than graphgrad imports
      (recursion, deep calls, huge tensors, a broken gradient override).
    GraphGradError: if a frozen ``.pb`` cannot be thawed.
  """
  kind = kind_of(path)
  if kind != "SavedModel" and not os.path.isfile(path):
    raise MetaGraphError(
        f"no such file: {path!r}. Pass the .meta file that "
        f"tf.compat.v1.train.Saver.save wrote next to the checkpoint, a "
        f"SavedModel directory, or a frozen .pb.")
  if kind == "SavedModel":
    meta_graph = _read_saved_model(path, tag)
    if _signature_graph.is_tf2(meta_graph):
      kind = TF2
  elif kind == "MetaGraph":
    meta_graph = _read_meta_graph(path)
  else:
    meta_graph = None
  if signature is not None and kind != TF2:
    raise MetaGraphError(
        f"--signature {signature!r}: {path!r} is a "
        f"{'TF1 SavedModel' if kind == 'SavedModel' else kind}, whose "
        f"tensors are named with --loss or --output NAME; --signature "
        f"chooses a TF2 SavedModel's signature. Leave it out.")
  if meta_graph is None:  # a frozen GraphDef
    graph_def = _thaw.load_graph_def(path)
    if checks:
      _graph_limits.check(graph_def, memory_bytes, batch, repr(path))
    graph = tf.Graph()
    with graph.as_default():
      _thaw.thaw(graph_def, memory_bytes=memory_bytes)
    return Model(graph, kind)
  if checks:
    _graph_limits.check(meta_graph.graph_def, memory_bytes, batch,
                        repr(path))
  if kind == TF2:
    found = _signature_graph.load(meta_graph, signature or "serving_default",
                                  source=repr(path))
    return Model(found.graph, kind, found)
  graph = tf.Graph()
  with graph.as_default():
    try:
      tf.compat.v1.train.import_meta_graph(meta_graph, clear_devices=True)
    except Exception as e:  # pylint: disable=broad-except
      raise MetaGraphError(
          f"TensorFlow {tf.__version__} cannot import {path!r} "
          f"({type(e).__name__}: {_first_line(e)}). Pass a {kind} written by "
          f"TensorFlow whose ops this TensorFlow knows.") from None
  return Model(graph, kind)


_META_FIX = ("Pass a .meta file written by tf.compat.v1.train.Saver or "
             "export_meta_graph.")
_SAVED_MODEL_FIX = ("Pass the directory that "
                    "tf.compat.v1.saved_model.simple_save or "
                    "SavedModelBuilder wrote, or a .meta or frozen .pb file.")


def _first_line(e: Exception) -> str:
  return (str(e).strip().splitlines() or [""])[0][:160]


def _read_meta_graph(path: str):
  """The ``MetaGraphDef`` in the file ``path``, binary or text, as
  ``import_meta_graph`` reads it, without importing it."""
  from google.protobuf import text_format  # pylint: disable=g-import-not-at-top
  from tensorflow.core.protobuf import meta_graph_pb2  # pylint: disable=g-import-not-at-top
  with open(path, "rb") as f:
    data = f.read()
  meta_graph = meta_graph_pb2.MetaGraphDef()
  try:
    meta_graph.ParseFromString(data)
  except Exception as e:  # pylint: disable=broad-except
    error: Optional[Exception] = e
    try:
      text = data.decode("utf-8")
    except UnicodeDecodeError:
      text = None  # binary, so the binary parser's error is the one to tell
    if text is not None:
      meta_graph = meta_graph_pb2.MetaGraphDef()
      try:
        text_format.Merge(text, meta_graph)
        error = None
      except Exception as text_error:  # pylint: disable=broad-except
        error = text_error
    if error is not None:
      raise MetaGraphError(
          f"cannot read {path!r} as a MetaGraph ({type(error).__name__}: "
          f"{_first_line(error)}). {_META_FIX}") from None
  _check_nodes(meta_graph.graph_def, f"{path!r} is not a MetaGraph",
               _META_FIX)
  return meta_graph


def _check_nodes(graph_def, what: str, fix: str) -> None:
  """Refuses a graph with no nodes, or with a node without name or op: the
  marks of an empty file or of another kind of protocol buffer."""
  if not graph_def.node:
    raise MetaGraphError(
        f"{what}: it holds no graph (an empty file, or another kind of "
        f"protocol buffer). {fix}")
  if not all(n.name and n.op for n in graph_def.node):
    raise MetaGraphError(
        f"{what}: its graph has nodes without a name or an op type (another "
        f"kind of protocol buffer, or a corrupt file). {fix}")


def _read_saved_model(path: str, tag: str):
  """The ``MetaGraphDef`` tagged ``tag`` of a SavedModel, without importing
  it (nor its weights)."""
  file, model = _saved_model_proto(path)
  tags = [sorted(m.meta_info_def.tags) for m in model.meta_graphs]
  found = [m for m in model.meta_graphs if tag in m.meta_info_def.tags]
  if not found:
    raise MetaGraphError(
        f"--tag {tag!r}: the SavedModel {path!r} has no MetaGraph with that "
        f"tag; its MetaGraphs have the tags {tags}. Pass one with --tag.")
  _check_nodes(found[0].graph_def,
               f"the MetaGraph tagged {tag!r} of {file!r} is not a graph",
               _SAVED_MODEL_FIX)
  return found[0]


def _saved_model_proto(path: str):
  """``(file, SavedModel proto)`` of the SavedModel directory ``path``:
  its ``saved_model.pb``, else its ``saved_model.pbtxt``, as TensorFlow's
  loader picks them."""
  from google.protobuf import text_format  # pylint: disable=g-import-not-at-top
  from tensorflow.core.protobuf import saved_model_pb2  # pylint: disable=g-import-not-at-top
  file = os.path.join(path, "saved_model.pb")
  text = not os.path.isfile(file)
  if text:
    file = os.path.join(path, "saved_model.pbtxt")
  if not os.path.isfile(file):
    raise MetaGraphError(
        f"{path!r} is a directory without saved_model.pb or "
        f"saved_model.pbtxt, so not a SavedModel. {_SAVED_MODEL_FIX}")
  model = saved_model_pb2.SavedModel()
  with open(file, "rb") as f:
    data = f.read()
  try:
    if text:
      text_format.Merge(data.decode("utf-8"), model)
    else:
      model.ParseFromString(data)
  except Exception as e:  # pylint: disable=broad-except
    raise MetaGraphError(
        f"cannot read {file!r} as a SavedModel ({type(e).__name__}: "
        f"{_first_line(e)}). {_SAVED_MODEL_FIX}") from None
  if not model.meta_graphs:
    raise MetaGraphError(
        f"{file!r} is not a SavedModel: it holds no MetaGraph (an empty "
        f"file, or another kind of protocol buffer). {_SAVED_MODEL_FIX}")
  return file, model


def read_meta_graphs(path: str, tag: Optional[str] = None) -> List[tuple]:
  """The MetaGraphs at ``path``, decoded and not imported: ``(label,
  MetaGraphDef)`` pairs.

  A SavedModel gives every MetaGraph (labelled by its tags, e.g.
  ``"serve"``), or the one tagged ``tag``; a ``.meta`` file its one
  MetaGraph, labelled ``"MetaGraph"``; a frozen GraphDef one MetaGraph
  that holds it, labelled ``"GraphDef"``.

  Raises:
    MetaGraphError: if the path is missing or is not what its form says.
    GraphGradError: if a frozen GraphDef cannot be read.
  """
  kind = kind_of(path)
  if kind == "SavedModel" and tag is not None:
    return [(tag, _read_saved_model(path, tag))]
  if kind == "SavedModel":
    file, model = _saved_model_proto(path)
    found = []
    for meta_graph in model.meta_graphs:
      label = ",".join(sorted(meta_graph.meta_info_def.tags)) or "(no tag)"
      _check_nodes(meta_graph.graph_def,
                   f"the MetaGraph tagged {label!r} of {file!r} is not a "
                   f"graph", _SAVED_MODEL_FIX)
      found.append((label, meta_graph))
    return found
  if not os.path.isfile(path):
    raise MetaGraphError(
        f"no such file: {path!r}. Pass a .meta file, a SavedModel "
        f"directory, or a frozen .pb or .pbtxt.")
  if kind == "MetaGraph":
    return [("MetaGraph", _read_meta_graph(path))]
  meta_graph = tf.compat.v1.MetaGraphDef()
  meta_graph.graph_def.CopyFrom(_thaw.load_graph_def(path))
  return [("GraphDef", meta_graph)]


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


class Target(NamedTuple):
  """What ``inspect`` and ``grads`` differentiate.

  Attributes:
    tensor: the loss, or the output whose sum is differentiated.
    is_output: True for an output (``grads`` differentiates its sum).
    reason: why it was chosen, for the report's first line.
  """
  tensor: tf.Tensor
  is_output: bool
  reason: str


def choose_target(model: Model, loss: Optional[str] = None,
                  output: Optional[str] = None) -> Target:
  """The loss or output of ``model`` that ``--loss``/``--output`` name.

  A TF2 SavedModel's ``output`` is a key of its signature's outputs, and
  without flags its only output is taken; the other forms name tensors,
  and without flags the loss is guessed (:func:`guess_loss`).

  Raises:
    MetaGraphError: if the name matches nothing, or a TF2 signature has
      several outputs and none is named.
  """
  graph, signature = model.graph, model.signature
  if loss:
    return Target(find_loss(graph, loss), False, "given with --loss")
  if signature is None:
    if output:
      return Target(find_loss(graph, output, flag="--output"), True,
                    "given with --output")
    found, reason = guess_loss(graph)
    return Target(found, False, reason)
  keys = sorted(signature.outputs)
  where = f"signature {signature.key!r}"
  if output:
    if output not in signature.outputs:
      raise MetaGraphError(
          f"--output {output!r}: the {where} has no such output; its "
          f"outputs: {', '.join(keys) or '(none)'}. Pass one of them.")
    return Target(signature.outputs[output], True,
                  f"output {output!r} of the {where}")
  floats = [k for k in keys if signature.outputs[k].dtype.is_floating]
  if len(floats) != 1:
    raise MetaGraphError(
        f"the {where} has {len(floats)} floating-point outputs "
        f"({', '.join(floats) or 'none'}): pass the one to analyse with "
        f"--output KEY, or another signature with --signature KEY.")
  return Target(signature.outputs[floats[0]], True,
                f"the only floating-point output, {floats[0]!r}, of the "
                f"{where}")
