"""The declaring methods that GradientPlan and KerasPlan share.

Both plans record the same declarations into one ``Declarations``, so each
declaring method is written once, in :class:`Declaring`: it resolves the
layers, records the declaration and returns the plan. What only one
executor can check (a layer graph's boundary, a Keras layer's variables)
is the plan's hook of that kind, ``_check_upstream`` and the like, run
after the shared checks and before the declaration is recorded, so that a
refused declaration leaves nothing behind.
"""

from typing import Any, Callable, Optional, Sequence, Tuple, TypeVar, Union

from graphgrad.core._declaration_model import Declarations
from graphgrad.core._privacy import check_privacy
from graphgrad.core._task_combination import check_at

# A layer reference: a layer name (a KerasPlan also takes an "outer/inner"
# path, or the Keras layer itself).
LayerRef = Union[str, Any]

_P = TypeVar("_P", bound="Declaring")


class Declaring:
  """The declarations both plans make alike.

  A mixin of ``GradientPlan`` and ``KerasPlan``, which set ``_declarations``
  and override the hooks their executor needs (each one does nothing here).
  """

  _declarations: Declarations

  def transform_upstream(self: _P, layer: LayerRef, fn) -> _P:
    """Rewrites the gradient that ``layer`` passes to everything below it.

    With ``g`` the gradient at ``layer``'s outputs (summed over all
    consumers), the layer's own variables get their gradients from ``g``;
    its inputs, and everything below them, get what backpropagating
    ``fn(g)`` through the layer gives. Paths that bypass the layer (skips,
    regularizers, second heads) are unchanged. Transforms on several layers
    compose top-down; several on one layer chain in declaration order.

    On a GradientPlan, a layer no gradient can pass through (no path from
    its inputs to its outputs, or all glue) *warns once* (``graphgrad``
    logger) rather than raising, so one transform on every layer keeps
    working; the bottom layer is quiet. On a KerasPlan, on the bottom layer
    of a ``Sequential`` or functional model (no layer with trainable
    variables before it) it changes nothing, and warns once.

    Args:
      layer: layer name; on a KerasPlan, a Keras layer name (or
        ``"outer/inner"`` path, or the layer).
      fn: a transform or a callable ``g -> g`` keeping shape and dtype.

    Returns:
      The plan, for chaining.

    Raises:
      LayerNotFoundError: if ``layer`` is unknown (on a GradientPlan, or all
        non-trainable).
      NotConnectedError: on a GradientPlan, if the layer's variables do not
        reach the loss.
      UnsupportedGraphError: on a GradientPlan, if the layer is applied
        inside a v2 ``tf.cond`` or ``tf.while_loop`` with other layers (the
        message names the op).
      GraphGradError: if ``fn`` is not callable or is a group transform, or
        the plan is built (on a KerasPlan, a tape was opened); on a
        GradientPlan, if the layer has no output tensor to rewrite.
    """
    name = self._declarations.resolve(layer, "layer")
    self._declarations.add_upstream(
        name, fn, validate=lambda: self._check_upstream(name))
    return self

  def transform_inputs(self: _P, layer: LayerRef, fn) -> _P:
    """Rewrites the gradient ``layer`` sends to each of its inputs.

    With ``dx_j`` what the layer's backward step gives its input ``j`` (the
    VJP of the gradient at its outputs, after the layer's
    :meth:`transform_upstream` or instead of it its
    :meth:`replace_backward`), input ``j`` gets ``fn(dx_j)``. The layer's
    own variables, and paths that bypass the layer, are unchanged. It is
    the input side of :meth:`transform_upstream`: for a linear ``fn`` the
    two give the same gradients, for a non-linear one (``clip_by_norm``)
    they differ. Several on one layer chain in declaration order.

    On a GradientPlan, the inputs are the tensors the layer's ops read from
    outside it; on a KerasPlan, the floating-point inputs of its ``call``.
    The layers warn and refuse as for :meth:`transform_upstream`, whose
    checks they share.

    Args:
      layer: layer name; on a KerasPlan, a Keras layer name (or
        ``"outer/inner"`` path, or the layer).
      fn: a transform or a callable ``g -> g`` keeping shape and dtype.

    Returns:
      The plan, for chaining.

    Raises:
      LayerNotFoundError: if ``layer`` is unknown.
      UnsupportedGraphError: on a GradientPlan, as
        :meth:`transform_upstream`.
      GraphGradError: if ``fn`` is not callable or is a group transform, or
        the plan is built (on a KerasPlan, a tape was opened); on a
        GradientPlan, if the layer has no floating-point output; when the
        plan's rules are compiled, if ``privatize`` is declared too (the
        transform acts before the clip).

    Example:
      >>> import tensorflow as tf, graphgrad as gg
      >>> model = tf.keras.Sequential(
      ...     [tf.keras.layers.Dense(1, use_bias=False, name=n,
      ...                            kernel_initializer="ones")
      ...      for n in ("d0", "d1")])
      >>> plan = gg.KerasPlan(model).transform_inputs(
      ...     "d1", gg.transforms.clip_by_norm(1.0))
      >>> with plan.tape() as tape:
      ...   loss = tf.reduce_sum(3.0 * model(tf.constant([[2.0]])))
      >>> [g.numpy().tolist() for g in tape.gradient(loss)]  # d0: 2 * clip(3)
      [[[2.0]], [[6.0]]]
    """
    name = self._declarations.resolve(layer, "layer")
    self._declarations.add_inputs(
        name, fn,
        validate=lambda: self._check_upstream(name, "transform_inputs"))
    return self

  def transform_gradients(self: _P,
                          layer: Union[LayerRef, Sequence[LayerRef]],
                          fn) -> _P:
    """Rewrites each of ``layer``'s own parameter gradients.

    With a list of layers, ``fn`` sees their parameter gradients together,
    after each layer's own ``transform_gradients``: BERT's
    ``clip_by_global_norm(1.0)`` over every variable, after a layer-wise
    scale, is ``transform_gradients(plan.layer_names, clip)``.

    Args:
      layer: layer name, or a list of layer names (every layer:
        :attr:`layer_names`); on a KerasPlan, a Keras layer name (or
        ``"outer/inner"`` path, or the layer), or a list of them.
      fn: a transform or a callable ``g -> g`` keeping shape and dtype,
        applied to each gradient (on a KerasPlan, summed over all paths); or
        a ``gg.transforms.GroupTransform`` (``clip_by_global_norm``,
        ``trust_ratio``), applied to the layer's (or the listed layers')
        ``(grad, var)`` list at once. On a KerasPlan, the layer's variables
        among ``tape.gradient``'s sources form the group.

    Returns:
      The plan, for chaining.

    Raises:
      LayerNotFoundError: if ``layer`` is unknown.
      NotConnectedError: on a GradientPlan, if the layer's variables do not
        reach the loss.
      GraphGradError: if ``fn`` is not callable, ``layer`` is an empty
        list, or the plan is built (on a KerasPlan, a tape was opened); on a
        KerasPlan, if the layer is built and holds no trainable variable
        (all non-trainable, or none at all).
    """
    self._declarations.add_gradients(layer, fn,
                                     validate=self._check_gradients)
    return self

  def transform_edge(self: _P, lower: LayerRef, upper: LayerRef, fn) -> _P:
    """Rewrites only the gradient ``upper`` sends directly into ``lower``.

    On a KerasPlan, the order along one path is: ``upper``'s upstream
    transform, then the edge transform, then the sum at ``lower``'s
    outputs, then ``lower``'s upstream transform. On a GradientPlan, an
    edge whose boundary depends on no trainable variable warns once.

    Args:
      lower: the layer nearer the input.
      upper: the layer nearer the loss; on a GradientPlan, ``net.graph``
        must have the edge ``lower -> upper``; on a KerasPlan, it is fed by
        ``lower``'s outputs through ops and layers without variables.
      fn: a transform or a callable ``g -> g`` keeping shape and dtype.

    Returns:
      The plan, for chaining.

    Raises:
      LayerNotFoundError: if either name is unknown.
      UnsupportedGraphError: on a GradientPlan, as
        :meth:`transform_upstream`, for ``lower``.
      GraphGradError: if both name one layer, ``fn`` is not callable, or
        the plan is built (on a KerasPlan, a tape was opened); on a
        GradientPlan, if there is no such edge (the message lists the real
        neighbours). On a KerasPlan, when ``upper``'s backward finds no
        gradient into ``lower``'s outputs, ``tape.gradient`` raises
        ``NotConnectedError``.
    """
    lo = self._declarations.resolve(lower, "lower")
    up = self._declarations.resolve(upper, "upper")
    self._declarations.add_edge(
        lo, up, fn, validate=lambda: self._check_edge(lo, up))
    return self

  def replace_backward(self: _P, layer: LayerRef, fn) -> _P:
    """Computes what ``layer`` sends to its inputs with ``fn``, not W^T.

    ``layer``'s own parameters still get their gradients from the true
    upstream gradient at its outputs; everything below the layer receives,
    at each of the layer's input tensors (on a KerasPlan, at each
    floating-point input of its ``call``), what ``fn`` returns (plus,
    unchanged, contributions that bypass the layer). An upstream transform
    on the same layer is applied first: ``fn`` sees the transformed
    gradient. See ``gg.backward`` for feedback alignment, direct feedback
    alignment and synthetic gradients.

    On a KerasPlan, ``gg.backward.feedback_alignment`` (on ``Dense``
    layers), ``direct_feedback_alignment`` and ``synthetic`` give, for the
    same ``seed``, the feedback matrices and initial modules of
    ``GradientPlan``; ``synthetic`` takes its labels from
    ``plan.tape(labels=y)``. A user-written ``fn``'s ``check`` and
    ``cuts``, if any, see the model's layers.

    Args:
      layer: layer name; on a KerasPlan, a Keras layer name (or
        ``"outer/inner"`` path, or the layer).
      fn: a ``gg.backward`` replacement, or a callable mapping a
        ``gg.backward.BackwardContext`` to one gradient per
        ``context.inputs`` tensor.

    Returns:
      The plan, for chaining.

    On a GradientPlan, a layer with nowhere to send the result (no input,
    or no float input above other layers) warns once, as
    :meth:`transform_upstream` does.

    Raises:
      LayerNotFoundError: if ``layer`` (or DFA's ``error_layer``) is
        unknown.
      UnsupportedGraphError: on a GradientPlan, as
        :meth:`transform_upstream`; on a KerasPlan, feedback alignment on a
        built layer that is not ``Dense``.
      GraphGradError: if ``fn`` is not callable, the layer already has a
        replacement, the replacement cannot handle the layer (e.g. feedback
        alignment on a convolution), or the plan is built (on a KerasPlan,
        a tape was opened); on a KerasPlan, if ``synthetic`` was given
        ``labels`` or DFA's error layer is ambiguous.
    """
    name = self._declarations.resolve(layer, "layer")
    self._declarations.add_backward(
        name, fn, validate=lambda: self._check_backward(name, fn))
    return self

  def recompute(self: _P, keep: Optional[Sequence[LayerRef]] = None) -> _P:
    """Recomputes forward ops in the backward pass instead of keeping them.

    On a GradientPlan, the backward pass keeps the outputs of the layers in
    ``keep``, plus the tensors the loss and the plan's declarations read
    (cut tensors, task losses). Every other forward op between two kept
    tensors is recomputed, segment by segment, just before its backward,
    and the copy is differentiated; gradients equal the plan's without
    recompute. Random ops are not recomputed: their forward values are
    reused. Variable reads, stateful ops, loops, conds and overridden ops
    are never recomputed; a segment holding a stateful op, a loop or an
    overridden op keeps its activations.

    On a KerasPlan, every call of a top-level layer of the model (one the
    model calls directly, a residual unit or a ``Dense``) is recomputed,
    unless it holds a layer the plan names, ends an edge or is only read by
    a replacement: the backward pass keeps the outputs of the calls in
    ``keep`` (and what other code reads), and replays the calls in between,
    block by block, when the gradient reaches them. A layer the plan
    rewrites is recomputed with its declarations, applied on the replay.
    Gradients equal the plan's without recompute. Batch-norm statistics are
    updated once per step, by the forward pass; a dropout mask is the
    forward's (Keras 3 replays it from the same seed; a tf-keras
    ``Dropout`` keeps its activations). Memory is saved in a traced step
    (``tf.function``, ``fit``, ``strategy.run``); an eager step keeps every
    activation, with the same gradients. See docs/saving-memory.md.

    Args:
      keep: what the backward pass keeps, mixed in one list. On a
        GradientPlan: layer names (their outputs are kept), tensor names
        (``"l1/Relu:0"``; an op name with one output means that output)
        and ``tf.Tensor`` s of the loss's tf.Graph; a name is a layer's
        before an op's. On a KerasPlan, top-level layers (names, paths or
        the layers) and a functional model's symbolic tensors
        (``layer.output``: that layer's call is kept). ``None`` cuts the
        activations into about ``sqrt(n)`` blocks of equal bytes, ``n`` the
        layers (on a KerasPlan, the calls), each kept tensor (call) one
        that no skip connection jumps over.
        ``plan.kept_tensors()`` lists what is kept once the plan is built.

    Returns:
      The plan, for chaining.

    Raises:
      LayerNotFoundError: if a name in ``keep`` is unknown.
      NotConnectedError: on a GradientPlan, for a kept tensor off the
        loss's forward path (from the variables to the loss).
      GraphGradError: if ``keep`` is not a sequence, or the plan is built
        (on a KerasPlan, a tape was opened); for an eager tensor, a tensor
        of another tf.Graph, or an op name with several outputs; on a
        KerasPlan, if ``keep`` names a nested layer or a tensor name.
      UnsupportedGraphError: on a GradientPlan, for a kept tensor inside a
        loop; when the plan is built, for a random op whose value depends
        on the parameters (it can neither be reused nor recomputed).

    Example:
      >>> import tensorflow as tf, graphgrad as gg
      >>> model = tf.keras.Sequential(
      ...     [tf.keras.layers.Dense(4, activation="relu", name=f"d{i}")
      ...      for i in range(4)])
      >>> plan = gg.KerasPlan(model).recompute(keep=["d1"])
      >>> @tf.function
      ... def step(x):
      ...   with plan.tape() as tape:
      ...     loss = tf.reduce_sum(model(x))
      ...   return tape.gradient(loss)
      >>> len(step(tf.ones([2, 3])))
      8
    """
    self._check_first("recompute", "recompute")
    self._declarations.add_recompute(keep, "recompute", self._check_recompute,
                                     read=self._keep_reader())
    return self

  def privatize(self: _P, l2_norm_clip: float, noise_multiplier: float,
                seed: Optional[int] = None,
                expected_batch_size: Optional[float] = None) -> _P:
    """Trains with DP-SGD: per-example clipping and Gaussian noise.

    The plan's loss (on a KerasPlan, the loss given to ``tape.gradient``)
    must be the vector of per-example losses ``l``, shape ``[B]``. The
    gradient of each variable becomes its share of

        (1/B) (sum_i clip_C(grad l_i) + N(0, sigma^2 C^2 I)),

    with ``B`` the global batch size: ``expected_batch_size`` when given,
    else in ``fit`` (a KerasPlan's ``attach``) fit's batch size, the same
    for the partial last batch of an epoch, or ``plan.tape(batch_size=B)``'s,
    else the realized size, summed over the replicas inside
    ``strategy.run``, where the first replica alone adds the noise (one
    draw per global batch), or over a GradientPlan's ``reduce_fn``, which
    reduces the clipped sums before every replica adds the same noise.
    Under Poisson sampling, which the accounting of ``gg.dp`` assumes, pass
    ``expected_batch_size``: the realized size depends on the data.

    where ``clip_C`` scales each example's whole gradient (all the plan's
    variables together; on a KerasPlan, all the sources) to L2 norm at most
    ``C``. Each example's norm comes from each parametric op's input and the
    gradient at its output (ghost clipping), and the clipped sum from the
    same two tensors (book-keeping), with no second backward pass; the
    algorithm is the same in both plans. ``transform_gradients`` acts after
    the noise. On a KerasPlan, norms come from each ``Dense``, ``Conv2D``,
    ``Embedding`` and ``LayerNormalization`` call's input and output
    gradient; another layer holding variables gets exact per-example
    gradients through its own call (logged once). docs/privacy.md gives the
    rule of each op type and what is refused.

    Args:
      l2_norm_clip: ``C``.
      noise_multiplier: ``sigma``; 0 clips without noise.
      seed: the noise's seed, for tests only: leave it ``None`` so that the
        noise is drawn from a key the operating system makes unpredictable.
        Either way a step counter makes every step's noise new.
      expected_batch_size: the divisor ``B`` under Poisson sampling (the
        sampling rate times the dataset size); ``None`` divides by
        ``fit``'s batch size in ``fit``, else by the realized global batch
        size.

    Returns:
      The plan, for chaining.

    Raises:
      GraphGradError: for a bad argument, a second ``privatize``, a built
        plan (on a KerasPlan, after a tape was opened). On a GradientPlan:
        if the loss is not a vector, or for a ``reduce_fn`` without
        ``replicas``; when built, for declarations that mix examples
        before the clip or rewrite the backward pass (``combine_tasks``,
        ``transform_upstream``, ``transform_edge``, ``replace_backward``,
        ``override_gradient``), or a loss-scale optimizer. On a KerasPlan:
        when a tape opens, for declarations that act before the clip or a
        ``loss_scale``; in ``tape.gradient``, for a loss that is not a
        vector.
      UnsupportedGraphError: on a GradientPlan, when built, for batch
        normalization in training mode, a variable read inside a
        ``tf.while_loop``, or a variable reaching the loss other than per
        example; on a KerasPlan, in the tape, for a trainable
        ``BatchNormalization``, or a variable used outside its layer.

    Example:
      >>> import numpy as np, tensorflow as tf, graphgrad as gg
      >>> with tf.Graph().as_default():
      ...   x = tf.constant([[1.0], [10.0]])
      ...   w = tf.compat.v1.get_variable("w", initializer=[[1.0]])
      ...   plan = gg.GradientPlan(tf.reduce_sum(x @ w, axis=1))
      ...   (g, _), = plan.privatize(1.0, 0.0).compute_gradients()
      ...   with tf.compat.v1.Session() as s:
      ...     s.run(tf.compat.v1.global_variables_initializer())
      ...     print(s.run(g).tolist())  # (min(1, 1) + min(10, 1)) / 2
      [[1.0]]
      >>> model = tf.keras.Sequential([tf.keras.layers.Dense(
      ...     1, use_bias=False, kernel_initializer="ones")])
      >>> plan = gg.KerasPlan(model).privatize(1.0, 0.0)
      >>> with plan.tape() as tape:
      ...   loss = tf.reduce_sum(model(tf.constant([[1.0], [10.0]])), axis=1)
      >>> [g.numpy().tolist() for g in tape.gradient(loss)]
      [[[1.0]]]
    """
    caller = f"{self._declarations.owner}.privatize"
    privacy = check_privacy(l2_norm_clip, noise_multiplier, seed, caller,
                            expected_batch_size)
    self._check_first("privatize", caller)
    self._declarations.add_privatize(privacy, caller)
    self._privatized(privacy)
    return self

  # -- task combinations (the plans' public methods differ) ----------------

  def _combine(self: _P, layers, losses, method, at: str) -> _P:
    """``combine_tasks`` at ``at``; ``losses`` ``None`` on a KerasPlan."""
    if check_at(at, layers) == "parameters":
      names = self._declarations.resolve_layers(layers, "combine_tasks")
      losses = self._task_losses("", losses, "combine_tasks")
      self._declarations.add_parameter_tasks(
          names, losses, method,
          validate=lambda: self._check_parameter_tasks(names))
      return self
    return self._tasks(layers, losses, method, "combine_tasks")

  def _tasks(self: _P, layer, losses, method, caller: str) -> _P:
    """Combines the task gradients at ``layer``'s outputs."""
    name = self._declarations.resolve(layer, "layer")
    losses = self._task_losses(name, losses, caller)
    self._declarations.add_tasks(
        name, losses, method, validate=lambda: self._check_tasks(name, caller))
    return self

  # -- the plan's own checks (hooks) ---------------------------------------

  def _check_first(self, method: str, caller: str) -> None:
    """Checks ``method`` before the shared checks (``caller`` names it)."""

  def _check_upstream(self, name: str,
                      method: str = "transform_upstream") -> None:
    """Checks ``method`` (``transform_upstream`` or ``transform_inputs``,
    a transform of what passes through the layer) on the layer ``name``."""

  def _check_gradients(self, layers: Union[str, Tuple[str, ...]]) -> None:
    """Checks ``transform_gradients`` on a layer, or a group's names."""

  def _check_edge(self, lower: str, upper: str) -> None:
    """Checks ``transform_edge(lower, upper)``."""

  def _check_backward(self, name: str, fn) -> None:
    """Checks ``replace_backward(name, fn)``."""

  def _check_recompute(self, keep: Optional[Tuple[str, ...]]) -> None:
    """Checks the layers ``recompute`` keeps (``None``: its choice)."""

  def _keep_reader(self) -> Callable[[Any], Tuple[str, Any]]:
    """Reads an item of ``recompute(keep=...)``: ``("tensor", name)`` for
    a tensor kept by name, ``("layer", ref)`` for a layer reference."""
    return lambda item: ("layer", item)

  def _privatized(self, privacy) -> None:
    """Acts on the ``privatize`` just recorded."""

  def _task_losses(self, name: str, losses, caller: str):
    """The checked task losses of a combination at ``name`` (``""``: in
    parameter space)."""
    return losses

  def _check_tasks(self, name: str, caller: str) -> None:
    """Checks a task combination at the layer ``name``."""

  def _check_parameter_tasks(self, names: Optional[Tuple[str, ...]]
                             ) -> None:
    """Checks a task combination over the parameters of ``names``."""
