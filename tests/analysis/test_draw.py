"""Layer-graph pictures: DOT text that parses, and real PNG/SVG files."""

import xml.etree.ElementTree as ET

import numpy as np
import pydot
import pytest
import tensorflow as tf

import graphgrad as gg
from graphgrad.analysis import _draw
from helpers import dense

tf1 = tf.compat.v1


def _dann_net():
  x = tf1.placeholder(tf.float32, [None, 4], name="x")
  h = dense(x, 6, "features", tf.nn.relu)
  label = dense(h, 3, "label_head")
  domain = dense(h, 1, "domain_head")
  loss = tf.add(tf.reduce_sum(tf.square(label)), tf.reduce_sum(domain),
                name="loss")
  return gg.analyze(loss)


def _parse(dot):
  graphs = pydot.graph_from_dot_data(dot)
  assert graphs is not None and len(graphs) == 1
  g = graphs[0]
  nodes = {n.get_name().strip('"'): n for n in g.get_nodes()
           if n.get_name() not in ("node", "edge")}
  edges = {(e.get_source().strip('"'), e.get_destination().strip('"')): e
           for e in g.get_edges()}
  return nodes, edges


def _label(item):
  return item.get("label").strip('"').replace("\\n", "\n")


def test_dot_parses_with_params_and_shapes(graph):
  net = _dann_net()
  nodes, edges = _parse(net.to_dot())
  assert set(nodes) == {"features", "label_head", "domain_head", "loss"}
  for layer in net:
    assert f"{layer.num_params:,} params" in _label(nodes[layer.name])
  assert net["features"].num_params == 4 * 6 + 6
  assert set(edges) == {("features", "label_head"), ("features", "domain_head"),
                        ("label_head", "loss"), ("domain_head", "loss")}
  assert _label(edges[("features", "label_head")]) == "[?,6]"
  assert _label(edges[("domain_head", "loss")]) == "[?,1]"
  assert "fillcolor=\"#f6c28b\"" not in net.to_dot()


def test_dot_highlights_the_plan(graph):
  net = _dann_net()
  plan = (gg.GradientPlan(net.loss, net)
          .transform_edge("features", "domain_head", gg.transforms.reverse(0.5))
          .transform_gradients("label_head", gg.transforms.scale(0.8)))
  nodes, edges = _parse(plan.to_dot())
  hot = edges[("features", "domain_head")]
  assert hot.get("color").strip('"') == _draw._EDGE_HOT
  assert "scale(-0.5)" in _label(hot)
  assert edges[("features", "label_head")].get("color") is None
  assert nodes["label_head"].get("fillcolor").strip('"') == _draw._HOT
  assert "params: scale(0.8)" in _label(nodes["label_head"])
  assert nodes["features"].get("fillcolor") is None


def test_dot_dashes_edges_that_carry_a_rewritten_upstream(graph):
  net = _dann_net()
  plan = gg.GradientPlan(net.loss, net).transform_upstream(
      "domain_head", gg.transforms.scale(2.0))
  nodes, edges = _parse(plan.to_dot())
  assert edges[("features", "domain_head")].get("style") == "dashed"
  assert edges[("features", "label_head")].get("style") is None
  assert "upstream: scale(2.0)" in _label(nodes["domain_head"])


def test_plan_picture_marks_nothing_without_declarations(graph):
  net = _dann_net()
  assert gg.GradientPlan(net.loss, net).to_dot() == net.to_dot()


def test_png_is_a_real_image(graph, tmp_path):
  net = _dann_net()
  plan = gg.GradientPlan(net.loss, net).transform_upstream(
      "label_head", gg.transforms.scale(2.0))
  path = plan.draw(tmp_path / "layers.png")
  with open(path, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  import matplotlib.image  # pylint: disable=g-import-not-at-top
  pixels = matplotlib.image.imread(path)
  assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100
  # Not a blank canvas: the boxes and text leave many distinct colours.
  assert len(np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)) > 10


def test_matplotlib_fallback_writes_png_and_svg(graph, tmp_path):
  net = _dann_net()
  png = net.draw(str(tmp_path / "fallback.png"), graphviz=False)
  with open(png, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  svg = net.draw(str(tmp_path / "fallback.svg"), graphviz=False)
  root = ET.parse(svg).getroot()
  assert root.tag.endswith("svg")
  text = open(svg, encoding="utf-8").read()
  assert "features" in text or "<path" in text


def test_draw_dot_file_and_bad_extension(graph, tmp_path):
  net = _dann_net()
  path = net.draw(tmp_path / "layers.dot")
  assert open(path, encoding="utf-8").read() == net.to_dot()
  with pytest.raises(gg.GraphGradError, match=r"must end in \.png, \.svg or "
                     r"\.dot; got '.*layers\.jpg'"):
    net.draw(tmp_path / "layers.jpg")


def test_draw_without_graphviz_or_matplotlib_says_what_to_install(
    graph, tmp_path, monkeypatch):
  net = _dann_net()
  monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
  with pytest.raises(gg.GraphGradError,
                     match=r"neither Graphviz \(off\) nor matplotlib"
                           r".*graphgrad\[draw\]"):
    net.draw(str(tmp_path / "x.png"), graphviz=False)


def test_dot_labels_an_input_transform_and_dashes_the_edges_below(graph):
  net = _dann_net()
  plan = gg.GradientPlan(net.loss, net).transform_inputs(
      "label_head", gg.transforms.clip_by_norm(1.0))
  nodes, edges = _parse(plan.to_dot())
  assert edges[("features", "label_head")].get("style") == "dashed"
  assert edges[("features", "domain_head")].get("style") is None
  assert nodes["label_head"].get("fillcolor").strip('"') == _draw._HOT
  assert "inputs: clip_by_norm(1.0)" in _label(nodes["label_head"])
