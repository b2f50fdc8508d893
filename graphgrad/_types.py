"""Type aliases shared by graphgrad's public signatures."""

from typing import Callable, Mapping, Sequence, Tuple, Union

import tensorflow as tf

Tensor = tf.Tensor
IndexedSlices = tf.IndexedSlices
Variable = tf.Variable
# What a gradient can be in a TF1 graph: dense, sparse, or absent.
Gradient = Union[tf.Tensor, tf.IndexedSlices, None]
GradientFn = Callable[[Gradient], Gradient]
GradsAndVars = Sequence[Tuple[Gradient, tf.Variable]]
# `layers=` of gg.analyze: a layer name mapped to a scope prefix or to variables.
LayerSpec = Mapping[str, Union[str, Sequence[tf.Variable]]]
