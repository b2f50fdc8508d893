"""Which graphgrad files one declaration's code path enters.

``python -m benchmarks.code_paths --label before`` builds a 3-layer dense
net (l1, l2, l3) per plan and declaration, builds it once untraced (imports
and one-time caches), then traces a fresh copy with ``sys.setprofile``. In
the trace: for ``graph``, the declaration and ``plan.compute_gradients()``
(``gg.analyze`` and ``GradientPlan(loss, net)`` are not); for ``keras``, the
declaration, ``with plan.tape() as tape:`` around the eager forward pass and
loss, and ``tape.gradient(loss, model.trainable_variables)``
(``KerasPlan(model)`` is not). Only calls of functions defined under
``graphgrad/`` count; what each figure means is in :func:`path_figures`.
Results are printed and merged into ``benchmarks/code_paths.json`` under
``--label``, other labels kept; ``--plans`` and ``--declarations`` select.
"""

import argparse
import ast
import dis
import io
import json
import os
import subprocess
import sys
import time
import tokenize
from typing import Callable, Dict, List, Optional, Tuple

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "code_paths.json")
PLANS = ("graph", "keras")
DECLARATIONS = ("scale_upstream", "privatize", "recompute_keep")
WHAT = {"scale_upstream": 'transform_upstream("l2", scale(0.8))',
        "privatize": "privatize(1.0, 1.1, seed=0)",
        "recompute_keep": 'recompute(keep=["l2"])'}
BATCH, WIDTH, CLASSES = 8, 16, 3
# Code objects that belong to the function that encloses them.
_INLINE = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>")
_GENERATOR_FLAGS = 0x20 | 0x80 | 0x200  # generator, coroutine, async gen.

Call = Tuple[str, str, int]  # (file relative to graphgrad/, qualname, line)


def _declare(plan, declaration: str):
  import graphgrad as gg  # pylint: disable=g-import-not-at-top
  if declaration == "scale_upstream":
    return plan.transform_upstream("l2", gg.transforms.scale(0.8))
  if declaration == "privatize":
    return plan.privatize(1.0, 1.1, seed=0)
  return plan.recompute(keep=["l2"])


def _graph_case(declaration: str) -> Callable[[], object]:
  """A fresh tf.Graph with the net and its plan; returns the traced call."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  import graphgrad as gg  # pylint: disable=g-import-not-at-top
  from benchmarks import _models  # pylint: disable=g-import-not-at-top
  tf1 = tf.compat.v1
  graph = tf.Graph()
  with graph.as_default():
    x = tf1.placeholder(tf.float32, [BATCH, WIDTH], name="x")
    y = tf1.placeholder(tf.float32, [BATCH, CLASSES], name="y")
    h = tf.nn.relu(_models._dense(x, WIDTH, "l1", seed=1))  # pylint: disable=protected-access
    h = tf.nn.relu(_models._dense(h, WIDTH, "l2", seed=2))  # pylint: disable=protected-access
    out = _models._dense(h, CLASSES, "l3", seed=3)  # pylint: disable=protected-access
    per_example = tf.reduce_sum(tf.square(out - y), axis=1)
    loss = per_example if declaration == "privatize" else tf.reduce_mean(
        per_example)
    plan = gg.GradientPlan(loss, gg.analyze(loss))

  def call():
    with graph.as_default():
      return _declare(plan, declaration).compute_gradients()
  return call


def _keras_case(declaration: str) -> Callable[[], object]:
  """A fresh Keras 3 model and its plan; returns the traced call."""
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  import graphgrad as gg  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  model = keras.Sequential([
      keras.Input((WIDTH,)),
      keras.layers.Dense(WIDTH, activation="relu", name="l1"),
      keras.layers.Dense(WIDTH, activation="relu", name="l2"),
      keras.layers.Dense(CLASSES, name="l3")])
  x = tf.constant(rng.normal(size=(BATCH, WIDTH)).astype(np.float32))
  y = tf.constant(rng.normal(size=(BATCH, CLASSES)).astype(np.float32))
  plan = gg.KerasPlan(model)

  def call():
    _declare(plan, declaration)
    with plan.tape() as tape:
      per_example = tf.reduce_sum(tf.square(model(x) - y), axis=1)
      loss = per_example if declaration == "privatize" else tf.reduce_mean(
          per_example)
    return tape.gradient(loss, model.trainable_variables)
  return call


CASES = {"graph": _graph_case, "keras": _keras_case}


class _Tracer:
  """Records the calls of functions under ``root``, in order (this thread's:
  ``sys.setprofile`` sees no other)."""

  def __init__(self, root: str):
    self._root = os.path.realpath(root) + os.sep
    self._files: Dict[str, Optional[str]] = {}
    self._first_resume: Dict[object, int] = {}
    self.calls: List[Call] = []

  def _relative(self, filename: str) -> Optional[str]:
    if filename not in self._files:
      path = os.path.realpath(filename)
      self._files[filename] = (os.path.relpath(path, self._root)
                               if path.startswith(self._root) else None)
    return self._files[filename]

  def _resumed(self, frame) -> bool:
    """Whether a generator's ``call`` event resumes it after a yield."""
    code = frame.f_code
    if not code.co_flags & _GENERATOR_FLAGS:
      return False
    if code not in self._first_resume:
      self._first_resume[code] = next(
          (i.offset for i in dis.get_instructions(code)
           if i.opname == "RESUME" and i.arg == 0), -1)
    return frame.f_lasti != self._first_resume[code]

  def __call__(self, frame, event, arg):
    del arg
    if event != "call":
      return
    code = frame.f_code
    rel = self._relative(code.co_filename)
    if rel is None or code.co_name in _INLINE or self._resumed(frame):
      return
    self.calls.append((rel, code.co_qualname, code.co_firstlineno))


