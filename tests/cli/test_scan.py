"""``graphgrad scan``: each op that is not pure compute, found by its path.

The models are built once (tests/cli/adversarial.py). Each expected path is
read from the model's own protocol buffer by hand, hop by hop (the graph's
call, the function its attr names, the node there, ...), not by the
scanner's walk. Most runs use ``--no-sandbox``; a few run sandboxed.
"""

import json
import os

import pytest
import tensorflow as tf
from tensorflow.core.protobuf import saved_model_pb2

from graphgrad.cli import _confine
from graphgrad.cli import _main as _cli
from helpers import error_line
from tests.cli import adversarial

tf1 = tf.compat.v1

needs_sandbox = pytest.mark.skipif(
    _confine.missing() is not None,
    reason=f"this kernel cannot confine: {_confine.missing()}")

# Built into one folder; each writes or reads ``target`` if it ever runs.
_META = ("write_file", "print_to_file", "save_v2", "save_v1", "read_file",
         "whole_file_reader", "write_in_nested_function", "unknown_op")
_SAVED = ("print_in_cond_branch", "save_in_while_body",
          "write_in_dataset_function", "write_in_restore_function",
          "print_in_v1_restore", "write_in_legacy_init_op",
          "clean_functional_control_flow", "clean_v1_saved_model")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  folder = tmp_path_factory.mktemp("scan")
  target = folder / "out" / "written.txt"
  built = {name: getattr(adversarial, name)(folder, target)
           for name in _META + _SAVED}
  built["print_in_cond_branch_pbtxt"] = adversarial.as_pbtxt(
      built["print_in_cond_branch"])
  import keras  # pylint: disable=g-import-not-at-top
  model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
  built["keras_export"] = str(folder / "keras_export")
  model.export(built["keras_export"], verbose=False)
  graph_def = _meta_graph(built["write_file"]).graph_def
  for name, as_text in (("frozen.pb", False), ("frozen.pbtxt", True)):
    tf.io.write_graph(graph_def, str(folder), name, as_text=as_text)
    built[name] = str(folder / name)
  built["folder"] = folder
  return built


def _meta_graph(path):
  """The (first) MetaGraphDef of a .meta file or a SavedModel."""
  if os.path.isdir(path):
    model = saved_model_pb2.SavedModel()
    with open(os.path.join(path, "saved_model.pb"), "rb") as f:
      model.ParseFromString(f.read())
    return model.meta_graphs[0]
  meta = tf1.MetaGraphDef()
  with open(path, "rb") as f:
    meta.ParseFromString(f.read())
  return meta


def _scan(path, tmp_path, *flags, sandbox=False):
  """``graphgrad scan PATH --json``: (exit code, the JSON document)."""
  out = tmp_path / "scan.json"
  argv = ["scan", str(path), "--json", str(out), *flags]
  code = _cli.main(argv + ([] if sandbox else ["--no-sandbox"]))
  return code, json.loads(out.read_text())


def _path(meta, first, hops, op_type):
  """The path to the one node of ``op_type`` at the end of ``hops``, read
  by hand: ``first`` is the graph's node; each hop is (the op type of the
  node in the current function, the attr that names the next function)."""
  library = {f.signature.name: f for f in meta.graph_def.library.function}
  node = next(n for n in meta.graph_def.node if n.name == first)
  path, function = [], ""
  for op_types, attr in [(None, "f")] + list(hops):
    if op_types is not None:
      (node,) = [n for n in library[function].node_def if n.op in op_types]
    function = node.attr[attr].func.name
    path += [node.name, function if attr == "f" else f"{function} ({attr})"]
  (last,) = [n for n in library[function].node_def if n.op == op_type]
  return path + [last.name]


def _wrapped(meta, hops, op_type):
  """The path from the signature's call through its wrapper function."""
  return _path(meta, "StatefulPartitionedCall",
               [("StatefulPartitionedCall", "f")] + hops, op_type)


def _only(doc, op_type):
  found = [f for f in doc["findings"] if f["type"] == op_type]
  assert len(found) == 1, doc["findings"]
  return found[0]


# -- the bypasses: ops ModelScan or saved_model_cli do not look for ----------


