"""Training methods: backward replacements (feedback alignment, DFA,
synthetic gradients) and task combination (``gg.mtl``, PCGrad among them)."""
