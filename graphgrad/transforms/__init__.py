"""Gradient transforms for :class:`graphgrad.GradientPlan`.

Example:
  >>> import graphgrad as gg
  >>> gg.transforms.chain(gg.transforms.scale(0.5), gg.transforms.clip_by_norm(1.0))
  chain(scale(0.5), clip_by_norm(1.0))
"""

from graphgrad.transforms._group import (
                              GroupTransform,
                              clip_by_global_norm,
                              trust_ratio,
)
from graphgrad.transforms._transforms import (
                              Transform,
                              TransformContext,
                              add_noise,
                              as_transform,
                              chain,
                              clip_by_norm,
                              clip_by_value,
                              identity,
                              linear,
                              reverse,
                              scale,
                              zero,
)

__all__ = [
    "GroupTransform", "Transform", "TransformContext", "add_noise",
    "as_transform", "chain", "clip_by_global_norm", "clip_by_norm",
    "clip_by_value", "identity", "linear", "reverse", "scale", "trust_ratio", "zero",
]