@pytest.mark.parametrize("name, op_type, why", [
    ("write_file", "WriteFile", "writes a file"),
    ("print_to_file", "PrintV2", "prints to a file (file://"),
    ("save_v2", "SaveV2", "saves a checkpoint"),
    ("save_v1", "Save", "saves a checkpoint"),
    ("read_file", "ReadFile", "reads a file"),
    ("whole_file_reader", "WholeFileReaderV2", "reads files"),
    ("whole_file_reader", "ReaderReadV2", "reads files"),
    ("unknown_op", "GraphgradCustomOp", "unknown op type"),
])
def test_an_op_of_the_graph_is_found(models, tmp_path, name, op_type, why):
  code, doc = _scan(models[name], tmp_path)
  assert code == 1 and doc["clean"] is False
  (node,) = [n for n in _meta_graph(models[name]).graph_def.node
             if n.op == op_type]
  found = _only(doc, op_type)
  assert (found["op"], found["path"], found["function"]) == (
      node.name, [node.name], None)
  assert found["why"].startswith(why), found
  assert found["on_load"] is False
  if op_type == "PrintV2":
    assert f"file://{models['folder']}/out/written.txt" in found["why"]


def test_a_function_named_inside_a_call_attr_is_found(models, tmp_path):
  code, doc = _scan(models["write_in_nested_function"], tmp_path)
  assert code == 1
  found = _only(doc, "WriteFile")
  # call_site's attr f = {name: outer, attr: {inner: evil}}: evil is
  # named by the call's attr f, and holds the write "w".
  assert found["path"] == ["call_site", "evil", "w"]
  assert found["function"] == "evil"


@pytest.mark.parametrize("name, hops, op_type", [
    ("print_in_cond_branch", [(("If", "StatelessIf"), "then_branch")],
     "PrintV2"),
    ("save_in_while_body", [(("While", "StatelessWhile"), "body")],
     "SaveV2"),
    ("write_in_dataset_function", [(("MapDataset",), "f")], "WriteFile"),
])
def test_an_op_in_a_tf_function_is_found_with_its_path(models, tmp_path,
                                                       name, hops, op_type):
  code, doc = _scan(models[name], tmp_path)
  assert code == 1
  found = _only(doc, op_type)
  want = _wrapped(_meta_graph(models[name]), hops, op_type)
  assert found["path"] == want
  assert found["function"] == want[-2].split(" ")[0]
  assert found["on_load"] is False
  assert [f["type"] for f in doc["findings"]] == [op_type]


def test_the_text_shows_the_path_and_why(models, tmp_path, capsys):
  code, doc = _scan(models["print_in_cond_branch"], tmp_path)
  out = capsys.readouterr().out
  found = _only(doc, "PrintV2")
  assert code == 1
  assert f"  {found['op']} (PrintV2): prints to a file (file://" in out
  assert "      " + " -> ".join(found["path"]) + "\n" in out
  assert " -> cond_true_" in out and " (then_branch) -> " in out


def test_saved_model_pbtxt_is_read_like_saved_model_pb(models, tmp_path):
  """ModelScan reads only saved_model.pb; the text form holds the same
  graph."""
  pbtxt = models["print_in_cond_branch_pbtxt"]
  assert sorted(os.listdir(pbtxt)).count("saved_model.pbtxt") == 1
  assert not os.path.exists(os.path.join(pbtxt, "saved_model.pb"))
  _, from_pb = _scan(models["print_in_cond_branch"], tmp_path)
  code, from_text = _scan(pbtxt, tmp_path)
  assert code == 1
  assert from_text["findings"] == from_pb["findings"]
  assert from_text["on_load"] == from_pb["on_load"]


@pytest.mark.parametrize("name", ["frozen.pb", "frozen.pbtxt"])
def test_a_frozen_graph_def_is_scanned(models, tmp_path, name):
  code, doc = _scan(models[name], tmp_path)
  assert code == 1 and doc["kind"] == "frozen GraphDef"
  assert _only(doc, "WriteFile")["path"] == [
      _only(_scan(models["write_file"], tmp_path)[1], "WriteFile")["op"]]
  assert doc["on_load"] == []


# -- the checkpoint restore and what else loading runs -----------------------


def _restore_function(meta):
  call = next(n for n in meta.graph_def.node
              if n.name == meta.saver_def.restore_op_name)
  name = call.attr["f"].func.name
  return call.name, next(f for f in meta.graph_def.library.function
                         if f.signature.name == name)


