"""``graphgrad scan``: is a saved model safe to load? Read, never run.

Decodes every MetaGraph of a model (never imports or runs it) and lists each
op that is not pure compute (:mod:`graphgrad.cli._ops`), in the graph or in
any function of its library, with its path through the functions that reach
it, and what loading the model runs: the checkpoint restore, the init ops,
the resources' initializers, the assets fed to it. A checkpoint save or
restore whose every op and wire is one TensorFlow's ``Saver`` or
``tf.saved_model.save`` writes is recognised as the standard one
(``_standard_checkpoint`` states the rule) and its I/O ops are not
findings; an op added to it makes it non-standard, and every I/O op in it
is reported.
Exit status 0 when nothing is found, 1 when something is, 2 on an error.
"""

import argparse
import collections
import json
import os
import sys
from typing import Any, Dict, List, Optional, Set, Tuple

from graphgrad.cli import _args
from graphgrad.cli._args import CommandError
from graphgrad.cli._standard_checkpoint import (
  CheckpointPart,
  calls,
  checkpoint_part,
  node_name,
)

VERSION = 1
# Where a SavedModel's loader finds its init op: the signature TF2 writes,
# then the collections v1's builder writes (loader_impl's order).
_INIT_SIGNATURE = "__saved_model_init_op"
_INIT_COLLECTIONS = ("saved_model_main_op", "legacy_init_op")
# Children of a resource object that tf.saved_model.load calls.
_RESOURCE_FUNCTIONS = ("_create_resource", "_initialize")

# Ops that talk to other machines or processes.
_NETWORK = ("RemoteCall", "DataService", "RegisterDataset", "Collective",
            "_Send", "_Recv", "_HostSend", "_HostRecv", "Send", "Recv")
_PYTHON = ("PyFunc", "PyFuncStateless", "EagerPyFunc")


def add_parser(sub) -> argparse.ArgumentParser:
  """Registers the ``scan`` subcommand on ``sub`` (from add_subparsers)."""
  p = sub.add_parser(
      "scan", help="list what a saved model can do besides compute, and "
                   "what loading it runs, without running it",
      description="Reads a saved model without importing or running it and "
                  "lists every op that is not pure compute (files, "
                  "printing, checkpoints, the network, unknown op types), "
                  "with its path through the functions that reach it, and "
                  "what loading the model runs: the checkpoint restore, "
                  "init ops, resource initializers and assets. The "
                  "standard checkpoint save and restore are recognised by "
                  "structure and not reported. Exit status 0 when nothing "
                  "is found, 1 when something is, 2 on an error.")
  p.add_argument("path", metavar="PATH",
                 help="a .meta file (binary or text), a SavedModel "
                      "directory (saved_model.pb or saved_model.pbtxt), or "
                      "a frozen GraphDef (.pb or .pbtxt)")
  p.add_argument("--tag", metavar="TAG",
                 help="scan only the SavedModel's MetaGraph of this tag "
                      "(default: every MetaGraph)")
  p.add_argument("--json", metavar="OUT.json",
                 help="also write the findings as a JSON document")
  from graphgrad.cli import _sandbox  # pylint: disable=g-import-not-at-top
  _sandbox.add_flags(p, runs_graph=False)
  p.set_defaults(command_spec=_sandbox.ModelCommand(
      check=check, reads=reads, compute=compute, finish=finish))
  return p


def check(args) -> None:
  """``scan``'s argument checks, in the command line's own process."""
  if args.json and not args.json.lower().endswith(".json"):
    raise CommandError(f"--json {args.json!r}: the file name must end in "
                       f".json")
  if args.json:
    _args.check_output("--json", args.json)
  if args.tag is not None and not os.path.isdir(args.path):
    raise CommandError(f"--tag {args.tag!r}: only a SavedModel directory "
                       f"has tags; {args.path!r} is not a directory")


