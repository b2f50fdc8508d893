"""Faults on a real cluster: a worker and then the chief are killed (SIGKILL).

Asynchronous training of a plan on 1 ps + 2 workers. A limit file holds the
global step the workers may reach for now, so each fault lands at a known
point of training whatever the machine's speed. The timeline is printed
(``pytest -s``) and checked:

1. both workers train; worker 1 is killed while it trains;
2. the chief trains on alone; worker 1 restarts and rejoins at a global step
   no lower than the one it was killed at;
3. between two checkpoints, worker 1 is frozen (SIGSTOP) and the chief is
   killed; the restarted chief restores the last checkpoint, so training
   goes on from that checkpoint's global step (the steps after it are
   redone: TF's MonitoredTrainingSession restores whenever a chief starts);
4. worker 1 resumes (SIGCONT); both train to the last step and exit 0.
"""

import os
import signal
import time

import graphgrad as gg
from cluster_util import (
  TIMEOUT,
  checkpoint_step,
  events,
  launch_worker,
  print_tails,
  wait_checkpoint,
  wait_event,
)

LAST_STEP = 160
SAVE_STEPS = 25


def _steps(evs):
  return [e["global_step"] for e in evs if e["kind"] == "step"]


def test_killed_worker_rejoins_and_restarted_chief_restores(tmp_path):
  ckpt, limit = tmp_path / "ckpt", tmp_path / "limit"
  t0 = time.monotonic()
  timeline = []

  def note(text):
    timeline.append(f"{time.monotonic() - t0:6.1f} s  {text}")

  def set_limit(step):
    tmp = tmp_path / "limit.tmp"
    tmp.write_text(str(step))
    tmp.rename(limit)  # atomic: a worker never reads a half-written file

  def start(task):
    pids.append(launch_worker(cluster, task, "async", ckpt, LAST_STEP,
                              save_steps=SAVE_STEPS, limit_file=limit,
                              pace=0.02).pid)

  cluster = gg.cluster.LocalCluster(log_dir=str(tmp_path / "logs"))
  pids = []
  try:
    with cluster:
      pids += [cluster._holder.pid, cluster.procs[("ps", 0)].pid]
      set_limit(40)
      start(0)
      start(1)
      _, e = wait_event(cluster, 1, lambda e: e["kind"] == "step"
                        and e["global_step"] >= 10, "training")
      note(f"both workers train; worker 1 at global step {e['global_step']}")

      # 1. Kill worker 1 while it trains.
      assert cluster.kill("worker", 1) == -signal.SIGKILL
      killed_at = max(_steps(events(cluster, 1)))
      note(f"SIGKILL worker 1, last seen at global step {killed_at}")

      # 2. The chief trains on alone; worker 1 restarts and rejoins.
      set_limit(80)
      _, e = wait_event(cluster, 0, lambda e: e["kind"] == "step"
                        and e["global_step"] >= 60, "training alone")
      note(f"chief trains alone, global step {e['global_step']}")
      life2 = len(events(cluster, 1))
      start(1)
      _, e = wait_event(cluster, 1, lambda e: e["kind"] == "step",
                        "a step after restarting", start=life2)
      rejoined_at = e["global_step"]
      note(f"worker 1 restarted, rejoins at global step {rejoined_at}")
      assert rejoined_at >= killed_at

      # 3. Freeze worker 1, kill the chief, restart it.
      set_limit(120)
      saved = wait_checkpoint(ckpt, 100)
      # Past that checkpoint and before the next one (the limit holds them).
      wait_event(cluster, 1, lambda e: e["kind"] == "step"
                 and e["global_step"] >= saved + 4,
                 "training after rejoining", start=life2)
      cluster.kill("worker", 1, signal.SIGSTOP)
      resumed = len(events(cluster, 1))
      assert cluster.kill("worker", 0) == -signal.SIGKILL
      chief_last = max(_steps(events(cluster, 0)))
      last_ckpt = checkpoint_step(ckpt)
      note(f"SIGSTOP worker 1; SIGKILL chief at global step {chief_last}; "
           f"newest checkpoint at step {last_ckpt}")
      assert saved <= last_ckpt <= chief_last + 1
      chief_life2 = len(events(cluster, 0))
      start(0)
      _, e = wait_event(cluster, 0, lambda e: e["kind"] == "session",
                        "a restored session", start=chief_life2)
      note(f"chief restarted, restored global step {e['global_step']}")
      assert e["global_step"] == last_ckpt

      # 4. Worker 1 resumes; both finish.
      cluster.kill("worker", 1, signal.SIGCONT)
      set_limit(LAST_STEP)
      codes = [cluster.wait("worker", t, TIMEOUT) for t in (0, 1)]
      assert codes == [0, 0], [cluster.tail("worker", t) for t in (0, 1)]
      final = checkpoint_step(ckpt)
      note(f"both workers done; final checkpoint at step {final}")
      assert final >= LAST_STEP

      # Within each process's life the global step never went back, except
      # where the chief restored the checkpoint, which rolls back to it.
      chief_old = _steps(events(cluster, 0)[:chief_life2])
      chief_new = _steps(events(cluster, 0)[chief_life2:])
      w1_first = _steps(events(cluster, 1)[:life2])
      w1_rejoined = _steps(events(cluster, 1)[life2:resumed])
      w1_resumed = _steps(events(cluster, 1)[resumed:])
      for seq in (chief_old, chief_new, w1_first, w1_rejoined):
        assert seq == sorted(seq)
      assert min(w1_rejoined) >= killed_at
      assert min(chief_new + w1_resumed) >= last_ckpt
      for task in (0, 1):
        assert [e["kind"] for e in events(cluster, task)].count("done") == 1
  except BaseException:
    print_tails(cluster)
    raise
  finally:
    print("\n".join(["fault timeline:"] + timeline))
    for (job, task), proc in cluster.procs.items():
      assert proc.returncode is not None, f"{job}:{task} still runs"
    for pid in pids:  # every process started, restarts included
      assert not os.path.exists(f"/proc/{pid}"), f"process {pid} lingers"
