"""Markdown tables, target verdicts and the depth plot."""

import os
from typing import Dict, List, Optional

from benchmarks import _variants

TARGETS = (
    # (variant, figure, limit, where)
    ("gg_identity", "step", 1.02, "every model"),
    ("gg_identity", "ops", 1.0, "every model"),
    ("gg_identity", "build", 1.2, "every model"),
    ("gg_all", "step", 1.05, "every model"),
)


def _ratio(a, b) -> Optional[float]:
  return a / b if (a is not None and b) else None


def ratios(entry: Dict, base: Dict) -> Dict[str, Optional[float]]:
  paired = entry.get("step_cpu_ratio") or entry.get("step_ratio")
  return {
      "build": _ratio(entry["build_s"]["median"], base["build_s"]["median"]),
      "ops": _ratio(entry["ops_added"], base["ops_added"]),
      "step": (paired["median"] if paired else
               _ratio(entry["step_s"]["median"], base["step_s"]["median"])),
      "executed": _ratio(entry["executed_ops"], base["executed_ops"]),
  }


def _f(x, fmt="{:.2f}", none="-"):
  return none if x is None else fmt.format(x)


def _spread(s, scale=1.0, fmt="{:.3g}"):
  return (f"{fmt.format(s['median'] * scale)} "
          f"({fmt.format(s['min'] * scale)}-{fmt.format(s['max'] * scale)})")