def reads(args) -> List[str]:
  return [args.path]


def compute(args) -> Dict[str, Any]:
  """``scan``'s work, in the sandboxed child: the findings as JSON data."""
  _args.quiet_tensorflow(getattr(args, "verbose", False))
  from graphgrad.analysis import _metagraph  # pylint: disable=g-import-not-at-top
  _args.phase("reading the model")
  meta_graphs = _metagraph.read_meta_graphs(args.path, args.tag)
  _args.phase("scanning the graph")
  saved_model = _metagraph.kind_of(args.path) == "SavedModel"
  findings: List[dict] = []
  on_load: List[dict] = []
  standard: List[dict] = []
  for label, meta_graph in meta_graphs:
    scanned = scan_meta_graph(meta_graph, saved_model)
    for item in scanned["findings"] + scanned["on_load"] + scanned["standard"]:
      item["meta_graph"] = label
    for item in scanned["on_load"]:
      item["findings"] = [i + len(findings) for i in item["findings"]]
    findings += scanned["findings"]
    on_load += scanned["on_load"]
    standard += scanned["standard"]
  from graphgrad.analysis import _signature_graph  # pylint: disable=g-import-not-at-top
  kind = _metagraph.kind_of(args.path)
  if saved_model and all(_signature_graph.is_tf2(m) for _, m in meta_graphs):
    kind = _metagraph.TF2
  return {"scan": {
      "version": VERSION, "model": args.path, "kind": kind,
      "meta_graphs": [label for label, _ in meta_graphs],
      "clean": not findings, "findings": findings, "on_load": on_load,
      "standard": standard}}


# -- reading the graph -------------------------------------------------------


def why(node, library) -> Optional[str]:
  """What the op of ``node`` (a NodeDef) can do besides compute in memory,
  or ``None`` for a pure compute op or a call of a library function.

  Example:
    >>> from tensorflow.core.framework import node_def_pb2
    >>> node = node_def_pb2.NodeDef(op="PrintV2")
    >>> node.attr["output_stream"].s = b"file:///tmp/x"
    >>> why(node, {})
    'prints to a file (file:///tmp/x): writes a file'
    >>> why(node_def_pb2.NodeDef(op="MatMul"), {})
  """
  from graphgrad.cli import _ops  # pylint: disable=g-import-not-at-top
  op = node.op
  if op in library:
    return None
  if _ops.is_pure(op):
    attr = _ops.file_attr(node)
    if attr is None:
      return None
    return f"opens the file its attr {attr!r} names"
  if op == "PrintV2":
    stream = node.attr["output_stream"].s.decode("utf-8", "replace")
    if stream.startswith("file://"):
      return f"prints to a file ({stream}): writes a file"
    return f"prints (to {stream or 'stderr'})"
  kind = _ops.io_kind(op)
  if kind is not None:
    return kind
  if op.startswith(_NETWORK):
    return "uses the network or another process"
  if op in _PYTHON:
    return ("runs a Python function that the file does not hold (the "
            "loading program supplies it)")
  return ("unknown op type: neither pure compute nor a known I/O op, so "
          "graphgrad cannot say what it does")


def _function_paths(nodes, library, gradients
                    ) -> Tuple[Dict[str, List[str]], List[dict]]:
  """The shortest path to each function from the graph's ``nodes``, then
  from each function that no node reaches; and a finding for each call of a
  function the library lacks."""
  from graphgrad.analysis._graph_util import linked_functions  # pylint: disable=g-import-not-at-top
  paths: Dict[str, List[str]] = {}
  missing: List[dict] = []
  queue: collections.deque = collections.deque(
      ([node.name], via, f, node) for node in nodes
      for via, f in calls(node, library))
  roots = iter(sorted(library))
  while True:
    while queue:
      prefix, via, name, caller = queue.popleft()
      if name in paths:
        continue
      paths[name] = prefix + [name if via in (None, "f")
                              else f"{name} ({via})"]
      if name not in library:
        if caller is not None:
          missing.append(_finding(
              caller, paths[name][:-1], None,
              f"calls the function {name!r}, which the model's library "
              f"lacks"))
        continue
      for node in library[name].node_def:
        queue += [(paths[name] + [node.name], v, f, node)
                  for v, f in calls(node, library)]
      queue += [(paths[name], how, f, None)
                for how, f in linked_functions(name, library)]
      if name in gradients:
        queue.append((paths[name], "its gradient", gradients[name], None))
    unreached = next((f for f in roots if f not in paths), None)
    if unreached is None:
      return paths, missing
    queue.append(([], None, unreached, None))


