"""TensorBoard summaries of a :class:`~graphgrad.KerasPlan`'s step.

The figures are ``core._trace.figures`` of the step's trace, the same as a
``GradientPlan``'s (``plan/_summaries.py``), written with ``tf.summary`` to
the default writer under one name, ``graphgrad/`` by default. A variable
counts for the innermost layer that holds it. In a step of several
replicas the figures are of the global batch. The step's tensors belong to
the graph it ran in: a ``tf.function``'s step is summarised in it.
"""

import importlib.util
import logging
import os
from typing import Any, Callable, Dict, List, Optional, Sequence

import tensorflow as tf

from graphgrad import _errors
from graphgrad.core import _trace
from graphgrad.core._gradients import dense
from graphgrad.keras._intercept import BackwardStep

log = logging.getLogger("graphgrad")


def layer_of_variables(layers: Sequence[str],
                       own: Callable[[str], List[tf.Variable]]
                       ) -> Callable[[Any], Optional[str]]:
  """variable -> the innermost of ``layers`` holding it, or ``None``."""
  found: Dict[Any, str] = {}
  for path in sorted(layers, key=lambda p: p.count("/")):
    for v in own(path):
      found[v.ref()] = path  # deeper paths come later and win
  return lambda v: found.get(v.ref())


def check_same_graph(step: BackwardStep) -> None:
  """Refuses a step whose tensors belong to another graph than the one
  being built (a ``tf.function``'s step read after it returned)."""
  tensors = [r.before for r in step.trace] + [g for g, _ in step.pairs]
  for t in tensors:
    t = getattr(t, "values", t)
    if t is None or not tf.is_symbolic_tensor(t):
      continue
    here = tf.compat.v1.get_default_graph()
    if tf.executing_eagerly() or t.graph is not here:
      raise _errors.GraphGradError(
          "KerasPlan.summaries(): the last step ran in another graph (a "
          "tf.function), whose gradients cannot be read here. Call "
          "plan.summaries() inside the same tf.function, after "
          "tape.gradient, or plan.attach(summaries=logdir) for fit.")


def warn_unwritten(model_name: str) -> bool:
  """Logs, and returns ``True``, when nothing would record the summaries:
  no default writer, or recording switched off (known when tracing)."""
  recording = tf.get_static_value(tf.summary.should_record_summaries())
  if recording is None or bool(recording):
    return False
  log.warning(
      "graphgrad KerasPlan on %s: summaries() has no default tf.summary "
      "writer to write to (or recording is off), so the figures are only "
      "returned. Open one around the call: with "
      "tf.summary.create_file_writer(logdir).as_default(step=...).",
      model_name)
  return True


def write(step: BackwardStep, layers: Sequence[str],
          layer_of: Callable[[Any], Optional[str]], histograms: bool,
          name: str, at=None) -> Dict[str, tf.Tensor]:
  """Writes the step's summaries; returns ``tag -> norm``.

  Args:
    step: the step, with its trace and final pairs.
    layers: the layer paths, in the order of the figures.
    layer_of: variable -> its layer path.
    histograms: also write gradient histograms.
    name: the tags' first part.
    at: the summary step; ``None`` for ``tf.summary``'s default.
  """
  check_same_graph(step)
  prefix = name.rstrip("/")
  ctx = tf.distribute.get_replica_context()
  replicas = 1 if ctx is None else int(ctx.num_replicas_in_sync)
  out: Dict[str, tf.Tensor] = {}
  # As GradientPlan's: an absolute scope, so no scope of the caller's is
  # prepended to the tags.
  with tf.name_scope(prefix + "/"):
    if replicas == 1:
      norms = _norms(step, layers, layer_of)
      pairs = step.pairs
    else:
      pairs = _summed(ctx, step.pairs)
      norms = _replica_norms(ctx, step, pairs, layers, layer_of)
    for tag, norm in norms.items():
      out[f"{prefix}/{tag}"] = norm
      _write(_scalar, f"{prefix}/{tag}", norm, at)
    if histograms:
      for tag, values in _trace.histograms(
          step.trace, pairs, lambda v: v.name.split(":")[0], step.scale):
        _write(_histogram, tag, values, at)
  return out


def _norms(step: BackwardStep, layers, layer_of) -> Dict[str, tf.Tensor]:
  """``tag -> norm`` of one device's (or one replica's) step."""
  out = {}
  for figure in _trace.figures(step.trace, step.pairs, layer_of, layers,
                               step.scale):
    before, after = figure.norms()
    out[f"{figure.tag}/before"], out[f"{figure.tag}/after"] = before, after
  return out


