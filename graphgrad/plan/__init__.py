"""The declarations of a plan, GradientPlan, and its TF1 segment engine.

``_declarations`` holds what a plan declares (shared with KerasPlan);
``_plan`` is GradientPlan's declaring front and ``_training`` its building
half (``compute_gradients``, ``apply_gradients``, ``summaries``);
``_executor.build`` turns the declarations into hooks of the segment engine
(``_engine``, which plans its cuts in ``_cuts``, keeps its accumulators and
makes its segment calls in ``_backprop``, with the bounded walk ``_reach``);
``_summaries`` and
``_advice`` read a plan through its public accessors.
"""
