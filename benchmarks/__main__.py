"""``python -m benchmarks``: run the suites, write RESULTS.md and the plot.

A full run writes ``benchmarks/RESULTS.md``, ``benchmarks/results.json`` and
``benchmarks/depth.png``. ``--tiny`` runs in seconds and writes to a fresh
temporary directory (or ``--out``), never over the committed results.
"""

import argparse
import datetime
import json
import logging
import os
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

HERE = os.path.dirname(os.path.abspath(__file__))

METHOD = """\
## Method

- Command: `{command}`; {wall:.0f} s wall time for the whole run.
- Every variant gets its own `tf.Graph`, built from the same model code. Build
  time covers only what the variant adds after the forward model exists:
  `optimizer.minimize(loss)`; the hand recipe; or `gg.analyze` +
  `GradientPlan` + `apply_gradients`. "ops added" counts the ops that step
  added. The optimizer is plain SGD (`GradientDescentOptimizer`), which has
  no slot variables: the gradient's share of every figure is the largest, so
  the ratios are the strictest. All variants use `GATE_OP`, `minimize()`'s
  default, and run `UPDATE_OPS` before the update.
- Builds alternate between variants on every repetition (the order rotates);
  `gc.collect()` and `gc.freeze()` run before every build (and every timed
  `gg.analyze` or `tf.gradients` below), so a build pays for collecting its
  own garbage only, not for scanning the graphs built before it. The table
  gives the median and (min-max); "x min()" is the ratio of medians.
- Step time: one `Session` per variant (one intra- and one inter-op thread,
  see below), all alive in the same process; two warm-up steps; then every
  repetition times each variant in turn (rotating order) over the same
  number of `sess.run(train_op)` calls (about 0.25 s for the fastest), with
  fixed random inputs fed by `feed_dict`. A sample is the mean step time of
  that run, taken twice: wall time, and the CPU time of the process (all
  TensorFlow threads; `time.process_time()`), which a busy shared machine
  disturbs much less, since time spent descheduled is not counted. The
  table gives median (min-max) of the samples. The step "x min()" is the
  median over repetitions of the ratio of a variant's sample to
  `minimize()`'s sample of the same repetition: the two are adjacent in
  time, so a slow spell of the machine cancels out. The targets are judged
  on the CPU-time ratio; the wall-time ratio is shown beside it. Grappler is
  on, its default, unless a table says off.
- Sessions use one thread each: on a shared 2-core machine an op split over
  two threads waits for whichever is descheduled, which multiplies the
  noise. All variants get the same setting.
- "executed ops" counts the nodes of the partition graphs the runtime runs
  for one step (`RunOptions(output_partition_graphs=True)`), i.e. after
  Grappler's pruning, constant folding and common-subexpression elimination.
- Peak RSS: one fresh child process per (model, variant), forked from a
  server that has imported only TensorFlow and graphgrad. It builds the
  model, reads `VmRSS`, builds the variant, runs two steps and reads the
  kernel's high-water mark `VmHWM` twice: after the build and after the
  steps. The table gives the build's growth over the RSS with the forward
  model built, then the peak after two steps and, in brackets, its growth.
- `gg.analyze` time on each model is measured inside the graphgrad variants'
  builds; the section "gg.analyze on large graphs" measures it alone.

## Machine and noise

{machine}

The machine is shared with other jobs: load average at start
{load}. Build times of identical graphs vary by up to the min-max spread
shown. The identity plan executes the same ops as `minimize()` (see
"executed ops"), so its step ratio is the noise floor of this machine:
{noise}
"""


def _noise(data) -> str:
  """The identity plan's paired step ratios: the measurement's noise floor."""
  plans = data["suites"].get("gradient_plans", {}).get("data", {})
  rows = []
  for m in plans.get("models", ()):
    e = m["variants"].get("gg_identity", {})
    for key, what in (("step_cpu_ratio", "CPU"), ("step_ratio", "wall")):
      r = e.get(key)
      if r:
        rows.append((m["model"], what, r))
  if not rows:
    return "(not measured in this run)."
  lines = ["", "| model | clock | median | min | max |",
           "|---|---|---|---|---|"]
  lines += [f"| {m} | {w} | {r['median']:.3f} | {r['min']:.3f} "
            f"| {r['max']:.3f} |"
            for m, w, r in rows]
  return "\n".join(lines)


