"""``graphgrad grads``: the gradient-flow report of a saved model.

Loads a model as ``graphgrad inspect`` does (one loader, :func:`load_model`),
restores a checkpoint, feeds its placeholders (from an ``.npz``, or random
normal inputs for float placeholders), and prints
:func:`graphgrad.gradient_report`'s table; ``--png`` and ``--json`` write its
picture and its numbers. The backward pass's ops are built before the
``Session`` exists and pass the same allowlist check as the forward pass's.
"""

import argparse
import os
import sys
from typing import Any, Dict, List, NamedTuple, Optional

from graphgrad.cli import _args

_PICTURES = (".png", ".svg", ".pdf")


def add_parser(sub) -> argparse.ArgumentParser:
  """Registers the ``grads`` subcommand on ``sub`` (from add_subparsers)."""
  p = sub.add_parser(
      "grads", help="report where the gradients of a saved model vanish or "
                    "explode",
      description="Loads a saved model, restores its checkpoint, runs its "
                  "backward pass on one batch and prints, per layer, the "
                  "parameter-gradient norm, its ratio to the weights' norm, "
                  "the upstream-gradient norm and the fraction of zero "
                  "upstream entries; flags vanishing and exploding layers. "
                  "It runs only the loss's forward and backward pass and the "
                  "initializers of the variables it reads (or the "
                  "--checkpoint restore), only if every op there, in the "
                  "functions they call and in their dataset functions is a "
                  "pure compute op (known I/O ops pass with --allow-io), "
                  "and stops after --timeout seconds.")
  p.add_argument("model", metavar="MODEL",
                 help="a MetaGraph (.meta file), a frozen GraphDef (.pb), "
                      "binary or text, or a SavedModel directory (TF1 or "
                      "TF2)")
  p.add_argument("--checkpoint", metavar="CKPT",
                 help="checkpoint prefix or directory to restore (default: "
                      "a SavedModel's own variables; a frozen .pb's frozen "
                      "values; a MetaGraph's initial values)")
  p.add_argument("--loss", metavar="NAME",
                 help="name of the scalar loss tensor or op (default: "
                      "guessed)")
  p.add_argument("--output", metavar="NAME",
                 help="for a graph without a loss: report the gradients of "
                      "the sum of this output (a TF2 SavedModel: a key of "
                      "the signature's outputs, default its only one)")
  _args.add_saved_model_flags(p)
  p.add_argument("--allow-io", action="store_true",
                 help="also run the known I/O ops: ops that read, write or "
                      "list files, run an input pipeline, save or restore "
                      "checkpoints, write summaries or debug dumps, or "
                      "print (refused by default: a saved graph can carry "
                      "them). Ops that are neither pure compute nor known "
                      "I/O are refused even so")
  p.add_argument("--feed", metavar="FEED.npz",
                 help="arrays keyed by placeholder name (a TF2 SavedModel: "
                      "by the signature's input names)")
  p.add_argument("--depth", metavar="N",
                 help="group nested variable scopes to depth N")
  p.add_argument("--batch", metavar="N", default="8",
                 help="batch size of random inputs (default 8)")
  p.add_argument("--seed", metavar="S", default="0",
                 help="seed of the random inputs (default 0)")
  p.add_argument("--png", metavar="OUT.png", help="write the picture")
  p.add_argument("--json", metavar="OUT.json", help="write the numbers")
  from graphgrad.cli import _sandbox  # pylint: disable=g-import-not-at-top
  _sandbox.add_flags(p, runs_graph=True)
  # ``sub`` makes a cli._args.Parser: its errors are one line, exit code 2.
  p.set_defaults(command_spec=_sandbox.ModelCommand(
      check=check, reads=reads, compute=compute, finish=finish))
  return p


