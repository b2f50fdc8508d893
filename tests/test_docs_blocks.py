"""Every ```python block of docs/*.md runs, a page's blocks in order.

A page's blocks share one namespace, which starts with ``tf`` and ``gg``
imported, so a block may use what an earlier one made. The line right
before a block may name what it needs:

* ``<!-- setup: NAME -->``: :data:`SETUPS` ``NAME`` first puts the names
  the page takes as given (``loss``, ``model``, ``x``...) into the
  namespace. A graph setup makes a fresh ``tf.Graph``, in which this block
  and the next ones run (TF1); the others run them eagerly (TF2).
* ``<!-- not run: REASON -->``: the block is not run, for that reason.

Any other block runs as the one before it did. A block that raises fails
the page's test.
"""

import contextlib
import pathlib
import re
import sys

import bert_optimization
import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
import helpers

tf1 = tf.compat.v1
_DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"
_FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_MARK = re.compile(r"<!--\s*(not run|setup):\s*([^\n]*?)\s*-->\s*\Z")
_GRAPH = "__graph__"  # the namespace's tf.Graph, None when eager


def _blocks(page, docs=_DOCS):
  """``(code, mark, value)`` per python block of ``page``: ``mark`` is
  ``"not run"``, ``"setup"`` or ``None``."""
  text = (docs / page).read_text(encoding="utf-8")
  out = []
  for m in _FENCE.finditer(text):
    mark = _MARK.search(text[:m.start()].rstrip())
    out.append((m.group(1), *(mark.groups() if mark else (None, None))))
  return out


PAGES = sorted(p.name for p in _DOCS.glob("*.md") if _blocks(p.name))


# -- what the pages take as given ---------------------------------------------

def _graph(ns):
  """A fresh graph for the next blocks, with the seed's numbers."""
  ns[_GRAPH] = tf.Graph()
  problem = gg.demo.seed_problem(0)
  ns["batch"] = (problem.x_train[:16], problem.y_train[:16])
  return ns[_GRAPH].as_default()


def tf1_seed(ns):
  """The seed network x -> l1_dense -> l2_dense -> loss, a plan of it, an
  optimizer, a global step and a transform ``f``."""
  with _graph(ns):
    tf1.set_random_seed(0)
    x, y, logits, loss = gg.demo.seed_network()
    ns.update(x=x, y=y, logits=logits, loss=loss, l2_out=logits,
              l1_vars=_variables("l1_dense"), l2_vars=_variables("l2_dense"),
              feed={x: ns["batch"][0], y: ns["batch"][1]},
              plan=gg.GradientPlan(loss),
              optimizer=tf1.train.GradientDescentOptimizer(0.1),
              f=gg.transforms.scale(0.5))
    ns["global_step"] = ns["step"] = tf1.train.get_or_create_global_step()


def _variables(scope):
  return [v for v in tf1.trainable_variables()
          if v.op.name.startswith(scope + "/")]


def tf1_session(ns):
  """tf1_seed with a train op of its plan, and a session."""
  tf1_seed(ns)
  with ns[_GRAPH].as_default():
    ns["plan"].transform_gradients("l2_dense", gg.transforms.clip_by_norm(1.0))
    ns["train_op"] = ns["plan"].apply_gradients(ns["optimizer"])
    ns["sess"] = tf1.Session()
    ns["sess"].run(tf1.global_variables_initializer())


def tf1_classifier(ns):
  """tf1_seed with integer labels ``y`` and the unreduced loss
  ``vector_loss``."""
  tf1_seed(ns)
  with ns[_GRAPH].as_default():
    y = tf.argmax(ns["y"], -1)
    vector_loss = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=y, logits=ns["logits"])
    ns.update(y=y, vector_loss=vector_loss, loss=vector_loss,
              plan=gg.GradientPlan(vector_loss))


