"""Multi-task gradient methods, as values: ``gg.mtl``.

Each factory returns a small :class:`TaskMethod` whose ``combine(grads)``
turns ``k`` task gradients of one shape into one gradient, in TF1 and TF2.
Dot products, norms and the Gram matrix run over the whole flattened tensor,
batch included; where TorchJD 0.18 has the method, it agrees.

Example:
  >>> import tensorflow as tf
  >>> import graphgrad as gg
  >>> g = [tf.constant([1., 0.]), tf.constant([-1., 1.])]
  >>> gg.mtl.upgrad()
  upgrad(pref_vector=None, norm_eps=0.0001, reg_eps=0.0001)
  >>> gg.mtl.sum().combine(g).numpy()
  array([0., 1.], dtype=float32)
"""

from graphgrad.methods._mtl_base import TaskMethod, mean, sum
from graphgrad.methods._mtl_direct import config, graddrop
from graphgrad.methods._mtl_methods import (
                                            aligned_mtl,
                                            cagrad,
                                            dualproj,
                                            imtl_g,
                                            mgda,
                                            upgrad,
)
from graphgrad.methods._mtl_stateful import MethodState, gradvac, nash_mtl
from graphgrad.methods._pcgrad import pcgrad

__all__ = ["MethodState", "TaskMethod", "aligned_mtl", "cagrad", "config",
           "dualproj", "graddrop", "gradvac", "imtl_g", "mean", "mgda",
           "nash_mtl", "pcgrad", "sum", "upgrad"]
