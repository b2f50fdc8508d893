"""GradientPlan's training methods: backward replacements, task combinations.

:class:`TrainingMethods` declares, at a layer of a ``tf.Graph`` plan, what
the methods of ``gg.mtl`` (``combine_tasks``, ``project_conflicts``) do, and
checks what only a ``tf.Graph`` plan can check of them and of
``replace_backward`` (``gg.backward``: feedback alignment, synthetic
gradients), which ``core._declaring`` declares for both plans: the
replacement can handle the layer, the task losses, the layers that hold the
plan's variables. The executor builds them with every other declaration.
"""

from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple, TypeVar

import networkx as nx
import tensorflow as tf

from graphgrad import _errors
from graphgrad.analysis._layer_graph import LayerGraph
from graphgrad.core._declaration_model import Declarations
from graphgrad.core._declaring import Declaring
from graphgrad.methods import _pcgrad
from graphgrad.methods._replacement import as_replacement
from graphgrad.plan import _declaration_checks

_P = TypeVar("_P", bound="TrainingMethods")


class TrainingMethods(Declaring):
  """``combine_tasks`` and ``project_conflicts``, and GradientPlan's checks
  of the declarations of :class:`~graphgrad.core._declaring.Declaring`.

  A mixin of GradientPlan, which sets ``_declarations`` and ``_var_list``
  and has ``net``.
  """

  _declarations: Declarations
  _var_list: Tuple[tf.Variable, ...]

  if TYPE_CHECKING:  # GradientPlan's property, for the type checker

    @property
    def net(self) -> LayerGraph: ...

  def combine_tasks(self: _P, layers, losses: Sequence[tf.Tensor],
                    method, at: str = "output") -> _P:
    """Combines the task gradients at a shared layer with ``method``.

    ``at="output"`` (the default) combines them at one layer's outputs
    ``T``. With ``g`` the gradient at ``T`` and ``g_i = dL/dL_i * dL_i/dT``
    the share of task loss ``L_i`` in it, the gradient at ``T`` becomes

        g - sum_i g_i + method.combine([g_1, ..., g_n]):

    terms of the plan's loss other than the listed losses (a regulariser, an
    unlisted head) pass unchanged, and weights in the loss
    (``L = 0.5 L_a + L_b``) are respected. The layer's own parameters and
    everything below it see the combined gradient (the layer belongs to the
    shared trunk); an upstream transform on the layer acts after it, on the
    combined gradient. With several output tensors, each ``g_i`` is the
    concatenation of the task's flattened gradients at all of them (zeros
    where the task does not reach one), so the method's dot products run
    over all of ``T``, batch included; a task loss that reaches none of
    ``T`` is left out. Each task loss is backpropagated once, from the loss
    to ``T`` only; rewrites declared above the layer act on ``g`` only. A
    stateful method (``gg.mtl.gradvac``, ``gg.mtl.nash_mtl``) gets its
    state made once for this plan and layer, in :attr:`resources`.

    ``at="parameters"`` combines them in parameter space, as the PCGrad
    authors' ``PCGrad_tf.py`` and TorchJD's ``backward`` do. ``g_i = dL/dL_i
    * dL_i/dtheta`` is task ``i``'s gradient of the variables of ``layers``
    (every variable the plan differentiates for ``layers=None``), flattened
    and concatenated into one vector (zeros where the task does not reach a
    variable); with ``G`` the plan's gradient of those variables, they get

        G - sum_i g_i + method.combine([g_1, ..., g_n])

    split back to their shapes, before their ``transform_gradients``. As at
    the outputs, unlisted terms of the loss and its weights pass unchanged,
    and the plan's backward rewrites act on ``G`` only: each ``g_i`` is the
    plain backward pass of ``L_i`` (with the plan's gradient overrides).
    Variables outside ``layers`` keep the plan's gradient ``G``. It costs
    one backward pass per task loss, to those variables; when nothing else
    rewrites the backward pass, the plan's own pass skips them and their
    ``G - sum_i g_i`` is a pass over the loss with the task losses held
    constant (``stop_gradients``), which crosses only the unlisted terms, so
    with every layer it costs what ``PCGrad_tf.py`` costs. With
    ``reduce_fn`` each task's gradients are reduced before they are
    combined. A plan has at most one such declaration.

    Args:
      layers: ``at="output"``: the shared layer, whose outputs feed the task
        heads. ``at="parameters"``: a layer name, a list of them, or
        ``None`` for every variable of the plan.
      losses: two or more scalar task losses; the plan's loss must depend on
        each, and none may depend on another.
      method: a task-combination method such as ``gg.mtl.upgrad()``:
        ``method.combine(grads)`` takes ``k`` task gradients of one shape
        and returns one gradient of that shape; one with
        ``create_state(k, name=None)`` gets ``combine(grads, state=...)``.
        :meth:`project_conflicts` uses ``gg.mtl.pcgrad()``.
      at: ``"output"`` or ``"parameters"``.

    Returns:
      The plan, for chaining.

    Raises:
      LayerNotFoundError: if a layer is unknown.
      NotConnectedError: if the plan's loss does not depend on a listed loss.
      GraphGradError: if ``at`` is neither level, ``losses`` is not a list
        of at least two distinct, separate scalar losses, ``method`` has no
        ``combine``, the layer (or the plan, in parameter space) already
        combines task gradients, a listed layer has no variable of the
        plan, or the plan is built.

    Example:
      >>> import tensorflow as tf, graphgrad as gg
      >>> with tf.Graph().as_default():
      ...   w = tf.compat.v1.get_variable("w", initializer=[1.0, 1.0])
      ...   la, lb = w[0], w[1] - w[0]  # gradients [1, 0] and [-1, 1]
      ...   plan = gg.GradientPlan(la + lb).combine_tasks(
      ...       None, [la, lb], gg.mtl.pcgrad(), at="parameters")
      ...   (g, _), = plan.compute_gradients()
      ...   with tf.compat.v1.Session() as s:
      ...     s.run(tf.compat.v1.global_variables_initializer())
      ...     print(s.run(g).tolist())
      [0.5, 1.5]
    """
    return self._combine(layers, losses, method, at)

  def project_conflicts(self: _P, layer: str,
                        losses: Sequence[tf.Tensor], shuffle: bool = False,
                        seed: Optional[int] = None) -> _P:
    """Applies PCGrad's projection to the task gradients at a layer's outputs.

    ``combine_tasks(layer, losses, pcgrad(shuffle, seed))``: the projection
    of PCGrad (Yu et al., 2020, "Gradient Surgery for Multi-Task Learning")
    applied at the layer's outputs ``T``, a cheaper variant of the paper's
    PCGrad, which projects over all parameters (that is
    ``combine_tasks(None, losses, gg.mtl.pcgrad(), at="parameters")``). Each
    task gradient ``g_i`` at ``T`` that conflicts with another ``g_j``
    (``g_i . g_j < 0``, dot products over all of ``T``, batch included) is
    projected onto the normal plane of ``g_j``, the other tasks taken in
    list order (or a random one with ``shuffle``), ``g_i <- g_i - (g_i .
    g_j) / ||g_j||^2 g_j``; the gradient
    at ``T`` becomes ``g - sum_i g_i + sum_i g_i^PC``. With two tasks, the
    result has a non-negative dot product with both. A task loss that does
    not reach an output counts as a zero gradient there. See
    :meth:`combine_tasks` for what sees the result.

    Args:
      layer: the shared layer, whose outputs feed the task heads.
      losses: two or more scalar task losses; the plan's loss must depend on
        each, and none may depend on another.
      shuffle: take the other tasks in a random order, drawn at each step
        (with two tasks the order does not matter); ``False`` by default.
      seed: op-level seed of the shuffles.

    Returns:
      The plan, for chaining.

    Raises:
      LayerNotFoundError, NotConnectedError, GraphGradError: as
        :meth:`combine_tasks`.
    """
    return self._tasks(layer, losses, _pcgrad.pcgrad(shuffle, seed),
                       "project_conflicts")

  # -- GradientPlan's own checks ------------------------------------------

  def _check_backward(self, name: str, fn) -> None:
    _declaration_checks.check_declaration(
        self.net, "replace_backward", name,
        then=lambda: as_replacement(fn).check(self.net, name))

  def _task_losses(self, name: str, losses, caller: str):
    del name  # every task loss is checked against the whole layer graph
    return check_losses(self.net, losses, caller)

  def _check_tasks(self, name: str, caller: str) -> None:
    _declaration_checks.check_declaration(self.net, caller, name)

  def _check_parameter_tasks(self, names: Optional[Tuple[str, ...]]) -> None:
    held = {self.net.layer_of_variable(v) for v in self._var_list}
    empty = [n for n in names or () if n not in held]
    if empty:
      raise _errors.GraphGradError(
          f"combine_tasks(at='parameters'): layer(s) "
          f"{', '.join(map(repr, empty))} hold no variable this plan "
          f"differentiates (its var_list), so there is nothing to combine "
          f"there. Name layers with trainable variables.")