def tf1_chain(ns):
  """x -> l1 .. l8 (relu between) -> l9 -> loss; h4 and h8 the outputs of
  l4 and l8."""
  tf1_seed(ns)
  with ns[_GRAPH].as_default():
    h = ns["x"]
    for i in range(1, 10):
      h = helpers.dense(h, 6 if i < 9 else 2, f"l{i}")
      ns[f"h{i}"] = h
      h = tf.nn.relu(h) if i < 9 else h
    ns["loss"] = tf.reduce_mean(tf.square(h))


def tf1_tasks(ns):
  """A trunk with two task heads, their losses and its variables."""
  with _graph(ns):
    tf1.set_random_seed(0)
    x = tf.constant(ns["batch"][0])
    trunk = helpers.dense(x, 8, "trunk", tf.nn.relu)
    loss_a = tf.reduce_mean(tf.square(helpers.dense(trunk, 1, "a")))
    loss_b = tf.reduce_mean(tf.abs(helpers.dense(trunk, 1, "b")))
    ns.update(x=x, loss_a=loss_a, loss_b=loss_b,
              var_list=tf1.trainable_variables())


def tf1_bert(ns):
  """BERT's encoder layers, as tests/test_migration.py builds them."""
  with _graph(ns):
    ns.update(loss=helpers.bert_like(2), num_layers=2, init_lr=0.05,
              num_train_steps=10)


def tf1_quantized(ns):
  """x -> fc1 -> Round -> binarize (Sign) -> fc2 -> loss, an optimizer."""
  with _graph(ns):
    x = tf.constant(ns["batch"][0])
    h = tf.sign(tf.round(helpers.dense(x, 8, "fc1")), name="binarize")
    ns["loss"] = tf.reduce_mean(tf.square(helpers.dense(h, 2, "fc2")))
    ns["optimizer"] = tf1.train.GradientDescentOptimizer(0.1)


def frozen_graph(ns):
  """frozen_inference_graph.pb: x -> dense -> dense_1 -> dense_2 = logits,
  its variables frozen to constants; ``my_loss`` a loss of the logits."""
  with tf.Graph().as_default() as graph:
    h = tf1.placeholder(tf.float32, [None, 10], name="x")
    for name in ("dense", "dense_1", "dense_2"):
      h = helpers.dense(h, 4, name, None if name == "dense_2" else tf.nn.relu)
    tf.identity(h, name="logits")
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      frozen = tf1.graph_util.convert_variables_to_constants(
          sess, graph.as_graph_def(), ["logits"])
  pathlib.Path("frozen_inference_graph.pb").write_bytes(
      frozen.SerializeToString())
  ns[_GRAPH] = None
  ns["my_loss"] = lambda logits: tf.reduce_mean(tf.square(logits))


def _data(ns, rows=2048):
  """``x`` and the names of the data of a Keras page; returns the labels."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(rows, 10)).astype(np.float32)
  ns.update(x=x, x_train=x, xv=x[:8], keras=tf.keras,
            loss_fn=tf.keras.losses.MeanSquaredError(),
            optimizer=tf.keras.optimizers.SGD(0.1), B=64, GLOBAL_BATCH=64)
  return rng.integers(0, 2, rows)


def keras_model(ns, names=("l1", "l2")):
  """A Keras model of layers l1 and l2 on 10 features (``make_model()``
  makes another), a plan of it, its data (``x``, ``y``; ``x_train``,
  ``y_train``; ``xv``, ``yv``), a loss function and an optimizer."""
  ns[_GRAPH] = None
  y = np.eye(2, dtype=np.float32)[_data(ns)]

  def make_model():
    return tf.keras.Sequential([
        tf.keras.Input((10,)),
        tf.keras.layers.Dense(8, "relu", name=names[0]),
        tf.keras.layers.Dense(2, name=names[1])])

  ns.update(y=y, y_train=y, yv=y[:8], model=make_model(),
            make_model=make_model)
  ns["plan"] = gg.KerasPlan(ns["model"])


def keras_seed(ns):
  """keras_model with the seed's layer names, l1_dense and l2_dense."""
  keras_model(ns, ("l1_dense", "l2_dense"))