def load_model(path: str, batch: int = 1, memory_bytes: Optional[int] = None,
               checks: bool = True, tag: str = "serve",
               signature: Optional[str] = None):
  """The model at ``path`` (an ``analysis._metagraph.Model``, its graph
  new), loaded as ``inspect`` does.

  Args:
    path: a ``.meta`` file, a SavedModel directory, or a frozen ``.pb``.
    tag: the tag of a SavedModel's MetaGraph.
    signature: a TF2 SavedModel's signature (``None``: serving_default).
    batch: what an unknown dimension of a placeholder counts as when the
      graph's sizes are checked before import: the random inputs' batch.
    memory_bytes: the most one tensor may take, in bytes; ``None`` for the
      default (``_graph_limits.DEFAULT_MEMORY_BYTES``).
    checks: ``False`` skips the checks before import (``--no-checks``).
  """
  from graphgrad.analysis import _graph_limits, _metagraph  # pylint: disable=g-import-not-at-top
  if memory_bytes is None:
    memory_bytes = _graph_limits.DEFAULT_MEMORY_BYTES
  return _metagraph.load(path, tag=tag, memory_bytes=memory_bytes,
                         batch=batch, checks=checks, signature=signature)


def _int(flag: str, text: str, minimum: int) -> int:
  from graphgrad.cli._args import CommandError  # pylint: disable=g-import-not-at-top
  try:
    value = int(text)
  except ValueError:
    value = None
  if value is None or value < minimum:
    raise CommandError(f"{flag} {text!r}: expected an integer of at least "
                       f"{minimum}, e.g. {flag} {max(minimum, 8)}")
  return value


def _check_paths(args) -> None:
  from graphgrad.cli._args import CommandError  # pylint: disable=g-import-not-at-top
  if args.png and os.path.splitext(args.png)[1].lower() not in _PICTURES:
    raise CommandError(f"--png {args.png!r}: the file name must end in "
                       f"{', '.join(_PICTURES)}")
  if args.json and not args.json.lower().endswith(".json"):
    raise CommandError(f"--json {args.json!r}: the file name must end in "
                       f".json")
  if args.png:
    from graphgrad import _installed  # pylint: disable=g-import-not-at-top
    if not _installed.has_module("matplotlib"):
      raise CommandError(
          "--png needs matplotlib: pip install 'graphgrad[draw]', or leave "
          "--png out (--json writes the numbers)")
  for flag, path in (("--png", args.png), ("--json", args.json)):
    if path:
      _args.check_output(flag, path)
  if args.feed and not os.path.isfile(args.feed):
    raise CommandError(f"--feed {args.feed!r}: no such file; pass an .npz "
                       f"written by numpy.savez(path, x=array, ...)")
  if args.checkpoint and not (os.path.exists(args.checkpoint)
                              or checkpoint_files(args.checkpoint)):
    raise _no_checkpoint(args.checkpoint)


def _read_npz(path: str) -> Dict:
  import numpy as np  # pylint: disable=g-import-not-at-top

  from graphgrad.cli._args import CommandError  # pylint: disable=g-import-not-at-top
  try:
    with np.load(path, allow_pickle=False) as data:
      return {k: data[k] for k in data.files}
  except Exception as e:  # pylint: disable=broad-except
    first = (str(e).strip().splitlines() or [""])[0][:120]
    raise CommandError(f"--feed {path!r}: cannot read it as an .npz "
                       f"({type(e).__name__}: {first}); write it with "
                       f"numpy.savez(path, x=array, ...)") from None


def _shape(shape) -> str:
  if shape.rank is None:
    return "[?]"
  return "[" + ",".join("?" if d is None else str(d)
                        for d in shape.as_list()) + "]"


