"""The privacy suite's optional section: Opacus and JAX on the same models
(the MLP and the conv nets; not BERT), weights and batch sizes.

Each library's private step is timed against its own plain step (SGD),
alternating, in a process whose thread count was set before it started:

* Opacus ``PrivacyEngine.make_private`` with per-sample hooks
  (``grad_sample_mode="hooks"``) and with ghost clipping
  (``grad_sample_mode="ghost"``), ``poisson_sampling=False``;
* JAX: ``jax.vmap(jax.grad(loss of one example))``, clipped, summed and
  noised in one ``jax.jit`` step.

A library that is not installed is left out, with a note in the results;
nothing here runs in CI.
"""

import os
import time
from typing import Callable, Dict, List, Optional

import numpy as np

from benchmarks import _privacy_models, privacy

CLIP, SIGMA = privacy.CLIP, privacy.SIGMA


def _torch_steps(model: str, batch: int) -> Dict[str, Callable[[], None]]:
  import torch  # pylint: disable=g-import-not-at-top
  from opacus import PrivacyEngine  # pylint: disable=g-import-not-at-top
  nn = torch.nn
  weights = _privacy_models.weights(model)
  xs, ys = _privacy_models.data(model, batch)
  if model != "mlp6x512":
    xs = np.transpose(xs, [0, 3, 1, 2])  # NCHW
  x, y = torch.from_numpy(np.ascontiguousarray(xs)), torch.from_numpy(
      ys.astype(np.int64))

  def net():
    if model == "mlp6x512":
      layers: List = []
      for i in range(6):
        layers.append(nn.Linear(512, 512 if i < 5 else 10))
        if i < 5:
          layers.append(nn.ReLU())
    else:
      layers = [nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
                nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
                nn.Flatten(), nn.Linear(14 * 14 * 32, 10)]
    if model == "tutorial_convnet":  # TF's SAME pads 3 and 3 here
      layers = [nn.Conv2d(1, 16, 8, stride=2, padding=3), nn.ReLU(),
                nn.MaxPool2d(2, 1), nn.Conv2d(16, 32, 4, stride=2), nn.ReLU(),
                nn.MaxPool2d(2, 1), nn.Flatten(), nn.Linear(4 * 4 * 32, 32),
                nn.ReLU(), nn.Linear(32, 10)]
    m = nn.Sequential(*layers)
    params = [p for p in m.parameters()]
    flat = {"convnet": 14, "tutorial_convnet": 4}.get(model)
    with torch.no_grad():
      for i, (p, w) in enumerate(zip(params, weights)):
        if w.ndim == 4:  # HWIO -> OIHW
          w = np.transpose(w, [3, 2, 0, 1])
        elif flat and weights[i - 2].ndim == 4:  # the dense after Flatten
          # Flatten order: TF flattens HWC, torch CHW.
          w = w.reshape(flat, flat, 32, -1).transpose(2, 0, 1, 3).reshape(
              flat * flat * 32, -1)
        if w.ndim == 2:
          w = w.T
        p.copy_(torch.from_numpy(np.ascontiguousarray(w)))
    return m

  def sgd_step(m, opt, loss_fn):
    def step():
      opt.zero_grad()
      loss_fn(m(x), y).backward()
      opt.step()
    return step

  def plain():
    m = net()
    return sgd_step(m, torch.optim.SGD(m.parameters(), lr=1e-3),
                    nn.CrossEntropyLoss())

  def private(mode):
    m = net()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=batch)
    kwargs = dict(module=m, optimizer=opt, data_loader=loader,
                  noise_multiplier=SIGMA, max_grad_norm=CLIP,
                  poisson_sampling=False, grad_sample_mode=mode)
    if mode == "ghost":
      m, opt, loss_fn, _ = PrivacyEngine().make_private(
          criterion=nn.CrossEntropyLoss(), **kwargs)
    else:
      m, opt, _ = PrivacyEngine().make_private(**kwargs)
      loss_fn = nn.CrossEntropyLoss()
    return sgd_step(m, opt, loss_fn)

  return {"minimize": plain(), "opacus_hooks": private("hooks"),
          "opacus_ghost": private("ghost")}