@pytest.mark.parametrize("name", ["clean_functional_control_flow",
                                  "clean_v1_saved_model", "keras_export"])
def test_a_clean_model_is_clean_and_its_restore_is_standard(
    models, tmp_path, capsys, name):
  meta = _meta_graph(models[name])
  # The checkpoint ops are there, and not findings.
  ops = {n.op for n in meta.graph_def.node} | {
      n.op for f in meta.graph_def.library.function for n in f.node_def}
  assert {"SaveV2", "RestoreV2", "MergeV2Checkpoints"} <= ops
  code, doc = _scan(models[name], tmp_path)
  assert code == 0, doc["findings"]
  assert doc["clean"] is True and doc["findings"] == []
  (restore,) = [e for e in doc["on_load"]
                if e["what"] == "checkpoint restore"]
  assert restore["op"] == meta.saver_def.restore_op_name
  assert restore["standard"] is True and restore["findings"] == []
  assert sorted(s["what"] for s in doc["standard"]) == [
      "checkpoint restore", "checkpoint save"]
  assert ("checkpoint restore " + restore["op"] + ": the standard "
          "checkpoint restore (reads variables/variables)") in (
              capsys.readouterr().out)


def test_v1_control_flow_is_in_the_clean_v1_model(models):
  ops = {n.op for n in _meta_graph(
      models["clean_v1_saved_model"]).graph_def.node}
  assert {"Switch", "Merge", "Enter", "Exit", "NextIteration"} <= ops


def test_an_op_added_to_the_restore_function_is_found(models, tmp_path):
  meta = _meta_graph(models["write_in_restore_function"])
  call, fdef = _restore_function(meta)
  code, doc = _scan(models["write_in_restore_function"], tmp_path)
  assert code == 1
  found = _only(doc, "WriteFile")
  assert found["path"] == [call, fdef.signature.name, "hidden_write"]
  assert found["on_load"] is True
  # No longer standard: its RestoreV2 is reported too.
  assert _only(doc, "RestoreV2")["function"] == fdef.signature.name
  (restore,) = [e for e in doc["on_load"]
                if e["what"] == "checkpoint restore"]
  assert restore["standard"] is False
  assert "'hidden_write' (WriteFile) is not one a standard checkpoint " \
         "restore uses" in restore["text"]
  assert doc["findings"].index(found) in restore["findings"]
  assert [s["what"] for s in doc["standard"]] == ["checkpoint save"]


def test_an_op_added_to_the_v1_restore_all_is_found(models, tmp_path):
  code, doc = _scan(models["print_in_v1_restore"], tmp_path)
  assert code == 1
  found = _only(doc, "PrintV2")
  assert (found["op"], found["path"], found["on_load"]) == (
      "hidden_print", ["hidden_print"], True)
  assert _only(doc, "RestoreV2")["op"] == "save/RestoreV2"
  (restore,) = [e for e in doc["on_load"]
                if e["what"] == "checkpoint restore"]
  assert restore["op"] == "save/restore_all"
  assert restore["standard"] is False


def test_a_write_in_the_legacy_init_op_runs_on_load(models, tmp_path):
  code, doc = _scan(models["write_in_legacy_init_op"], tmp_path)
  assert code == 1
  found = _only(doc, "WriteFile")
  assert (found["op"], found["on_load"]) == ("init_write", True)
  (init,) = [e for e in doc["on_load"] if e["what"] == "init op"]
  assert init["op"] == "legacy_init"
  # simple_save's legacy_init_op is written as the main op.
  meta = _meta_graph(models["write_in_legacy_init_op"])
  main_op = meta.collection_def["saved_model_main_op"].node_list.value
  assert list(main_op) == ["legacy_init"]
  assert init["text"] == "named by the saved_model_main_op collection"
  assert init["findings"] == [doc["findings"].index(found)]
  restore = [e for e in doc["on_load"] if e["what"] == "checkpoint restore"]
  assert restore[0]["standard"] is True


def test_a_tf2_init_op_is_named_by_its_signature(models, tmp_path):
  _, doc = _scan(models["clean_functional_control_flow"], tmp_path)
  (init,) = [e for e in doc["on_load"] if e["what"] == "init op"]
  meta = _meta_graph(models["clean_functional_control_flow"])
  out = meta.signature_def["__saved_model_init_op"].outputs
  assert init["op"] == out["__saved_model_init_op"].name
  assert init["text"].startswith(
      "named by the __saved_model_init_op signature")