def _summed(ctx, pairs) -> List[tuple]:
  """``pairs`` with each gradient summed over the replicas (dense)."""
  present = [(g, v) for g, v in pairs if g is not None]
  if not present:
    return []
  total = ctx.all_reduce(tf.distribute.ReduceOp.SUM,
                         [dense(g) for g, _ in present])
  return [(g, v) for g, (_, v) in zip(total, present)]


def _replica_norms(ctx, step: BackwardStep, final, layers,
                   layer_of) -> Dict[str, tf.Tensor]:
  """``tag -> norm`` of a step of several replicas, for the global batch.

  A parameter gradient is the sum of the replicas' contributions (what the
  optimizer applies), before its transforms too; a gradient at a layer's
  outputs has one row per example, so its norm over the global batch is
  the root of the replicas' squared norms summed.
  """
  after = {f.tag: f for f in _trace.figures([], final, layer_of, layers,
                                            step.scale)}
  before = {f.tag: f for f in _trace.figures(
      [], _summed(ctx, step.raw), layer_of, layers, step.scale)}
  out = {}
  for tag, figure in after.items():
    out[f"{tag}/before"] = (before[tag] if tag in before
                            else figure).norms()[1]
    out[f"{tag}/after"] = figure.norms()[1]
  boundaries = _trace.figures(step.trace, [], layer_of, layers, step.scale)
  squares = []
  for figure in boundaries:
    squares += [tf.square(n) for n in figure.norms()]
  if squares:
    total = ctx.all_reduce(tf.distribute.ReduceOp.SUM, squares)
    for i, figure in enumerate(boundaries):
      out[f"{figure.tag}/before"] = tf.sqrt(total[2 * i])
      out[f"{figure.tag}/after"] = tf.sqrt(total[2 * i + 1])
  return out


def _scalar(tag: str, value, step) -> None:
  """A scalar summary of the whole ``tag``, which TensorBoard reads as
  ``tf.summary.scalar``'s,
  written by TensorFlow alone: ``tf.summary.scalar`` needs the tensorboard
  package, which graphgrad does not require."""
  tf.summary.write(tag, value, step=step, metadata=_SCALAR.SerializeToString())


def _histogram(tag: str, value, step) -> None:
  if importlib.util.find_spec("tensorboard") is None:
    raise _errors.GraphGradError(
        "KerasPlan.summaries(histograms=True): tf.summary.histogram needs "
        "the tensorboard package, which is not installed. pip install "
        "tensorboard, or pass histograms=False.")
  tf.summary.histogram(tag, value, step=step)


def _scalar_metadata():
  meta = tf.compat.v1.SummaryMetadata()
  meta.plugin_data.plugin_name = "scalars"  # TensorBoard's scalar plugin
  field = meta.DESCRIPTOR.fields_by_name["data_class"]
  meta.data_class = field.enum_type.values_by_name["DATA_CLASS_SCALAR"].number
  return meta


_SCALAR = _scalar_metadata()


def _write(kind, tag: str, value, at) -> None:
  try:
    kind(tag, value, at)
  except ValueError as e:
    if at is not None or tf.summary.experimental.get_step() is not None:
      raise
    raise _errors.GraphGradError(
        "KerasPlan.summaries(): the default summary writer has no step to "
        "write at, and `step` was not given. Pass plan.summaries(step=...), "
        "or open the writer with writer.as_default(step=...).") from e


def fit_writer(summaries) -> Optional[Any]:
  """The writer of ``plan.attach(summaries=...)``: ``None``, a
  ``tf.summary.SummaryWriter``, or one made on a log directory."""
  if summaries is None or isinstance(summaries, tf.summary.SummaryWriter):
    return summaries
  if isinstance(summaries, (str, os.PathLike)):
    return tf.summary.create_file_writer(os.fspath(summaries))
  raise _errors.GraphGradError(
      f"plan.attach(): `summaries` must be None, a log directory or a "
      f"tf.summary.SummaryWriter; got {type(summaries).__name__}. Pass e.g. "
      f"summaries='logs/graphgrad'.")


def in_fit(plan, writer, optimizer) -> None:
  """Writes the summaries of a ``fit`` step with ``writer`` (if any), at
  the optimizer's step count before the step's update."""
  if writer is not None:
    with writer.as_default():
      plan.summaries(step=tf.cast(optimizer.iterations, tf.int64))