def keras_classifier(ns):
  """keras_model with integer labels ``y``: ``model(x)`` is the logits."""
  keras_model(ns)
  ns["y"] = ns["y_train"] = ns["y"].argmax(-1)


def keras_tasks(ns):
  """A Keras model whose layer trunk feeds two tasks, task_a and task_b."""
  keras_model(ns)
  inputs = tf.keras.Input((10,))
  trunk = tf.keras.layers.Dense(8, "relu", name="trunk")(inputs)
  ns["model"] = tf.keras.Model(inputs, tf.keras.layers.Dense(2)(trunk))
  ns["task_a"] = lambda out: tf.reduce_mean(tf.square(out[:, 0]))
  ns["task_b"] = lambda out: tf.reduce_mean(tf.abs(out[:, 1] - 1.0))


SETUPS = {f.__name__.replace("_", "-"): f for f in (
    tf1_seed, tf1_session, tf1_classifier, tf1_chain, tf1_tasks, tf1_bert,
    tf1_quantized, frozen_graph, keras_model, keras_seed, keras_classifier,
    keras_tasks)}


# -- the tests ----------------------------------------------------------------

def _run(page, ns, docs=_DOCS):
  """Runs the page's blocks in ``ns``; returns how many ran."""
  ran = 0
  for i, (code, mark, value) in enumerate(_blocks(page, docs)):
    if mark == "not run":
      continue
    if mark == "setup":
      SETUPS[value](ns)
    where = f"docs/{page}, python block {i + 1}"
    graph = ns.get(_GRAPH)
    with graph.as_default() if graph is not None else contextlib.nullcontext():
      exec(compile(code, where, "exec"), ns)  # pylint: disable=exec-used
    ran += 1
  return ran


@pytest.mark.parametrize("page", PAGES)
def test_the_python_blocks_of_a_page_run(page, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # what the blocks write ("logs", plots)
  # docs/migration.md imports BERT's optimization.py.
  monkeypatch.setitem(sys.modules, "optimization", bert_optimization)
  tf.keras.backend.clear_session()
  ns = {"__name__": f"docs_{page[:-3]}", "tf": tf, "gg": gg}
  found = _blocks(page)
  assert _run(page, ns) == len([b for b in found if b[1] != "not run"])
  sess = ns.get("sess")
  if isinstance(sess, tf1.Session):
    sess.close()


def test_every_block_runs_or_says_why_not():
  found = [(page, b) for page in PAGES for b in _blocks(page)]
  fences = sum(line.startswith("```python")
               for p in _DOCS.glob("*.md")
               for line in p.read_text(encoding="utf-8").splitlines())
  assert len(found) == fences > 40  # each fence is a block the tests see
  skipped = 0
  for page, (code, mark, value) in found:
    if mark == "not run":
      assert len(value) > 10, f"docs/{page}: say why a block is not run"
      skipped += 1
    elif mark == "setup":
      assert value in SETUPS, (
          f"docs/{page}: no setup {value!r}; known: {', '.join(SETUPS)}")
    elif code.startswith("--8<--"):
      pytest.fail(f"docs/{page}: a block of an included file must say where "
                  f"it runs: <!-- not run: ... -->")
  assert skipped <= 12, "most blocks run"


def test_a_block_that_raises_fails_its_page(tmp_path):
  (tmp_path / "page.md").write_text(
      "<!-- setup: tf1-seed -->\n```python\nplan = gg.GradientPlan(loss)\n```"
      "\n\n<!-- not run: it is a sketch of the idea -->\n```python\nsketch\n```"
      "\n\n```python\nplan.transform_gradients('l3', f)\n```\n",
      encoding="utf-8")
  ns = {"tf": tf, "gg": gg}
  with pytest.raises(gg.GraphGradError, match="l3"):
    _run("page.md", ns, tmp_path)
  assert isinstance(ns["plan"], gg.GradientPlan)  # the first block ran
