"""The declarations of a plan, GradientPlan, and the TF1 segment engine that executes them."""
