"""GradientPlan and its TF1 executor, the segment engine.

``_gradient_plan`` is GradientPlan, with two mixins (the training methods
of ``_training_methods``, the op overrides of ``_op_override``): it checks
each declaration (``_declaration_checks``), records it in its ``Declarations``
(``graphgrad.core``), and builds them once with ``_executor.build``, which
turns them into rules of the segment engine (``_engine``, with its spans of
linear layers; cuts in ``_cuts``; the VJP of one call, its hooks and bounded
walk, and the accumulators in ``_backprop``). ``_summaries``, ``_picture``,
``_report`` and ``_advice`` read a built plan through its public accessors.
"""
