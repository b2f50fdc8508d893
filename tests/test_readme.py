"""The README's five-line plan runs as written, warns about nothing, and does
what its comments say."""

import logging
import os
import re

import numpy as np
import tensorflow as tf

import graphgrad as gg
from graphgrad import demo

tf1 = tf.compat.v1
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _five_lines(path):
  with open(os.path.join(_ROOT, path), encoding="utf-8") as f:
    text = f.read()
  section = text[text.index("## A plan in five lines"):]
  return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def test_the_pages_show_the_same_plan():
  readme = _five_lines("README.md")
  assert _five_lines("docs/getting-started.md") == readme
  with open(os.path.join(_ROOT, "docs/index.md"), encoding="utf-8") as f:
    assert readme in f.read()


def test_the_readme_plan_clips_l2_under_sgd_and_warns_nothing(caplog):
  problem = demo.seed_problem(0)
  xb, yb = problem.x_train[:32], problem.y_train[:32]
  with tf.Graph().as_default():
    tf1.set_random_seed(0)
    x, y, _, loss = demo.seed_network()
    l2 = [v for v in tf1.trainable_variables() if v.op.name.startswith("l2")]
    plain = tf.gradients(loss, l2)  # l2's own gradients see the plain g
    before = [tf.identity(v) for v in l2]
    scope = {"gg": gg, "tf": tf, "loss": loss}
    with caplog.at_level(logging.WARNING, logger="graphgrad"):
      exec(_five_lines("README.md"), scope)  # pylint: disable=exec-used
    assert not [r for r in caplog.records if r.name.startswith("graphgrad")]
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      w0, g = sess.run([before, plain], {x: xb, y: yb})
      sess.run(scope["train_op"], {x: xb, y: yb})
      w1 = sess.run(l2)
  norms = [float(np.sqrt(np.sum(gi * gi))) for gi in g]
  assert max(norms) > 1.0, norms  # the clip acts on this batch
  for a, b, gi, v in zip(w0, w1, g, l2):
    # clip_by_norm clips each tensor on its own.
    n = float(np.sqrt(np.sum(gi * gi)))
    want = a - 0.1 * gi * min(1.0, 1.0 / n)
    np.testing.assert_allclose(b, want, rtol=1e-5, atol=1e-7, err_msg=v.name)