def _finding(node, path: List[str], function: Optional[str],
             reason: str) -> dict:
  return {"op": node.name, "type": node.op, "path": list(path),
          "function": function, "why": reason}


def scan_meta_graph(meta_graph, saved_model: bool = True) -> dict:
  """The findings, what runs on load, and the standard checkpoint parts of
  one ``MetaGraphDef``.

  Returns:
    ``{"findings": [...], "on_load": [...], "standard": [...]}``: each
    finding names its op, type, path (the graph's node, then each function
    and node on the way to it), innermost function, why it matters and
    whether loading runs it; each ``on_load`` entry lists the indices of
    the findings it runs.
  """
  graph_def = meta_graph.graph_def
  library = {f.signature.name: f for f in graph_def.library.function}
  gradients = {g.function_name: g.gradient_func
               for g in graph_def.library.gradient}
  nodes = {n.name: n for n in graph_def.node}
  parts = [checkpoint_part(meta_graph, which, library, saved_model)
           for which in ("restore", "save")]
  exempt_nodes = set().union(*(p.nodes for p in parts if p.standard))
  exempt_functions = {p.function for p in parts if p.standard and p.function}
  paths, findings = _function_paths(graph_def.node, library, gradients)
  for node in graph_def.node:
    reason = why(node, library)
    if reason and node.name not in exempt_nodes:
      findings.append(_finding(node, [node.name], None, reason))
  for name, path in paths.items():
    if name not in library or name in exempt_functions:
      continue
    for node in library[name].node_def:
      reason = why(node, library)
      if reason:
        findings.append(_finding(node, path + [node.name], name, reason))
  on_load = _on_load(meta_graph, parts[0], nodes, library, saved_model)
  loaded_nodes: Set[str] = set()
  loaded_functions: Set[str] = set()
  for item in on_load:
    reached_nodes, reached_functions = item.pop("reach")
    item["findings"] = [
        i for i, f in enumerate(findings)
        if (f["function"] in reached_functions if f["function"]
            else f["path"][0] in reached_nodes)]
    loaded_nodes |= reached_nodes
    loaded_functions |= reached_functions
  for f in findings:
    f["on_load"] = (f["function"] in loaded_functions if f["function"]
                    else f["path"][0] in loaded_nodes)
  standard = [{"what": f"checkpoint {p.which}", "op": p.root,
               "function": p.function, "reads": p.reads}
              for p in parts if p.standard]
  return {"findings": findings, "on_load": on_load, "standard": standard}


# -- what loading runs --------------------------------------------------------


def _on_load(meta_graph, restore: CheckpointPart, nodes, library,
             saved_model: bool) -> List[dict]:
  """What loading the model runs or reads, each with what it reaches
  (``"reach"``: graph nodes and functions)."""
  found: List[dict] = []
  if restore.root:
    text = (f"the standard checkpoint restore (reads {restore.reads})"
            if restore.standard else
            f"not the standard checkpoint restore: {restore.reason}")
    found.append({"what": "checkpoint restore", "op": restore.root,
                  "standard": restore.standard, "text": text,
                  "reach": _reach(nodes, library, [restore.root], [])})
  if saved_model:
    found += _init_ops(meta_graph, nodes, library)
    found += _resource_functions(meta_graph, nodes, library)
  for asset in meta_graph.asset_file_def:
    found.append({"what": "asset", "op": node_name(asset.tensor_info.name),
                  "standard": None,
                  "text": f"assets/{asset.filename} is fed to "
                          f"{asset.tensor_info.name}",
                  "reach": (set(), set())})
  return found


