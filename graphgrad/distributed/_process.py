"""Process helpers of :mod:`graphgrad.distributed._cluster`'s tasks."""

import ctypes
import os
import signal
import subprocess


def die_with_parent() -> None:
  """In the child: be killed when the process that started it dies.

  So a launcher killed without a chance to clean up (SIGKILL, a crash)
  leaves no task behind.
  """
  try:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
  except (OSError, AttributeError):  # not Linux: stop() still ends them
    pass


def killpg(proc: subprocess.Popen, sig: int) -> None:
  """Sends ``sig`` to ``proc``'s process group, unless it has ended."""
  if proc.poll() is not None:
    return
  try:
    os.killpg(proc.pid, sig)
  except ProcessLookupError:
    pass