def test_a_lookup_tables_file_runs_on_load_and_its_asset_is_listed(tmp_path):
  vocab = tmp_path / "vocab.txt"
  vocab.write_text("a\nb\n")

  class Table(tf.Module):

    def __init__(self):
      super().__init__()
      self.table = tf.lookup.StaticHashTable(tf.lookup.TextFileInitializer(
          str(vocab), tf.string, -2, tf.int64, -1), -1)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string)])
    def f(self, x):
      return self.table.lookup(x)
  tf.saved_model.save(Table(), str(tmp_path / "table"))
  code, doc = _scan(tmp_path / "table", tmp_path)
  assert code == 1
  found = _only(doc, "InitializeTableFromTextFileV2")
  assert found["on_load"] is True
  assert found["why"] == "reads a file (a lookup table's)"
  (asset,) = [e for e in doc["on_load"] if e["what"] == "asset"]
  assert asset["text"].startswith("assets/vocab.txt is fed to ")
  initialize = [e for e in doc["on_load"]
                if e["what"] == "resource function"
                and e["op"] == "_initialize"]
  assert initialize[0]["text"].startswith("_initialize of table: ")
  assert initialize[0]["findings"] == [doc["findings"].index(found)]


def test_json_is_a_stable_document(models, tmp_path):
  _, doc = _scan(models["save_in_while_body"], tmp_path)
  assert doc["version"] == 1
  assert sorted(doc) == ["clean", "findings", "kind", "meta_graphs", "model",
                         "on_load", "standard", "version"]
  assert sorted(doc["findings"][0]) == ["function", "meta_graph", "on_load",
                                        "op", "path", "type", "why"]
  assert doc["meta_graphs"] == ["serve"] and doc["kind"] == "TF2 SavedModel"


# -- forms and errors ---------------------------------------------------------


def test_tag_picks_one_meta_graph(models, tmp_path):
  code, doc = _scan(models["clean_v1_saved_model"], tmp_path, "--tag",
                    "serve")
  assert code == 0 and doc["meta_graphs"] == ["serve"]


@pytest.mark.parametrize("case, says", [
    ("corrupt", "cannot read .*saved_model.pb.* as a SavedModel"),
    ("missing", "no such file: "),
    ("empty_meta", "cannot read .* as a MetaGraph|is not a MetaGraph"),
    ("bad_tag", "--tag 'train': the SavedModel .* has no MetaGraph with "
                "that tag"),
    ("tag_on_a_file", "--tag 'serve': only a SavedModel directory has "
                      "tags"),
    ("json_name", "--json .*: the file name must end in .json"),
    ("json_folder", "--json .*: the directory .* does not exist"),
])
def test_errors_are_one_line(models, tmp_path, capsys, case, says):
  import re  # pylint: disable=g-import-not-at-top
  argv = {
      "corrupt": [adversarial.corrupt_saved_model(tmp_path)],
      "missing": [str(tmp_path / "missing.meta")],
      "empty_meta": [str(tmp_path / "empty.meta")],
      "bad_tag": [models["clean_v1_saved_model"], "--tag", "train"],
      "tag_on_a_file": [models["write_file"], "--tag", "serve"],
      "json_name": [models["write_file"], "--json", "out.txt"],
      "json_folder": [models["write_file"], "--json",
                      str(tmp_path / "no" / "out.json")],
  }[case]
  (tmp_path / "empty.meta").write_bytes(b"")
  line = error_line(capsys, ["scan", *argv, "--no-sandbox"])
  assert line.startswith("graphgrad scan: error: "), line
  assert re.search(says, line), line


# -- in the sandbox -----------------------------------------------------------


@needs_sandbox
@pytest.mark.parametrize("name, code", [("print_in_cond_branch_pbtxt", 1),
                                        ("clean_v1_saved_model", 0)])
def test_the_sandboxed_scan_equals_the_in_process_one(models, tmp_path,
                                                      name, code):
  assert _scan(models[name], tmp_path, sandbox=True) == _scan(
      models[name], tmp_path)
  assert _scan(models[name], tmp_path)[0] == code
