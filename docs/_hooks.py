"""mkdocs hooks: the performance page shows benchmarks/RESULTS.md as it is.

``performance.md`` holds the marker ``<!-- RESULTS.md -->``; it is replaced by
``benchmarks/RESULTS.md`` with its headings one level down and its pictures
served from ``benchmarks/``.
"""

import os
import re

from mkdocs.structure.files import File

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_BENCH = os.path.join(_ROOT, "benchmarks")
_PICTURES = ("depth.png", "methods.png")
MARKER = "<!-- RESULTS.md -->"


def on_files(files, config):
  for name in _PICTURES:
    if os.path.isfile(os.path.join(_BENCH, name)):
      files.append(File.generated(config, f"img/bench/{name}",
                                  abs_src_path=os.path.join(_BENCH, name)))
  return files


def on_page_markdown(markdown, page, config, files):
  if MARKER not in markdown:
    return markdown
  with open(os.path.join(_BENCH, "RESULTS.md"), encoding="utf-8") as f:
    results = f.read()
  results = re.sub(r"^(#+) ", r"#\1 ", results, flags=re.MULTILINE)
  for name in _PICTURES:
    results = results.replace(f"]({name})", f"](img/bench/{name})")
  return markdown.replace(MARKER, results)
