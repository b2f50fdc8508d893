"""The ops that benchmarks/linear_rewrites.py's variants add, pinned.

``benchmarks/op_counts.json`` records, per model, how many ops each
variant's train op adds to the forward graph (``scale``, ``scale_cut``,
``clip_by_norm``, ``scale_all``, ``scale_all_cut``, ``scale_clip_all``,
``floor``, ``clip_units``), beside ``minimize()`` and the identity plan,
for the full and the tiny models. The tiny graphs are rebuilt here (graph
building only, no step) and every count must equal the recorded one
exactly: a change of the engine that adds or removes an op shows here. A
deliberate change re-records the file with
``python -m benchmarks.linear_rewrites --record``.
"""

import json

import pytest

from benchmarks import linear_rewrites

RERECORD = ("If the change is deliberate, re-record the counts with "
            "`python -m benchmarks.linear_rewrites --record` and commit "
            "benchmarks/op_counts.json.")


@pytest.fixture
def recorded():
  with open(linear_rewrites.OP_COUNTS) as f:
    return json.load(f)


def _changes(got, want):
  """Lines naming each (model, variant) whose count differs, and by how
  much; a model or variant only on one side is named too."""
  lines = []
  for model in sorted(set(got) | set(want)):
    g, w = got.get(model, {}), want.get(model, {})
    for variant in sorted(set(g) | set(w)):
      if g.get(variant) != w.get(variant):
        delta = ("" if None in (g.get(variant), w.get(variant))
                 else f" ({g[variant] - w[variant]:+d})")
        lines.append(f"  {model} / {variant}: recorded {w.get(variant)}, "
                     f"now {g.get(variant)}{delta}")
  return lines


def test_tiny_op_counts_equal_the_recorded_ones(recorded):
  got = linear_rewrites.op_counts(tiny=True)
  changes = _changes(got, recorded["tiny"])
  assert not changes, (
      "ops added per variant changed against benchmarks/op_counts.json "
      "(tiny models):\n" + "\n".join(changes) + "\n" + RERECORD)
  # The identity plan is the very tf.gradients call minimize() makes.
  for model, counts in got.items():
    assert counts["gg_identity"] == counts["minimize"], (model, counts)


def test_the_recorded_full_counts_cover_every_variant(recorded):
  cases = {m.name: tuple(v) + ("gg_identity",)
           for m, v in linear_rewrites._cases(tiny=False)}  # pylint: disable=protected-access
  assert {m: sorted(c) for m, c in recorded["full"].items()} == {
      m: sorted(v) for m, v in cases.items()}, RERECORD
  for model, counts in recorded["full"].items():
    # The identity plan adds what minimize() adds, except that with
    # batch-norm updates (UPDATE_OPS: the tf-slim ResNets) its seed is an
    # Identity built after them, where minimize() fills a shape Const.
    fewer = 1 if model.startswith("resnet") else 0
    assert counts["gg_identity"] == counts["minimize"] - fewer, (
        model, counts, RERECORD)
    assert all(n > counts["minimize"] for v, n in counts.items()
               if v not in ("minimize", "gg_identity")), (model, counts)
