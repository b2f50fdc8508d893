"""Backward replacements for :meth:`graphgrad.GradientPlan.replace_backward`.

Example:
  >>> import graphgrad as gg
  >>> gg.backward.feedback_alignment(seed=0)
  feedback_alignment(seed=0)
"""

from graphgrad.methods._dfa import direct_feedback_alignment
from graphgrad.methods._fa import feedback_alignment
from graphgrad.methods._replacement import (
                                 BackwardContext,
                                 BackwardResult,
                                 DenseMatMul,
                                 Replacement,
                                 feedback_matrix_value,
)
from graphgrad.methods._synthetic import (
                                 SyntheticModule,
                                 module_values,
                                 synthetic,
)

__all__ = [
    "BackwardContext", "BackwardResult", "DenseMatMul",
    "KerasBackwardContext", "Replacement", "SyntheticModule",
    "direct_feedback_alignment", "feedback_alignment",
    "feedback_matrix_value", "module_values", "synthetic",
]

# The name the one context type had on a KerasPlan.
KerasBackwardContext = BackwardContext