def build_feed(graph, loss, arrays: Dict, batch: int, seed: int) -> Dict:
  """Feed dict for the placeholders ``loss`` depends on.

  ``arrays`` are keyed by placeholder name (``"x"`` or ``"x:0"``); float
  placeholders without an array get random normal inputs of their static
  shape, unknown dimensions set to ``batch``.
  """
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  from graphgrad.analysis import _graph_util  # pylint: disable=g-import-not-at-top
  from graphgrad.cli._args import CommandError  # pylint: disable=g-import-not-at-top
  placeholders = [op for op in _graph_util.forward_ops(loss)
                  if op.type in ("Placeholder", "PlaceholderWithDefault")]
  names = {op.name for op in placeholders}
  given = {k.split(":")[0]: v for k, v in arrays.items()}
  unknown = sorted(set(given) - names)
  if unknown:
    raise CommandError(
        f"--feed: no placeholder named {unknown[0]!r} feeds the loss "
        f"{loss.name}; its placeholders: "
        f"{', '.join(sorted(names)) or '(none)'}")
  rng = np.random.default_rng(seed)
  feed = {}
  for op in placeholders:
    t = op.outputs[0]
    dtype, shape = t.dtype, t.shape
    if op.name in given:
      value = np.asarray(given[op.name])
      if not shape.is_compatible_with(value.shape) or not np.can_cast(
          value.dtype, dtype.as_numpy_dtype, casting="same_kind"):
        raise CommandError(
            f"--feed: array {op.name!r} is {value.dtype} "
            f"{_shape(tf.TensorShape(value.shape))}; the placeholder is "
            f"{dtype.name} {_shape(shape)}. Save an array of that "
            f"shape and dtype")
      feed[t] = value.astype(dtype.as_numpy_dtype)
      continue
    if op.type == "PlaceholderWithDefault":
      continue
    if not dtype.is_floating:
      raise CommandError(
          f"placeholder {op.name!r} ({dtype.name} {_shape(shape)}) is not "
          f"floating-point, so it gets no random input: pass --feed "
          f"FEED.npz with an array named {op.name!r}")
    if shape.rank is None:
      raise CommandError(
          f"placeholder {op.name!r} has an unknown rank, so no random input "
          f"can be made for it: pass --feed FEED.npz with an array named "
          f"{op.name!r}")
    dims = [batch if d is None else d for d in shape.as_list()]
    feed[t] = rng.standard_normal(dims).astype(dtype.as_numpy_dtype)
  return feed


class _Restore(NamedTuple):
  """How ``grads`` restores ``--checkpoint``: the flag's value, the prefix
  it names, the ``Saver`` that restores it, and whether it is the model's
  own (a SavedModel's ``variables/``, restored without the flag)."""
  checkpoint: str
  prefix: str
  saver: Any
  own: bool


