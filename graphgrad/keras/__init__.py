"""KerasPlan and its tape: the TF2 executor of a plan's declarations."""