def path_figures(calls: List[Call]) -> Dict[str, object]:
  """The figures of one traced path.

  Args:
    calls: the graphgrad calls in the order they happened, as
      ``(file, qualname, first line)``. A call is a Python function,
      method or lambda entered; a comprehension belongs to the function
      around it and a generator counts once, when first entered, not at
      each resumption.

  Returns:
    ``calls``: their number; ``functions``: distinct functions;
    ``files``: distinct files, with ``calls_per_file``; ``switches``:
    calls in a file other than the previous call's; ``reentries``: the
    switches into a file F that an earlier call had already entered.
    Such a call comes after a call in another file, so the path had left
    F in between: a re-entry is one more time a reader following the
    path comes back to a file already read. The first entry into each
    file is the only switch into it that is not a re-entry:
    ``reentries = switches - (files - 1)``.
  """
  seen, previous = set(), None
  switches = reentries = 0
  for f, _, _ in calls:
    if previous is not None and f != previous:
      switches += 1
      reentries += f in seen
    seen.add(f)
    previous = f
  per_file: Dict[str, int] = {}
  for f, _, _ in calls:
    per_file[f] = per_file.get(f, 0) + 1
  return {"calls": len(calls), "functions": len(set(calls)),
          "files": len(seen), "switches": switches, "reentries": reentries,
          "calls_per_file": dict(sorted(per_file.items()))}


def source_figures(root: str, files: List[str]) -> Dict[str, object]:
  """Lines and classes of ``files`` (relative to ``root``), summed.

  ``lines`` counts the lines that a token other than a comment spans
  (docstrings count, blank lines inside them too); ``docstring_lines``
  the lines of module, class and function docstrings among them;
  ``classes`` every ``class`` statement, nested ones too. ``per_file``
  gives the three for each file.
  """
  lines = doc = classes = 0
  per_file = {}
  for rel in files:
    with open(os.path.join(root, rel), encoding="utf-8") as f:
      text = f.read()
    code_lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
      if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE,
                          tokenize.INDENT, tokenize.DEDENT,
                          tokenize.ENDMARKER):
        code_lines.update(range(tok.start[0], tok.end[0] + 1))
    tree = ast.parse(text)
    file_doc = file_classes = 0
    for node in ast.walk(tree):
      if isinstance(node, ast.ClassDef):
        file_classes += 1
      body = getattr(node, "body", None)
      if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                            ast.AsyncFunctionDef)) and body
          and isinstance(body[0], ast.Expr)
          and isinstance(body[0].value, ast.Constant)
          and isinstance(body[0].value.value, str)):
        file_doc += body[0].end_lineno - body[0].lineno + 1
    per_file[rel] = {"lines": len(code_lines), "docstring_lines": file_doc,
                     "classes": file_classes}
    lines += len(code_lines)
    doc += file_doc
    classes += file_classes
  return {"lines": lines, "docstring_lines": doc, "classes": classes,
          "per_file": per_file}


