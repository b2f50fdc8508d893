"""What ``graphgrad grads`` runs of a saved graph, and what it refuses to run.

``grads`` runs the variables' initializers, a restore of ``--checkpoint``
by its own ``Saver``, and the loss's forward and backward pass: the ops the
loss, those initializers and that restore depend on, through data inputs
and control dependencies, fed placeholders cut off. A graph from elsewhere
can hide anything there, also inside the functions those ops call, their
``cond`` and ``case`` branches, ``while`` bodies and dataset functions.
:func:`refusal` walks all of it and finds the first op that is not on the
allowlist of pure compute ops (:mod:`graphgrad.cli._ops`); with
``allow_io``, the known I/O ops pass too.
"""

from typing import Iterable, List, Optional, Set, Tuple

import tensorflow as tf

from graphgrad.analysis._graph_util import called_functions, linked_functions
from graphgrad.cli import _ops


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


def _verdict(node, allow_io: bool) -> Optional[Tuple[int, str]]:
  """Why the op of ``node`` (a NodeDef) is refused, ranked (0 most
  telling), or ``None`` if it may run."""
  kind: Optional[str]
  if _ops.is_pure(node.op):
    attr = _ops.file_attr(node)
    if attr is None:
      return None
    kind = f"opens the file its attr {attr!r} names"
  else:
    kind = _ops.io_kind(node.op)
    if kind is None:
      return 0, ("not a pure compute op, so grads refuses it even with "
                 "--allow-io")
  if allow_io:
    return None
  rank = 2 if kind == _ops.PIPELINE else 1
  return rank, f"{kind}; pass --allow-io to run it"


def refusal(ops: List[tf.Operation], allow_io: bool = False
            ) -> Optional[str]:
  """Why ``grads`` refuses to run ``ops``, or ``None`` if it may.

  Looks at each op, then at every function of the graph's library that
  they reach, transitively: those their attrs name at any depth, those the
  reached functions' definitions name (:func:`linked_functions`), and
  their registered gradients. A function the library lacks is refused. Of
  several refused ops it names one that ``--allow-io`` would not run, else
  one whose I/O is more specific than running an input pipeline.

  Returns:
    ``"saved graph op 'a/call' -> function 'f' -> 'w' (WriteFile): writes
    a file; pass --allow-io to run it"``: the path to a refused op, its
    type and why; or ``None``.
  """
  if not ops:
    return None
  proto = ops[0].graph.as_graph_def().library
  library = {f.signature.name: f for f in proto.function}
  # A function's registered gradient runs in the backward pass grads builds.
  gradient = {g.function_name: g.gradient_func for g in proto.gradient}
  found: List[Tuple[int, int, str]] = []
  todo: List[Tuple[str, str]] = []
  for op in ops:
    path = f"saved graph op {op.name!r}"
    node = op.node_def
    why = None if op.type in library else _verdict(node, allow_io)
    if why:
      found.append((why[0], len(found), f"{path} ({op.type}): {why[1]}"))
    todo += [(path, n) for n in called_functions(node, library)]
  seen: Set[str] = set()
  while todo:
    path, name = todo.pop(0)
    if name in seen:
      continue
    seen.add(name)
    if name in gradient:
      todo.append((f"{path} -> function {name!r} (its gradient)",
                   gradient[name]))
    todo += [(f"{path} -> function {name!r} ({how})", n)
             for how, n in linked_functions(name, library)]
    path = f"{path} -> function {name!r}"
    if name not in library:
      found.append((0, len(found), f"{path}: not in the graph's function "
                                   f"library, so grads cannot check it"))
      continue
    for node in library[name].node_def:
      why = None if node.op in library else _verdict(node, allow_io)
      if why:
        found.append((why[0], len(found),
                      f"{path} -> {node.name!r} ({node.op}): {why[1]}"))
      todo += [(path, n) for n in called_functions(node, library)]
  return min(found)[2] if found else None


def session_config() -> tf.compat.v1.ConfigProto:
  """The config of the Session ``grads`` runs a saved graph in.

  TensorFlow's implementation selector (a Grappler pass) is off: it would
  swap a function call for another function of the same
  ``api_implements`` that prefers the call's device. :func:`refusal`
  checks those too; with the selector off, a call also runs the function
  it names, whose numbers ``grads`` reports.
  """
  from tensorflow.core.protobuf import rewriter_config_pb2  # pylint: disable=g-import-not-at-top
  config = tf.compat.v1.ConfigProto()
  config.graph_options.rewrite_options.implementation_selector = (
      rewriter_config_pb2.RewriterConfig.OFF)
  return config


def variables_read(graph: tf.Graph, loss: tf.Tensor, feed) -> List:
  """The global variables whose ops the loss's computation runs: the only
  ones ``grads`` initializes."""
  needed = set(ops_run([loss.op], list(feed)))
  return [v for v in graph.get_collection(
      tf.compat.v1.GraphKeys.GLOBAL_VARIABLES) if v.op in needed]
