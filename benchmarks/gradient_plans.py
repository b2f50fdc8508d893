"""Suite: gradient plans against minimize() and the hand recipe.

For every model, the variants of :mod:`benchmarks._variants` are built in
alternation (build time, ops added, ``gg.analyze`` time), then trained side
by side, one Session each, alternating every repetition (step time, ops the
runtime executes after Grappler). Peak RSS comes from one child process per
(model, variant). The MLP depth sweep gets linear fits.
"""

import logging
from typing import Dict, List

import numpy as np

import benchmarks
from benchmarks import _measure, _models, _report, _variants

log = logging.getLogger("graphgrad.benchmarks")

# The hand recipe is quadratic: 15 s to build at depth 64 on the reference
# machine, about 4x that at 128. Past this depth it is left out.
NAIVE_MAX_DEPTH = 64
GRAPPLER_OFF_MODELS = ("mlp32", "cnn", "mlp4")
TINY_RSS = (("seed", "gg_all"),)  # the smoke test starts one child


def _reps(config, model, build: bool) -> int:
  if config.tiny:
    return 2
  if build:
    return max(3, config.reps // 2) if model.depth >= 64 else config.reps
  return 2 * config.reps + 1  # step samples are cheap and noisy


def run_model(config: benchmarks.Config, model: _models.Model) -> Dict:
  variants = [v for v in _variants.VARIANTS
              if not (v == "naive" and model.depth > NAIVE_MAX_DEPTH)]
  notes = {}
  if len(variants) < len(_variants.VARIANTS):
    notes["naive"] = (f"not run past depth {NAIVE_MAX_DEPTH} (quadratic; "
                      f"see the fit)")
  log.info("%s: building %s", model.name, ", ".join(variants))
  insts, build_s, skipped = _measure.build_alternating(
      model, variants, _reps(config, model, True))
  notes.update(skipped)
  log.info("%s: stepping", model.name)
  target_s = 0.01 if config.tiny else 0.25
  steps, cpu, executed, k = _measure.step_alternating(
      insts, _reps(config, model, False), target_s=target_s)
  out = {"model": model.name, "description": model.description,
         "depth": model.depth, "steps_per_sample": k, "notes": notes,
         "variants": {}}
  paired = _measure.paired_ratios(steps)
  paired_cpu = _measure.paired_ratios(cpu)
  for v, inst in insts.items():
    out["variants"][v] = {
        "step_ratio": paired.get(v),
        "step_cpu_s": _measure.stats(cpu[v]),
        "step_cpu_ratio": paired_cpu.get(v),
        "build_s": _measure.stats(build_s[v]),
        "ops_added": inst.ops_added,
        "executed_ops": executed[v],
        "step_s": _measure.stats(steps[v]),
        "analyze_s": inst.info.get("analyze_s"),
        "info": {k2: v2 for k2, v2 in inst.info.items() if k2 != "analyze_s"},
    }
  if config.grappler_off and model.name in GRAPPLER_OFF_MODELS:
    log.info("%s: stepping with Grappler off", model.name)
    off, off_cpu, off_exec, _ = _measure.step_alternating(
        insts, _reps(config, model, False), target_s=target_s, grappler=False)
    paired_off = _measure.paired_ratios(off)
    paired_off_cpu = _measure.paired_ratios(off_cpu)
    for v in insts:
      out["variants"][v]["step_cpu_ratio_grappler_off"] = paired_off_cpu.get(v)
      out["variants"][v]["step_s_grappler_off"] = _measure.stats(off[v])
      out["variants"][v]["step_ratio_grappler_off"] = paired_off.get(v)
      out["variants"][v]["executed_ops_grappler_off"] = off_exec[v]
  del insts
  for v in variants:
    if v in notes:
      continue
    if config.tiny and (model.name, v) not in TINY_RSS:
      continue
    rss = _measure.peak_rss(config.tiny, model.name, v)
    if rss is not None:
      out["variants"][v]["rss"] = rss
  return out


def _fit(xs, ys, degree=1):
  coef = np.polyfit(xs, ys, degree)
  pred = np.polyval(coef, xs)
  ss_res = float(np.sum((np.asarray(ys) - pred) ** 2))
  ss_tot = float(np.sum((np.asarray(ys) - np.mean(ys)) ** 2)) or 1.0
  return [float(c) for c in coef], 1.0 - ss_res / ss_tot


def depth_fits(results: List[Dict]) -> Dict:
  """Linear fits of build time and ops against depth, per variant."""
  sweep = [r for r in results if r["depth"] and r["model"].startswith("mlp")]
  fits = {}
  for v in _variants.VARIANTS:
    pts = [(r["depth"], r["variants"][v]) for r in sweep if v in r["variants"]]
    if len(pts) < 2:
      continue
    d = [p[0] for p in pts]
    entry = {"depths": d}
    for key, get in (("build_s", lambda x: x["build_s"]["median"]),
                     ("ops_added", lambda x: x["ops_added"])):
      ys = [get(p[1]) for p in pts]
      entry[key] = {"values": ys}
      entry[key]["linear"], entry[key]["r2"] = _fit(d, ys, 1)
      if len(pts) >= 3:
        entry[key]["quadratic"], entry[key]["r2_quadratic"] = _fit(d, ys, 2)
    fits[v] = entry
  return fits


def run(config: benchmarks.Config) -> benchmarks.SuiteResult:
  results = []
  for model in _models.models(config.tiny):
    if config.only and model.name not in config.only:
      continue
    results.append(run_model(config, model))
  data = {"models": results, "fits": depth_fits(results)}
  return benchmarks.SuiteResult(render(data, config.out_dir), data)


def render(data: Dict, out_dir: str) -> str:
  figures = _report.depth_plot(data["models"], out_dir)
  return _report.plans_markdown(data["models"], data["fits"], figures)


benchmarks.register("gradient_plans", run, order=10, render=render)
