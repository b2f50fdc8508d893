"""Control flow whose body reads one layer's variables belongs to that layer.

By name scope alone, ``dynamic_rnn`` under ``variable_scope("rnn")`` gives the
layer ``rnn/rnn/lstm_cell`` only its variable reads, and its loop
(``rnn/rnn/while``) is glue. So a *frame* (a ``tf.compat.v1`` while loop or
cond, by its outermost control-flow context, or one v2 ``While``,
``StatelessWhile``, ``If``, ``StatelessIf`` or ``Case`` op) whose ops and
captured inputs read the variables of exactly one layer ``L`` belongs to
``L``, with its plumbing: the ``TensorArray``/``TensorList`` ops around it
and the ``Switch``/``Merge``/``Identity`` ops of its name scope. The layer's
inputs and outputs are then the real activations outside the loop, never a
``TensorArray`` flow or a variant tensor. A frame that reads the variables of
two layers stays glue: its boundaries lie inside the loop, and a plan refuses
them with a message naming the frame.
"""

import collections
from typing import Dict, List, Optional, Set

import tensorflow as tf

from graphgrad import _compat
from graphgrad.analysis import _graph_util

V2_OPS = frozenset({"While", "StatelessWhile", "If", "StatelessIf", "Case",
                    "StatelessCase"})


def is_array_op(op: tf.Operation) -> bool:
  """True for ``TensorArray*`` and ``TensorList*`` ops."""
  return op.type.startswith(("TensorArray", "TensorList"))


def _outermost(ctx):
  while ctx is not None and ctx.outer_context is not None:
    ctx = ctx.outer_context
  return ctx


def frames(fwd_ops) -> List[tuple]:
  """``(scope prefix, ops)`` of each v1 frame and each v2 control-flow op."""
  v1: Dict[int, list] = collections.defaultdict(list)
  prefix: Dict[int, str] = {}
  found = []
  for op in fwd_ops:
    if op.type in V2_OPS:
      found.append((op.name + "/", [op]))
      continue
    ctx = _outermost(_compat.control_flow_context(op))
    if ctx is not None:
      v1[id(ctx)].append(op)
      prefix[id(ctx)] = ctx.name.rsplit("/", 1)[0] + "/" if "/" in ctx.name \
          else ctx.name + "/"
  found += [(prefix[k], ops) for k, ops in v1.items()]
  return found


def read_layer(t: tf.Tensor, var_layer) -> Optional[str]:
  """The layer whose variable ``t`` is (a handle) or reads whole."""
  if _graph_util.is_handle(t):
    return var_layer.get(_graph_util.variable_of_handle(t))
  op = t.op
  while op.type in ("Identity", "Enter") and op.inputs:
    source = _graph_util.read_variable_source(op)
    if source is not None:
      return var_layer.get(source)
    op = op.inputs[0].op
  source = _graph_util.read_variable_source(op)
  return var_layer.get(source) if source is not None else None


def _frame_layers(ops, op_layer, var_layer) -> Set[str]:
  names = {op.name for op in ops}
  layers = set()
  for op in ops:
    if op_layer.get(op.name) is not None:
      layers.add(op_layer[op.name])
    for t in op.inputs:
      if t.op.name not in names:
        read = read_layer(t, var_layer)
        if read is not None:
          layers.add(read)
  return layers


def join_control_flow(fwd_ops, op_layer, var_layer, consumers) -> None:
  """Moves each frame that reads exactly one layer into that layer.

  Args:
    fwd_ops: the forward ops.
    op_layer: op name -> layer name, updated in place.
    var_layer: variable op name -> layer name.
    consumers: tensor name -> consuming forward ops.
  """
  for scope, ops in frames(fwd_ops):
    layers = _frame_layers(ops, op_layer, var_layer)
    if len(layers) != 1:
      continue
    (layer,) = layers
    members = set()
    for op in ops:
      if op_layer.get(op.name) is None:
        op_layer[op.name] = layer
      members.add(op.name)
    _join_plumbing(ops, scope, layer, op_layer, consumers)


def _join_plumbing(ops, scope, layer, op_layer, consumers) -> None:
  """Adds the frame's array ops and in-scope plumbing around it to ``layer``."""
  def joins(op):
    return op_layer.get(op.name) is None and (
        is_array_op(op) or op.name.startswith(scope))

  stack = list(ops)
  while stack:
    op = stack.pop()
    near = [t.op for t in op.inputs]
    near += [c for t in op.outputs for c in consumers.get(t.name, ())]
    for other in near:
      if joins(other):
        op_layer[other.name] = layer
        stack.append(other)


def frame_of_handle(t: tf.Tensor, consumers_of) -> Optional[tf.Operation]:
  """The v2 control-flow op that takes the variable handle ``t``, if any.

  ``consumers_of(tensor)`` lists a tensor's forward consumers.
  """
  for c in consumers_of(t):
    if c.type in V2_OPS:
      return c
    if c.type in ("Identity", "ReadVariableOp"):
      for out in c.outputs:
        found = frame_of_handle(out, consumers_of)
        if found is not None:
          return found
  return None