def check_losses(net: LayerGraph, losses, method: str) -> List[tf.Tensor]:
  """Checks the task ``losses`` of a plan's ``method`` against the layer
  graph (the plan's loss depends on each, none on another); returns a list."""
  if isinstance(losses, tf.Tensor) or not isinstance(losses, (list, tuple)):
    raise _errors.GraphGradError(
        f"{method}: `losses` must be a list of at least two scalar "
        f"loss tensors; got {type(losses).__name__}. Pass e.g. "
        f"losses=[loss_a, loss_b].")
  losses = list(losses)
  if len(losses) < 2:
    raise _errors.GraphGradError(
        f"{method}: `losses` must hold at least two losses to "
        f"project against each other; got {len(losses)}.")
  for i, l in enumerate(losses):
    if not isinstance(l, tf.Tensor) or not l.dtype.is_floating or (
        l.shape.rank != 0):
      raise _errors.GraphGradError(
          f"{method}: `losses[{i}]` must be a floating-point scalar "
          f"tensor; got {l!r}. Reduce each task loss to a scalar "
          f"(tf.reduce_mean).")
    if l.graph is not net.loss.graph or l.op.name not in net.op_graph:
      raise _errors.NotConnectedError(
          f"{method}: the plan's loss {net.loss.name} does not "
          f"depend on `losses[{i}]` {l.name}. List the task losses whose "
          f"(weighted) sum is the plan's loss.")
  names = [l.name for l in losses]
  if len(set(names)) != len(names):
    raise _errors.GraphGradError(
        f"{method}: `losses` lists a tensor twice: {names}. List "
        f"each task loss once.")
  for a in losses:
    for b in losses:
      if a is not b and nx.has_path(net.op_graph, a.op.name, b.op.name):
        raise _errors.GraphGradError(
            f"{method}: `losses` {b.name} depends on {a.name}, so "
            f"their gradients overlap. List task losses that are separate "
            f"terms of the plan's loss, not partial sums.")
  return losses