def measure(plan: str, declaration: str) -> Dict[str, object]:
  """One untraced build, then the traced one; the figures of its path."""
  import graphgrad  # pylint: disable=g-import-not-at-top
  root = os.path.dirname(os.path.abspath(graphgrad.__file__))
  CASES[plan](declaration)()
  call = CASES[plan](declaration)
  tracer = _Tracer(root)
  start = time.perf_counter()
  sys.setprofile(tracer)
  try:
    call()
  finally:
    sys.setprofile(None)
  traced_s = time.perf_counter() - start
  figures = path_figures(tracer.calls)
  calls_per_file = figures.pop("calls_per_file")
  figures.update(source_figures(root, list(calls_per_file)))
  for rel, n in calls_per_file.items():
    figures["per_file"][rel]["calls"] = n
  figures["traced_s"] = round(traced_s, 3)
  return figures


def _table(results: Dict[str, Dict[str, Dict]]) -> str:
  rows = ["| plan | declaration | files | re-entries | switches | calls "
          "| functions | lines (without docstrings) | classes |",
          "|---|---|---|---|---|---|---|---|---|"]
  for plan, by_decl in results.items():
    for decl, r in by_decl.items():
      rows.append(f"| {plan} | `{WHAT[decl]}` | {r['files']} "
                  f"| {r['reentries']} | {r['switches']} | {r['calls']} "
                  f"| {r['functions']} | {r['lines']} "
                  f"({r['lines'] - r['docstring_lines']}) | {r['classes']} |")
  return "\n".join(rows)


def _commit() -> Optional[str]:
  """The checkout's commit, with ``+changes`` when the tree differs."""
  root = os.path.dirname(HERE)
  try:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, text=True,
                          capture_output=True, check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "graphgrad"],
                           cwd=root, text=True, capture_output=True,
                           check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return None
  return head + ("+changes" if dirty else "")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.code_paths",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--label", required=True,
                      help="key of this run in the JSON file (before, after)")
  parser.add_argument("--plans", default=",".join(PLANS))
  parser.add_argument("--declarations", default=",".join(DECLARATIONS))
  parser.add_argument("--out", default=OUT,
                      help="JSON file to merge into (default: %(default)s)")
  args = parser.parse_args(argv)
  import logging  # pylint: disable=g-import-not-at-top
  logging.getLogger("graphgrad").setLevel(logging.ERROR)
  plans = args.plans.split(",")
  declarations = args.declarations.split(",")
  unknown = set(plans) - set(PLANS) | set(declarations) - set(DECLARATIONS)
  if unknown:
    parser.error(f"unknown plan or declaration {sorted(unknown)}; known: "
                 f"{', '.join(PLANS + DECLARATIONS)}")
  start = time.perf_counter()
  results: Dict[str, Dict[str, Dict]] = {}
  for plan in plans:
    results[plan] = {d: measure(plan, d) for d in declarations}
  entry = {"declarations": {d: WHAT[d] for d in declarations},
           "commit": _commit(), "python": sys.version.split()[0], "wall_s":
           round(time.perf_counter() - start, 1), "results": results}
  print(_table(results))
  print(f"{entry['wall_s']} s")
  saved = {}
  if os.path.exists(args.out):
    with open(args.out, encoding="utf-8") as f:
      saved = json.load(f)
  saved[args.label] = entry
  with open(args.out, "w", encoding="utf-8") as f:
    json.dump(saved, f, indent=1)
    f.write("\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