def _machine_md(m):
  return "\n".join(f"- {k}: {v}" for k, v in m.items() if k != "load_at_start")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--tiny", action="store_true",
                      help="smoke-test configuration: seconds, small models, "
                      "writes to a temporary directory")
  parser.add_argument("--out", help="output directory (default: benchmarks/ "
                      "for a full run, a new temporary directory for --tiny)")
  parser.add_argument("--reps", type=int, default=7,
                      help="repetitions per timed figure (default 7)")
  parser.add_argument("--only", nargs="*", help="model names to run")
  parser.add_argument("--suites", nargs="*", help="suite names to run")
  parser.add_argument("--no-grappler-off", action="store_true",
                      help="skip the step-time pass with Grappler disabled")
  parser.add_argument("--render", action="store_true",
                      help="only rewrite RESULTS.md from results.json in the "
                      "output directory")
  parser.add_argument("-v", "--verbose", action="store_true")
  args = parser.parse_args(argv)
  logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                      format="%(asctime)s %(message)s")
  logging.getLogger("graphgrad").setLevel(logging.WARNING)
  logging.getLogger("graphgrad.benchmarks").setLevel(logging.INFO)

  import benchmarks  # pylint: disable=g-import-not-at-top
  from benchmarks import _measure  # pylint: disable=g-import-not-at-top

  if args.out:
    out_dir = os.path.abspath(args.out)
  elif args.tiny:
    out_dir = tempfile.mkdtemp(prefix="graphgrad-bench-")
  else:
    out_dir = HERE
  if args.tiny and os.path.abspath(out_dir) == HERE:
    parser.error("--tiny never writes into benchmarks/; pass another --out")
  os.makedirs(out_dir, exist_ok=True)
  config = benchmarks.Config(tiny=args.tiny, out_dir=out_dir, reps=args.reps,
                             only=args.only,
                             grappler_off=not args.no_grappler_off)
  if args.render:
    with open(os.path.join(out_dir, "results.json")) as f:
      data = json.load(f)
    known = {s.name: s for s in benchmarks.suites()}
    for name, saved in data["suites"].items():
      if name in known and known[name].render is not None:
        saved["markdown"] = known[name].render(saved["data"], out_dir)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
      json.dump(data, f, indent=1, default=str)
    _write(out_dir, data)
    print(os.path.join(out_dir, "RESULTS.md"))
    return 0
  machine = _measure.machine()
  start = time.perf_counter()
  data = {"machine": machine, "tiny": args.tiny, "suites": {},
          "command": " ".join(["python -m benchmarks"] + list(
              sys.argv[1:] if argv is None else argv))}
  saved = os.path.join(out_dir, "results.json")
  if args.suites and os.path.exists(saved):
    # Re-running some suites keeps the others' saved numbers.
    with open(saved) as f:
      previous = json.load(f)
    if previous.get("tiny") == args.tiny:
      data["suites"] = previous["suites"]
      data["rerun"] = f"{data['command']} (other suites from an earlier run)"
      data["command"] = previous["command"]
  for suite in benchmarks.suites():
    if args.suites and suite.name not in args.suites:
      continue
    if args.tiny and not suite.in_tiny:
      continue
    logging.getLogger("graphgrad.benchmarks").info("suite %s", suite.name)
    result = suite.run(config)
    data["suites"][suite.name] = {"markdown": result.markdown,
                                  "data": result.data}
  data["wall_s"] = time.perf_counter() - start + (
      previous.get("wall_s", 0) if data.get("rerun") else 0)
  now = datetime.datetime.now(datetime.timezone.utc)
  data["date"] = f"{now:%Y-%m-%d %H:%M}"
  with open(os.path.join(out_dir, "results.json"), "w") as f:
    json.dump(data, f, indent=1, default=str)
  _write(out_dir, data)
  print(os.path.join(out_dir, "RESULTS.md"))
  return 0


def _write(out_dir, data) -> None:
  """Writes RESULTS.md from the numbers of a run."""
  machine, command = data["machine"], data["command"]
  header = [
      "# graphgrad benchmarks", "",
      f"Generated by `{command}` on {data['date']} UTC"
      + (" (tiny smoke-test configuration)." if data["tiny"] else "."),
      "Regenerate with `python -m benchmarks` from the repository root."
      + (f" Last step: `{data['rerun']}`." if data.get("rerun") else ""), ""]
  discussion = os.path.join(HERE, "_discussion.md")
  if not data["tiny"] and os.path.exists(discussion):
    with open(discussion) as f:
      header += [f.read().strip(), ""]
  method = METHOD.format(command=command, wall=data["wall_s"],
                         machine=_machine_md(machine),
                         load=machine["load_at_start"], noise=_noise(data))
  sections = [s["markdown"] for s in data["suites"].values()]
  with open(os.path.join(out_dir, "RESULTS.md"), "w") as f:
    f.write("\n".join(header + sections + [method]) + "\n")


if __name__ == "__main__":
  sys.exit(main())
