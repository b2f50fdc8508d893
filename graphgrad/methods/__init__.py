"""Training methods: backward replacements (feedback alignment, DFA, synthetic gradients) and task combination (PCGrad)."""
