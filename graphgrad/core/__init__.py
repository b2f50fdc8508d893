"""What both executors use: the declaration model, the compiled rules, and
the one backward step at a layer or an edge.

``_declaration_model`` holds what a plan declares and ``_rules`` its
compiled form; ``_gradients`` the helpers on gradient values (sums,
factors, override results); ``_layer_step`` the only code that acts at a
layer or an edge, against a VJP each executor supplies; ``_inert`` what
both say about a declaration that can change nothing. ``plan/`` (the TF1
executor) and ``keras/`` (the TF2 executor) import this package; it
imports neither.
"""
