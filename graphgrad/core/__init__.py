"""What both executors use: the declaration model, gradient helpers, and the
per-layer policy.

``_declaration_model`` holds what a plan declares; ``_gradients`` the
helpers on gradient values (sums, factors, override results);
``_layer_policy`` the order in which one layer's declarations act on its
upstream gradient; ``_inert`` what both say about a declaration that can
change nothing. ``plan/`` (the TF1 executor) and ``keras/`` (the TF2
executor) import this package; it imports neither.
"""
