"""GradientPlan and its TF1 executor, the segment engine.

``_plan`` is GradientPlan's declaring front and ``_training`` its building
half (``compute_gradients``, ``apply_gradients``, ``summaries``);
``_executor.build`` turns the declarations (``graphgrad.core``) into rules
of the segment engine (``_engine``, which plans its cuts in ``_cuts``, its
spans of linear layers in ``_spans``, keeps its accumulators and makes its
segment calls in ``_backprop``, with the bounded walk ``_reach``);
``_summaries`` and ``_advice`` read a plan through its public accessors.
"""
