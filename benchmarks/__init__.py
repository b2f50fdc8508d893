"""graphgrad's benchmark suite: ``python -m benchmarks``.

See docs/performance.md.

Not part of the installed package. Each benchmark *suite* is a module of this
package that registers itself with :func:`register`; ``python -m benchmarks``
imports every public module here (``benchmarks/<name>.py``), runs the
registered suites in order and writes one report. A new suite, such as a TF2
Keras step benchmark in ``benchmarks/keras_step.py``, plugs in with::

  import benchmarks

  def run(config: benchmarks.Config) -> benchmarks.SuiteResult:
    ...
    return benchmarks.SuiteResult(markdown="## Keras step\\n...", data={...})

  benchmarks.register("keras_step", run, order=30)
"""

import dataclasses
import importlib
import logging
import pkgutil
from typing import Any, Callable, Dict, List, Optional

log = logging.getLogger("graphgrad.benchmarks")


@dataclasses.dataclass(frozen=True)
class Config:
  """What a suite run is asked to do.

  Attributes:
    tiny: the smoke-test configuration: seconds, a couple of small models.
    out_dir: where the suite may write files (plots); the report goes here.
    reps: repetitions of each timed measurement (alternating variants).
    only: if set, names of models or cases to run; others are skipped.
    grappler_off: also measure step time with Grappler's rewrites disabled.
  """
  tiny: bool = False
  out_dir: str = "."
  reps: int = 7
  only: Optional[List[str]] = None
  grappler_off: bool = True


@dataclasses.dataclass
class SuiteResult:
  """What a suite returns: a Markdown section and its raw numbers."""
  markdown: str
  data: Dict[str, Any] = dataclasses.field(default_factory=dict)
  figures: List[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Suite:
  name: str
  run: Callable[[Config], SuiteResult]
  order: int = 50
  in_tiny: bool = True
  # Optional: (data, out_dir) -> Markdown, to redraw a report from saved
  # numbers (python -m benchmarks --render) without measuring again.
  render: Optional[Callable[[Dict[str, Any], str], str]] = None


_REGISTRY: Dict[str, Suite] = {}


def register(name: str, run: Callable[[Config], SuiteResult], order: int = 50,
             in_tiny: bool = True,
             render: Optional[Callable[[Dict[str, Any], str], str]] = None
             ) -> None:
  """Registers a suite under ``name``; lower ``order`` runs first."""
  _REGISTRY[name] = Suite(name, run, order, in_tiny, render)


def suites() -> List[Suite]:
  """Imports every public module of this package; returns suites in order."""
  for info in pkgutil.iter_modules(__path__):
    if not info.name.startswith("_"):
      importlib.import_module(f"{__name__}.{info.name}")
  return sorted(_REGISTRY.values(), key=lambda s: (s.order, s.name))