def _init_ops(meta_graph, nodes, library) -> List[dict]:
  sources: Dict[str, List[str]] = {}
  if _INIT_SIGNATURE in meta_graph.signature_def:
    for out in meta_graph.signature_def[_INIT_SIGNATURE].outputs.values():
      sources.setdefault(node_name(out.name), []).append(
          f"the {_INIT_SIGNATURE} signature")
  for key in _INIT_COLLECTIONS:
    if key in meta_graph.collection_def:
      for value in meta_graph.collection_def[key].node_list.value:
        sources.setdefault(node_name(value), []).append(
            f"the {key} collection")
  return [{"what": "init op", "op": name, "standard": None,
           "text": f"named by {' and '.join(where)}",
           "reach": _reach(nodes, library, [name], [])}
          for name, where in sources.items()]


def _resource_functions(meta_graph, nodes, library) -> List[dict]:
  """The functions ``tf.saved_model.load`` calls to create and initialize
  the resources (lookup tables) of the object graph."""
  objects = meta_graph.object_graph_def.nodes
  names = _object_names(objects)
  found = []
  for index, obj in enumerate(objects):
    if obj.WhichOneof("kind") != "resource":
      continue
    for child in obj.children:
      if child.local_name not in _RESOURCE_FUNCTIONS or not (
          0 <= child.node_id < len(objects)):
        continue
      functions = _concrete_functions(objects[child.node_id])
      found.append({
          "what": "resource function", "op": child.local_name,
          "standard": None,
          "text": f"{child.local_name} of {names.get(index, str(index))}: "
                  f"{', '.join(functions) or '(no function)'}",
          "reach": _reach(nodes, library, [], functions)})
  return found


def _object_names(objects) -> Dict[int, str]:
  """Each object's path from the root object, ``t.table``."""
  if not objects:
    return {}
  names = {0: "the root object"}
  queue = collections.deque([(0, "")])
  while queue:
    index, path = queue.popleft()
    for child in objects[index].children:
      if child.node_id not in names and 0 <= child.node_id < len(objects):
        full = f"{path}.{child.local_name}" if path else child.local_name
        names[child.node_id] = full
        queue.append((child.node_id, full))
  return names


def _concrete_functions(obj) -> List[str]:
  kind = obj.WhichOneof("kind")
  if kind == "function":
    return list(obj.function.concrete_functions)
  if kind == "bare_concrete_function":
    return [obj.bare_concrete_function.concrete_function_name]
  return []


def _reach(nodes, library, graph_roots: List[str], function_roots: List[str]
           ) -> Tuple[Set[str], Set[str]]:
  """The graph's nodes that running ``graph_roots`` runs, and the functions
  those and ``function_roots`` call, transitively."""
  from graphgrad.analysis._graph_util import linked_functions  # pylint: disable=g-import-not-at-top
  reached: Set[str] = set()
  stack = list(graph_roots)
  while stack:
    name = stack.pop()
    if name in reached or name not in nodes:
      continue
    reached.add(name)
    stack += [node_name(i) for i in nodes[name].input]
  functions: Set[str] = set()
  todo = list(function_roots) + [f for n in sorted(reached)
                                 for _, f in calls(nodes[n], library)]
  while todo:
    name = todo.pop()
    if name in functions or name not in library:
      continue
    functions.add(name)
    todo += [f for node in library[name].node_def
             for _, f in calls(node, library)]
    todo += [f for _, f in linked_functions(name, library)]
  return reached, functions


# -- the report, in the command line's own process ----------------------------


