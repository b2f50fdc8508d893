"""Advice logged to the ``graphgrad`` logger about plans that defeat themselves.

A constant positive scale of a gradient changes little under an adaptive
optimizer: Adam, RMSProp and Adagrad divide each parameter's step by a running
estimate of that parameter's gradient magnitude, which scales by the same
factor. Only epsilon and the first few steps still see it.
"""

import logging
from typing import Iterable, Optional

from graphgrad.transforms._transforms import Transform

log = logging.getLogger("graphgrad")

# Class names, so that subclasses and the Keras optimizers are recognised too.
_ADAPTIVE = frozenset({"AdamOptimizer", "RMSPropOptimizer", "AdagradOptimizer",
                       "Adam", "AdamW", "RMSprop", "Adagrad"})


def is_adaptive(optimizer) -> bool:
  """True for an optimizer that normalises each parameter's step."""
  return any(c.__name__ in _ADAPTIVE for c in type(optimizer).__mro__)


def pure_scale(fns: Iterable[Transform]) -> Optional[float]:
  """The overall factor of transforms that only scale by positive numbers.

  Returns ``None`` when any transform does something else: a reversal
  (negative factor) or zero changes what the optimizer sees, and noise,
  clipping or a tensor-valued factor is not a constant scale.
  """
  factor = 1.0
  for t in fns:
    c = getattr(t, "linear_factor", None)  # group transforms have none
    if c is None or c <= 0:
      return None
    factor *= c
  return None if factor == 1.0 else factor


def warn_if_scale_cancels(declared, optimizer) -> bool:
  """Logs one warning when a plan's declarations (``declared``) only scale
  gradients under ``optimizer``.

  Returns:
    True when a warning was logged.
  """
  if not is_adaptive(optimizer):
    return False
  found = []
  for kind, table in (("transform_gradients", declared.gradients),
                      ("transform_upstream", declared.upstream),
                      ("transform_edge", declared.edges)):
    for key, fns in table.items():
      factor = pure_scale(fns if isinstance(fns, tuple) else (fns,))
      if factor is not None:
        where = (", ".join(map(repr, key)) if isinstance(key, tuple)
                 else repr(key))
        found.append(f"{kind}({where}) scales by {factor:g}")
  if not found:
    return False
  if len(found) > 3:  # one readable line, however many layers
    found = found[:3] + [f"and {len(found) - 3} more"]
  log.warning(
      "%s under %s: an adaptive optimizer divides each parameter's step by a "
      "running estimate of its gradient's magnitude, so a constant scale "
      "largely cancels out. To make these parameters learn faster or slower, "
      "give them their own learning rate (a second optimizer on their "
      "var_list), or train with tf.compat.v1.train.GradientDescentOptimizer "
      "or MomentumOptimizer, where a scale acts like a learning-rate factor.",
      "; ".join(found), type(optimizer).__name__)
  return True