def model_table(r: Dict) -> str:
  base = r["variants"].get("minimize")
  lines = [
      "| variant | build s, median (min-max) | x min() | ops added | x min() "
      "| executed ops | step ms, wall, median (min-max) | x min(), wall, "
      "paired median (min-max) | step ms, CPU | x min(), CPU, paired median "
      "(min-max) | analyze s | peak RSS MiB: build (+ over model) / "
      "after 2 steps |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for v in _variants.VARIANTS:
    e = r["variants"].get(v)
    if e is None:
      note = r["notes"].get(v, "not run")
      lines.append(f"| {_variants.LABELS[v]} | skipped: {note} |||||||||||")
      continue
    q = ratios(e, base) if base else {}
    rss = e.get("rss")
    ratio = e.get("step_ratio")
    cpu_ratio = e.get("step_cpu_ratio")
    rss_s = (f"+{rss['build_peak_mb'] - rss['base_mb']:.0f} / "
             f"{rss['peak_mb']:.0f} (+{rss['peak_mb'] - rss['base_mb']:.0f})"
             if rss else "-")
    lines.append(
        f"| {_variants.LABELS[v]} | {_spread(e['build_s'])} "
        f"| {_f(q.get('build'))} | {e['ops_added']} | {_f(q.get('ops'))} "
        f"| {e['executed_ops']} | {_spread(e['step_s'], 1e3)} "
        f"| {_spread(ratio, fmt='{:.3f}') if ratio else '-'} "
        f"| {_spread(e['step_cpu_s'], 1e3) if e.get('step_cpu_s') else '-'} "
        f"| {_spread(cpu_ratio, fmt='{:.3f}') if cpu_ratio else '-'} "
        f"| {_f(e.get('analyze_s'), '{:.3f}')} | {rss_s} |")
  return "\n".join(lines)


def verdicts(results: List[Dict]) -> List[str]:
  lines = ["| target | model | ratio | met |", "|---|---|---|---|"]
  for variant, figure, limit, _ in TARGETS:
    for r in results:
      e, base = r["variants"].get(variant), r["variants"].get("minimize")
      if not e or not base:
        continue
      q = ratios(e, base)[figure]
      label = f"{variant} {figure} <= {limit}x"
      lines.append(f"| {label} | {r['model']} | {q:.3f} "
                   f"| {'yes' if q <= limit else '**no**'} |")
  return lines


def fits_table(fits: Dict) -> str:
  lines = ["| variant | depths | build s = a + b*depth (R^2) "
           "| ops = a + b*depth (R^2) | quadratic term of ops (a2*depth^2) |",
           "|---|---|---|---|---|"]
  for v, f in fits.items():
    b, o = f["build_s"], f["ops_added"]
    quad = o.get("quadratic")
    lines.append(
        f"| {_variants.LABELS[v]} | {','.join(map(str, f['depths']))} "
        f"| {b['linear'][1]:.3f} + {b['linear'][0]:.4f}*d ({b['r2']:.4f}) "
        f"| {o['linear'][1]:.0f} + {o['linear'][0]:.2f}*d ({o['r2']:.5f}) "
        f"| {_f(quad[0] if quad else None, '{:.3g}')} |")
  return "\n".join(lines)


def grappler_table(results: List[Dict]) -> str:
  lines = ["| model | variant | executed ops, Grappler on / off "
           "| step ms on | step ms off | x min() on, wall / CPU "
           "| x min() off, wall / CPU |",
           "|---|---|---|---|---|---|---|"]
  for r in results:
    for v, e in r["variants"].items():
      if "step_s_grappler_off" not in e:
        continue
      on, off = e["step_s"]["median"], e["step_s_grappler_off"]["median"]
      cpu_on = (e.get("step_cpu_ratio") or {}).get("median")
      cpu_off = (e.get("step_cpu_ratio_grappler_off") or {}).get("median")
      lines.append(
          f"| {r['model']} | {_variants.LABELS[v]} "
          f"| {e['executed_ops']} / {e['executed_ops_grappler_off']} "
          f"| {on * 1e3:.3g} | {off * 1e3:.3g} "
          f"| {e['step_ratio']['median']:.3f} / "
          f"{_f(cpu_on, '{:.3f}')} "
          f"| {e['step_ratio_grappler_off']['median']:.3f} / "
          f"{_f(cpu_off, '{:.3f}')} |")
  return "\n".join(lines) if len(lines) > 2 else ""


def plans_markdown(results: List[Dict], fits: Dict, figures: List[str]) -> str:
  out = ["## Gradient plans against minimize() and the hand recipe", ""]
  out += ["### Targets", ""] + verdicts(results) + [""]
  if fits:
    out += ["### Growth with depth (MLP, width 256, batch 128)", "",
            fits_table(fits), ""]
  for fig in figures:
    out += [f"![build time and step-time ratio against depth]"
            f"({os.path.basename(fig)})", ""]
  out += ["### Per model", ""]
  for r in results:
    k = r["steps_per_sample"]
    extra = "; ".join(
        f"{v}: {', '.join(f'{a}={b}' for a, b in e['info'].items())}"
        for v, e in r["variants"].items() if e["info"])
    out += [f"#### {r['model']}: {r['description']}", "",
            f"Step samples: mean of {k} steps each, "
            f"{r['variants']['minimize']['step_s']['n']} samples per variant."
            + (f" Plan details: {extra}." if extra else ""), "",
            model_table(r), ""]
  g = grappler_table(results)
  if g:
    out += ["### Grappler on (default) and off", "", g, ""]
  return "\n".join(out)


def analyze_markdown(rows: List[Dict]) -> str:
  out = ["## gg.analyze on large graphs", "",
         "Wall time, and in brackets CPU time of the process, which the "
         "machine's load disturbs less.", "",
         "| blocks | graph ops | forward ops | forward edges | layer edges "
         "| build forward s | gg.analyze s, median (min-max) | gg.analyze CPU "
         "s, median | us CPU per forward op | tf.gradients s (CPU) "
         "| analyze / gradients, wall (CPU) |",
         "|---|---|---|---|---|---|---|---|---|---|---|"]

  def cpu(r, key):
    v = r.get(key)
    return v["median"] if isinstance(v, dict) else v

  for r in rows:
    a = r["analyze_s"]
    a_cpu, g_cpu = cpu(r, "analyze_cpu_s"), cpu(r, "gradients_cpu_s")
    out.append(
        f"| {r['blocks']} | {r['graph_ops']} | {r['forward_ops']} "
        f"| {r['forward_edges']} | {r['layer_edges']} "
        f"| {r['forward_build_s']:.2f} | {_spread(a)} | {_f(a_cpu)} "
        f"| {_f(a_cpu / r['forward_ops'] * 1e6 if a_cpu else None, '{:.0f}')} "
        f"| {r['gradients_s']:.2f} ({_f(g_cpu)}) "
        f"| {a['median'] / r['gradients_s']:.3f} "
        f"({_f(a_cpu / g_cpu if a_cpu and g_cpu else None, '{:.3f}')}) |")
  if len(rows) >= 2:
    first, last = rows[0], rows[-1]
    grow_ops = last["forward_ops"] / first["forward_ops"]
    grow_edges = last["forward_edges"] / first["forward_edges"]
    grow_t = last["analyze_s"]["median"] / first["analyze_s"]["median"]
    line = (f"From {first['forward_ops']} to {last['forward_ops']} forward ops "
            f"({grow_ops:.2f}x; edges {grow_edges:.2f}x), gg.analyze wall time "
            f"grew {grow_t:.2f}x")
    if cpu(first, "analyze_cpu_s") and cpu(last, "analyze_cpu_s"):
      analyze = cpu(last, "analyze_cpu_s") / cpu(first, "analyze_cpu_s")
      grads = cpu(last, "gradients_cpu_s") / cpu(first, "gradients_cpu_s")
      line += (f", CPU time {analyze:.2f}x"
               f" (tf.gradients CPU time {grads:.2f}x)")
    out += ["", line + f"; linear would be {grow_ops:.2f}x."]
  if rows:
    last = rows[-1]
    q = last["analyze_s"]["median"] / last["gradients_s"]
    out += ["", f"Target: on the {last['graph_ops']:,}-op graph, gg.analyze "
            f"takes no longer than tf.gradients on the same graph: "
            f"{last['analyze_s']['median']:.2f} s against "
            f"{last['gradients_s']:.2f} s, ratio {q:.3f}: "
            f"{'met' if q <= 1 else '**not met**'}."]
  return "\n".join(out) + "\n"


def depth_plot(results: List[Dict], out_dir: str) -> List[str]:
  sweep = sorted((r for r in results if r["depth"]), key=lambda r: r["depth"])
  if len(sweep) < 2:
    return []
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
  for v in _variants.VARIANTS:
    pts = [(r["depth"], r["variants"][v]) for r in sweep if v in r["variants"]]
    if not pts:
      continue
    d = [p[0] for p in pts]
    ax1.errorbar(d, [p[1]["build_s"]["median"] for p in pts],
                 yerr=[[p[1]["build_s"]["median"] - p[1]["build_s"]["min"]
                        for p in pts],
                       [p[1]["build_s"]["max"] - p[1]["build_s"]["median"]
                        for p in pts]],
                 marker="o", capsize=3, label=_variants.LABELS[v])
    key = "step_cpu_ratio" if pts[0][1].get("step_cpu_ratio") else "step_ratio"
    ax2.errorbar(d, [p[1][key]["median"] for p in pts],
                 yerr=[[p[1][key]["median"] - p[1][key]["min"] for p in pts],
                       [p[1][key]["max"] - p[1][key]["median"] for p in pts]],
                 marker="o", capsize=3, label=_variants.LABELS[v])
  ax1.set(xlabel="depth (layers)", ylabel="build time, s (median, min-max)",
          title="Graph build time", yscale="log")
  ax2.axhline(1.02, color="grey", ls=":", lw=1)
  ax2.axhline(1.05, color="grey", ls="--", lw=1)
  ax2.set(xlabel="depth (layers)", ylabel="step time / minimize() step time",
          title="Step CPU-time ratio to minimize() (paired median, min-max)",
          ylim=(0.8, 2.0))
  ax1.legend(fontsize=7)
  fig.tight_layout()
  path = os.path.join(out_dir, "depth.png")
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return [path]