def _build_restore(graph, checkpoint: Optional[str], allow_io: bool,
                   checks: bool = True, own: bool = False,
                   signature=None) -> Optional[_Restore]:
  """Builds the restore of ``checkpoint`` (``None`` without one) and,
  with ``checks``, refuses it as :func:`_refuse` refuses the loss's ops.

  ``grads``' own ``Saver`` restores every global variable, not only those
  the loss reads: its restore runs their variable ops and what those depend
  on through data inputs and control dependencies, all of which are the
  saved graph's and are checked here. The ops the ``Saver`` adds (its
  ``RestoreV2``, assigns and constants) are graphgrad's, and pass. A TF2
  SavedModel's ``signature`` (``_signature_graph.Signature``) restores its
  rebuilt variables, by their keys in the TF2 checkpoint; the model's own
  restore function is never run.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  from graphgrad.cli import _untrusted  # pylint: disable=g-import-not-at-top
  from graphgrad.cli._args import CommandError  # pylint: disable=g-import-not-at-top
  if checkpoint is None:
    return None
  tf1 = tf.compat.v1
  prefix: Optional[str] = checkpoint
  if os.path.isdir(checkpoint):
    prefix = tf.train.latest_checkpoint(checkpoint) or _only_prefix(
        checkpoint)
  if not prefix or not tf1.train.checkpoint_exists(prefix):
    raise _no_checkpoint(checkpoint)
  known = len(graph.get_operations())
  var_list = None
  if signature is not None:
    from graphgrad.analysis import _signature_graph  # pylint: disable=g-import-not-at-top
    try:
      var_list = _signature_graph.checkpoint_variables(
          signature, tf.train.load_checkpoint(prefix),
          f"--checkpoint {checkpoint!r}")
    except tf.errors.OpError as e:
      raise _cannot_restore(checkpoint, e) from None
  with graph.as_default():
    try:
      saver = tf1.train.Saver(var_list)
    except ValueError as e:
      raise _cannot_restore(checkpoint, e) from None
  added = set(graph.get_operations()[known:])
  restore = graph.as_graph_element(saver.saver_def.restore_op_name)
  filename = graph.as_graph_element(saver.saver_def.filename_tensor_name)
  ops = [op for op in _untrusted.ops_run([restore], [filename])
         if op not in added]
  why = _untrusted.refusal(ops, allow_io) if checks else None
  if why is not None:
    raise CommandError(f"--checkpoint {checkpoint!r}: restoring it runs "
                       f"{why}")
  return _Restore(checkpoint, prefix, saver, own)


def own_checkpoint(model: str) -> Optional[str]:
  """A SavedModel's own variables, ``MODEL/variables/variables``, which
  ``grads`` restores when no ``--checkpoint`` is given; ``None`` for other
  forms, or a SavedModel saved without variables."""
  prefix = os.path.join(model, "variables", "variables")
  if os.path.isdir(model) and os.path.isfile(prefix + ".index"):
    return prefix
  return None


def _only_prefix(folder: str) -> Optional[str]:
  """The one checkpoint in ``folder`` that has no ``checkpoint`` file (a
  SavedModel's ``variables/``), or ``None``."""
  try:
    found = sorted(n[:-len(".index")] for n in os.listdir(folder)
                   if n.endswith(".index"))
  except OSError:
    return None
  return os.path.join(folder, found[0]) if len(found) == 1 else None


def _no_checkpoint(checkpoint: str) -> Exception:
  """The error line of a ``--checkpoint`` that names no checkpoint."""
  from graphgrad.cli._args import CommandError  # pylint: disable=g-import-not-at-top
  return CommandError(
      f"--checkpoint {checkpoint!r}: no checkpoint there; pass the prefix "
      f"Saver.save returned (model.ckpt, without .index) or its directory")


def _cannot_restore(checkpoint: str, error: Exception) -> Exception:
  """The error line of a ``Saver`` that cannot restore ``checkpoint``."""
  from graphgrad.cli._args import CommandError  # pylint: disable=g-import-not-at-top
  first = (str(error).strip().splitlines() or [""])[0][:160]
  return CommandError(f"--checkpoint {checkpoint!r}: cannot restore it "
                      f"into this graph ({first})")


def _restore(sess, graph, restore: Optional[_Restore], variables,
             frozen: bool) -> str:
  """Initializes ``variables`` (those the loss reads), or restores the
  checkpoint; returns what was done, for the report's first line."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  with graph.as_default():
    if restore is None:
      sess.run(tf.compat.v1.variables_initializer(list(variables)))
      if frozen:
        return "a frozen graph: the variables hold its frozen values"
      return "no --checkpoint: the variables have their initial values"
    try:
      restore.saver.restore(sess, restore.prefix)
    except (tf.errors.OpError, ValueError) as e:
      raise _cannot_restore(restore.checkpoint, e) from None
    return (f"restored {'its own variables, ' if restore.own else ''}"
            f"{restore.prefix}")


def check(args) -> None:
  """``grads``' argument checks, in the command line's own process."""
  from graphgrad.cli._args import CommandError  # pylint: disable=g-import-not-at-top
  _check_paths(args)
  if args.depth is not None:
    _int("--depth", args.depth, 1)
  _int("--batch", args.batch, 1)
  _int("--seed", args.seed, 0)
  if args.loss and args.output:
    raise CommandError(
        f"--loss {args.loss!r} and --output {args.output!r}: pass one; "
        f"--output reports the gradients of an output's sum when the graph "
        f"has no loss.")


def reads(args) -> List[str]:
  """The files the sandboxed ``grads`` may read: the model (with
  ``--allow-io``, its whole directory), the checkpoint's files and the
  feed."""
  found = [args.model]
  if args.allow_io:
    # A graph's own I/O may read next to it (a vocabulary, assets): the
    # model's directory, and nothing outside it.
    model = os.path.abspath(args.model)
    found.append(model if os.path.isdir(model) else os.path.dirname(model))
  if args.checkpoint:
    found += checkpoint_files(args.checkpoint)
  if args.feed:
    found.append(args.feed)
  return found


def checkpoint_files(checkpoint: str) -> List[str]:
  """A checkpoint directory, or the files of a prefix (``model.ckpt`` ->
  ``model.ckpt.index``, ``model.ckpt.data-00000-of-00001``)."""
  if os.path.isdir(checkpoint):
    return [checkpoint]
  folder = os.path.dirname(os.path.abspath(checkpoint))
  base = os.path.basename(checkpoint)
  try:
    names = os.listdir(folder)
  except OSError:
    return []
  return [os.path.join(folder, n) for n in sorted(names)
          if n.startswith(base + ".")]


def compute(args) -> Dict:
  """``grads``' work on the model: prints the table; returns the report's
  numbers for ``finish``."""
  depth = None if args.depth is None else _int("--depth", args.depth, 1)
  batch = _int("--batch", args.batch, 1)
  seed = _int("--seed", args.seed, 0)
  _args.quiet_tensorflow(getattr(args, "verbose", False))
  arrays = _read_npz(args.feed) if args.feed else {}
  return _run(args, arrays, depth, batch, seed)


def finish(args, outcome: Dict) -> int:
  """Prints ``grads``' table and writes ``--png`` and ``--json``, in the
  command line's own process."""
  from graphgrad.cli._args import CommandError  # pylint: disable=g-import-not-at-top
  from graphgrad.core._report_figures import GradientReport  # pylint: disable=g-import-not-at-top
  sys.stdout.write(outcome["text"])
  try:
    report = GradientReport.from_dict(outcome["report"])
  except (KeyError, TypeError, ValueError) as e:
    raise CommandError(f"the report the sandboxed process sent is not "
                       f"well formed ({e})") from None
  _write(args, report)
  return 0


def _run(args, arrays: Dict, depth, batch: int, seed: int) -> Dict:
  """``grads`` once its arguments are checked; returns the exit code."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  import graphgrad as gg  # pylint: disable=g-import-not-at-top
  from graphgrad.analysis import _metagraph  # pylint: disable=g-import-not-at-top
  from graphgrad.cli import _untrusted  # pylint: disable=g-import-not-at-top
  from graphgrad.cli._args import CommandError  # pylint: disable=g-import-not-at-top
  from graphgrad.plan import _report  # pylint: disable=g-import-not-at-top
  checks = not args.no_checks
  checkpoint = args.checkpoint or own_checkpoint(args.model)
  try:
    _args.phase("reading the model")
    model = load_model(args.model, batch=batch, memory_bytes=args.memory,
                       checks=checks, tag=args.tag, signature=args.signature)
    graph = model.graph
    _args.phase("analysing the graph")
    with graph.as_default():
      target = _metagraph.choose_target(model, args.loss, args.output)
      if target.is_output:
        loss = tf.reduce_sum(target.tensor, name="graphgrad_output_sum")
        reason = (f"the sum of --output {target.tensor.name}"
                  if args.output and model.signature is None else
                  f"the sum of {target.tensor.name}, {target.reason}")
      else:
        loss, reason = target.tensor, target.reason
        _check_scalar(loss)
      if (model.signature is not None and model.signature.variables
          and checkpoint is None):
        raise CommandError(
            f"{args.model!r} has no variables/ checkpoint, and a TF2 "
            f"SavedModel's variables have no initial values of their own: "
            f"pass --checkpoint with a TF2 checkpoint of the same model")
      net = gg.analyze(loss, depth=depth)
      feed = build_feed(graph, loss, arrays, batch, seed)
      variables = _untrusted.variables_read(graph, loss, feed)
      if checks:
        _refuse([loss.op], variables, feed, checkpoint, args.allow_io)
      _args.phase("building the backward pass")
      # Built before the Session exists (a functional While's or If's
      # gradient adds outputs to the forward op), and checked in turn: a
      # gradient function can run what the forward pass does not.
      try:
        fetches = _report.build(net)
      except gg.GraphGradError:
        raise
      except (TypeError, ValueError, LookupError) as e:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise CommandError(f"building the backward pass failed "
                           f"({type(e).__name__}: {first})") from None
      if checks:
        _refuse(fetched_ops(fetches), variables, feed, checkpoint,
                args.allow_io)
      restore = _build_restore(graph, checkpoint, args.allow_io, checks,
                               own=not args.checkpoint,
                               signature=model.signature)
    frozen = model.kind == "frozen GraphDef"
    _args.phase("running the graph")
    with tf.compat.v1.Session(graph=graph,
                              config=_untrusted.session_config()) as sess:
      restored = _restore(sess, graph, restore, variables, frozen)
      report = _report.measure(sess, net, fetches, [feed])
  except gg.GraphGradError as e:
    raise CommandError(str(e)) from None
  print(f"{args.model}: loss {loss.name} ({reason}); {restored}")
  print()
  print(report.table())
  return {"report": report.to_dict()}


def _check_scalar(loss) -> None:
  from graphgrad.cli._args import CommandError  # pylint: disable=g-import-not-at-top
  if loss.shape.rank is None or loss.shape.num_elements() == 1:
    return
  raise CommandError(
      f"the loss {loss.name} has shape {_shape(loss.shape)}, not a scalar: "
      f"pass a scalar loss with --loss NAME, or --output {loss.op.name} to "
      f"report the gradients of its sum")


def fetched_ops(fetches) -> List:
  """The ops a ``Session.run`` of ``fetches`` (nested dicts and lists of
  tensors, ``IndexedSlices`` and variables) fetches itself."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  ops = []
  for item in tf.nest.flatten(fetches):
    if isinstance(item, tf.IndexedSlices):
      ops += [t.op for t in (item.values, item.indices, item.dense_shape)
              if t is not None]
    elif isinstance(item, tf.Variable):
      ops.append(item.graph.as_graph_element(item).op)
    else:
      ops.append(item.op)
  return ops


def _refuse(ops, variables, feed, checkpoint, allow_io: bool) -> None:
  """Refuses to run an op off the allowlist (cli._untrusted): ``ops``
  and, without a checkpoint, the initializers of ``variables``
  (:func:`_build_restore` checks the checkpoint's restore)."""
  from graphgrad.cli import _untrusted  # pylint: disable=g-import-not-at-top
  from graphgrad.cli._args import CommandError  # pylint: disable=g-import-not-at-top
  fetches = list(ops) + ([] if checkpoint else
                         [v.initializer for v in variables])
  why = _untrusted.refusal(_untrusted.ops_run(fetches, list(feed)), allow_io)
  if why is not None:
    raise CommandError(why)


def _write(args, report) -> None:
  import json  # pylint: disable=g-import-not-at-top

  from graphgrad.cli._args import CommandError  # pylint: disable=g-import-not-at-top
  try:
    if args.png:
      name = os.path.basename(args.model)
      report.plot(args.png, title=f"gradient flow of {name}")
      print(f"\nwrote {args.png}")
    if args.json:
      with open(args.json, "w", encoding="utf-8") as f:
        json.dump(report.to_dict(), f, indent=1)
      print(f"wrote {args.json}")
  except OSError as e:
    raise CommandError(f"cannot write output: {e}") from None