def _clean(value: Any) -> str:
  """A string from the child, without control characters."""
  text = value if isinstance(value, str) else repr(value)
  return "".join(c if c.isprintable() else "?" for c in text)


def document(raw: Any) -> dict:
  """The scan the child sent, checked and rebuilt: the JSON document.

  Raises:
    CommandError: if it is not well formed.
  """
  try:
    findings = [{
        "meta_graph": _clean(f["meta_graph"]), "op": _clean(f["op"]),
        "type": _clean(f["type"]), "why": _clean(f["why"]),
        "path": [_clean(p) for p in f["path"]],
        "function": None if f["function"] is None else _clean(f["function"]),
        "on_load": bool(f["on_load"])} for f in raw["findings"]]
    on_load = [{
        "meta_graph": _clean(e["meta_graph"]), "what": _clean(e["what"]),
        "op": _clean(e["op"]), "text": _clean(e["text"]),
        "standard": None if e["standard"] is None else bool(e["standard"]),
        "findings": [int(i) for i in e["findings"]
                     if 0 <= int(i) < len(findings)]}
               for e in raw["on_load"]]
    standard = [{
        "meta_graph": _clean(s["meta_graph"]), "what": _clean(s["what"]),
        "op": _clean(s["op"]),
        "function": None if s["function"] is None else _clean(s["function"]),
        "reads": _clean(s["reads"])} for s in raw["standard"]]
    return {"version": VERSION, "model": _clean(raw["model"]),
            "kind": _clean(raw["kind"]),
            "meta_graphs": [_clean(m) for m in raw["meta_graphs"]],
            "clean": not findings, "findings": findings, "on_load": on_load,
            "standard": standard}
  except (KeyError, TypeError, ValueError) as e:
    raise CommandError(f"the scan the sandboxed process sent is not well "
                       f"formed ({type(e).__name__}: {_clean(e)})") from None


def report(doc: dict) -> str:
  """The human-readable text of a scan :func:`document`."""
  several = len(doc["meta_graphs"]) > 1

  def where(item: dict) -> str:
    return f"[{item['meta_graph']}] " if several else ""
  lines = [f"{doc['model']} ({doc['kind']}; "
           f"{', '.join(doc['meta_graphs'])}): "
           + (f"{len(doc['findings'])} op(s) that are not pure compute"
              if doc["findings"] else "nothing but pure compute")]
  if doc["findings"]:
    lines += ["", "findings:"]
    for f in doc["findings"]:
      load = "  (runs on load)" if f["on_load"] else ""
      lines.append(f"  {where(f)}{f['op']} ({f['type']}): {f['why']}{load}")
      lines.append(f"      {' -> '.join(f['path'])}")
  lines += ["", "runs on load:"]
  if not doc["on_load"]:
    lines.append("  nothing (importing this graph runs none of its ops)")
  for e in doc["on_load"]:
    lines.append(f"  {where(e)}{e['what']} {e['op']}: {e['text']}")
    for i in e["findings"]:
      f = doc["findings"][i]
      lines.append(f"      runs {f['op']} ({f['type']})")
  if doc["standard"]:
    lines += ["", "recognised (their checkpoint ops are not findings):"]
  for s in doc["standard"]:
    via = f" -> {s['function']}" if s["function"] else ""
    lines.append(f"  {where(s)}the standard {s['what']}: {s['op']}{via}")
  return "\n".join(lines) + "\n"


def finish(args, outcome: Dict[str, Any]) -> int:
  """Prints the scan and writes ``--json``; returns 0 when clean, else 1."""
  doc = document(outcome.get("scan"))
  sys.stdout.write(report(doc))
  if args.json:
    try:
      with open(args.json, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
    except OSError as e:
      raise CommandError(f"cannot write output: {e}") from None
    print(f"\nwrote {args.json}")
  return 0 if doc["clean"] else 1
