"""``plan.resources.variables()`` holds every variable a plan creates."""

import numpy as np
import tensorflow as tf

import graphgrad as gg
import keras_cases
from helpers import dense

tf1 = tf.compat.v1


def test_graph_plan_resources_hold_the_stateful_methods_state(graph):
  x = tf1.placeholder(tf.float32, [None, 4])
  h = dense(dense(x, 5, "base", tf.tanh), 5, "trunk", tf.tanh)
  losses = [tf.reduce_sum(tf.square(dense(h, 2, f"head_{i}")))
            for i in range(2)]
  model = set(tf1.global_variables())
  plan = (gg.GradientPlan(tf.add_n(losses))
          .combine_tasks("trunk", losses, gg.mtl.gradvac())
          .combine_tasks("base", losses,
                         gg.mtl.nash_mtl()))
  plan.compute_gradients()
  made = set(tf1.global_variables()) - model
  names = sorted(v.op.name for v in made)
  assert any("phi" in n for n in names) and any("alpha" in n for n in names)
  held = {v.ref() for v in plan.resources.variables()}
  assert {v.ref() for v in made} <= held, names


def test_keras_plan_resources_hold_every_variable_it_made():
  case = keras_cases.CASES["two_heads"]
  K = keras_cases.FLAVOURS["keras3"]
  model = keras_cases.keras_model(case, K)
  x, labels = keras_cases.batch(case)
  plan = gg.KerasPlan(model).combine_tasks("features", gg.mtl.gradvac())
  made = []

  def record(next_creator, **kwargs):
    v = next_creator(**kwargs)
    made.append(v)
    return v

  with tf.variable_creator_scope(record):
    with plan.tape() as tape:
      outs = model(tf.constant(x))
      tasks = [tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(
          labels=y, logits=o)) for y, o in zip(labels, outs)]
      tape.gradient(tf.add_n(tasks), task_losses=tasks)
  own = {v.ref() for v in map(gg_variable, model.weights)}
  new = [v for v in made if v.ref() not in own]
  assert new and any("phi" in v.name for v in new)
  held = {v.ref() for v in plan.resources.variables()}
  assert {v.ref() for v in new} <= held, [v.name for v in new]
  np.testing.assert_array_equal(
      [v.shape.as_list() for v in new if "phi" in v.name], [[2, 2]])


def gg_variable(v):
  """The tf.Variable behind a Keras 3 variable."""
  return v.value if not isinstance(v, tf.Variable) else v
