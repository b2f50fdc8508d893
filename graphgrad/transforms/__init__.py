"""Gradient transforms for :class:`graphgrad.GradientPlan`.

Example:
  >>> import graphgrad as gg
  >>> gg.transforms.chain(gg.transforms.scale(0.5),
  ...                     gg.transforms.clip_by_norm(1.0))
  chain(scale(0.5), clip_by_norm(1.0))
"""

from graphgrad.transforms._context import Resources, TransformContext
from graphgrad.transforms._group import (
                              GroupTransform,
                              clip_by_global_norm,
                              trust_ratio,
)
from graphgrad.transforms._linear_transform import linear
from graphgrad.transforms._noise import add_noise
from graphgrad.transforms._numerics import (
                              ApplyIfFinite,
                              apply_if_finite,
                              check_numerics,
)
from graphgrad.transforms._per_example import per_example
from graphgrad.transforms._transforms import (
                              Transform,
                              as_transform,
                              chain,
                              clip_by_norm,
                              clip_by_value,
                              identity,
                              reverse,
                              scale,
                              zero,
)

__all__ = [
    "ApplyIfFinite", "GroupTransform", "Resources", "Transform",
    "TransformContext", "add_noise", "apply_if_finite", "as_transform",
    "chain", "check_numerics", "clip_by_global_norm", "clip_by_norm",
    "clip_by_value", "identity", "linear", "per_example", "reverse", "scale",
    "trust_ratio", "zero",
]
