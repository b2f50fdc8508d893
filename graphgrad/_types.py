"""Type aliases shared by graphgrad's public signatures.

And two helpers on gradient values.
"""

from typing import Callable, Mapping, Sequence, Tuple, Union

import tensorflow as tf

Tensor = tf.Tensor
IndexedSlices = tf.IndexedSlices
Variable = tf.Variable
# What a gradient can be in a TF1 graph: dense, sparse, or absent.
Gradient = Union[tf.Tensor, tf.IndexedSlices, None]
GradientFn = Callable[[Gradient], Gradient]
GradsAndVars = Sequence[Tuple[Gradient, tf.Variable]]
# `layers=` of gg.analyze: a layer name mapped to a scope prefix or to
# variables.
LayerSpec = Mapping[str, Union[str, Sequence[tf.Variable]]]


def gradient_values(g: Gradient) -> Union[tf.Tensor, None]:
  """The dense tensor of a gradient: ``g.values`` when it is sparse."""
  return g.values if isinstance(g, tf.IndexedSlices) else g


def sum_gradients(parts: Sequence[Gradient]) -> Gradient:
  """Sums gradients, taking ``None`` as zero; ``None`` when all are ``None``.

  One present part is returned as it is (sparse stays sparse); several are
  made dense and added.
  """
  present = [p for p in parts if p is not None]
  if not present:
    return None
  if len(present) == 1:
    return present[0]
  return tf.add_n([tf.convert_to_tensor(p) for p in present])