def _jax_steps(model: str, batch: int) -> Dict[str, Callable[[], None]]:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  params = [jnp.asarray(w) for w in _privacy_models.weights(model)]
  xs, ys = _privacy_models.data(model, batch)
  x, y = jnp.asarray(xs), jnp.asarray(ys)

  def logits(ps, x):
    if model == "mlp6x512":
      h = x
      for i in range(6):
        h = h @ ps[2 * i] + ps[2 * i + 1]
        h = jax.nn.relu(h) if i < 5 else h
      return h
    tutorial = model == "tutorial_convnet"
    h = x
    for i, stride, padding in (((0, 2, "SAME"), (1, 2, "VALID")) if tutorial
                               else ((0, 1, "SAME"), (1, 2, "SAME"))):
      h = jax.lax.conv_general_dilated(
          h, ps[2 * i], (stride, stride), padding,
          dimension_numbers=("NHWC", "HWIO", "NHWC"))
      h = jax.nn.relu(h + ps[2 * i + 1])
      if tutorial:  # max pool 2, stride 1
        h = jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2, 2, 1),
                                  (1, 1, 1, 1), "VALID")
    h = h.reshape(h.shape[0], -1) @ ps[4] + ps[5]
    return jax.nn.relu(h) @ ps[6] + ps[7] if tutorial else h

  def losses(ps, x, y):
    lg = logits(ps, x)
    return -jnp.take_along_axis(jax.nn.log_softmax(lg), y[:, None], 1)[:, 0]

  @jax.jit
  def plain(ps, x, y):
    g = jax.grad(lambda p: jnp.mean(losses(p, x, y)))(ps)
    return [p - 1e-3 * gi for p, gi in zip(ps, g)]

  def one(ps, xi, yi):
    return losses(ps, xi[None], yi[None])[0]

  @jax.jit
  def private(ps, x, y, key):
    per = jax.vmap(jax.grad(one), in_axes=(None, 0, 0))(ps, x, y)
    norms = jnp.sqrt(sum(jnp.sum(g.reshape(batch, -1) ** 2, axis=1)
                         for g in per))
    c = CLIP / jnp.maximum(norms, CLIP)
    keys = jax.random.split(key, len(ps))
    out = []
    for p, g, k in zip(ps, per, keys):
      s = jnp.tensordot(c, g, axes=1)
      s = s + SIGMA * CLIP * jax.random.normal(k, s.shape)
      out.append(p - 1e-3 * s / batch)
    return out

  state = {"plain": params, "private": params, "key": jax.random.PRNGKey(0)}

  def plain_step():
    state["plain"] = plain(state["plain"], x, y)
    jax.block_until_ready(state["plain"])

  def private_step():
    state["key"], k = jax.random.split(state["key"])
    state["private"] = private(state["private"], x, y, k)
    jax.block_until_ready(state["private"])

  return {"minimize": plain_step, "jax_vmap": private_step}


def run(threads: int, models, batch: Optional[int], reps: int) -> Dict:
  """Each installed library's paired ratios, per model (the conv nets and
  the MLP: BERT is left out), at ``batch`` or each model's own."""
  os.environ["XLA_FLAGS"] = (
      "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
      if threads == 1 else "")
  out: Dict = {}
  for name, make in (("opacus", _torch_steps), ("jax", _jax_steps)):
    for model in models:
      if model == "bert_small":
        continue
      b = privacy.batch_size(model, batch)
      try:
        if name == "opacus":
          import torch  # pylint: disable=g-import-not-at-top
          torch.set_num_threads(threads)
          torch.manual_seed(0)
        steps = make(model, b)
      except ImportError as e:
        out[f"{model}/{name}"] = {"skipped": str(e), "ratio": {}}
        continue
      start = time.perf_counter()
      out[f"{model}/{name}"] = {"batch": b, **privacy.paired(steps, reps)}
      out[f"{model}/{name}"]["wall_s"] = time.perf_counter() - start
  return out
