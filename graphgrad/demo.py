"""Small problems for examples and notebooks: data and the seed network.

Example:
  >>> from graphgrad import demo
  >>> demo.seed_problem(0).x_train.shape
  (2048, 10)
"""

from graphgrad.cli._demo import (
                             DomainShiftProblem,
                             Problem,
                             dense,
                             domain_shift_problem,
                             multi_digits_problem,
                             seed_network,
                             seed_problem,
)

__all__ = ["DomainShiftProblem", "Problem", "dense", "domain_shift_problem",
           "multi_digits_problem", "seed_network", "seed_problem"]
