"""The kernel's confinement of a process that opens an untrusted graph.

:func:`confine`, called while the process has one thread (Landlock and
seccomp bind the calling thread and the threads it starts), leaves it
unable to write, create, delete, rename or truncate any file or change its
metadata; to read outside the given paths; to open any socket or run a
program; to signal or trace another process; to use more than its memory
and CPU time; to dump core or outlive its parent. Landlock (ABI 3 or later)
governs paths, TCP and scopes; seccomp, through ``libseccomp.so.2``, refuses
the system calls listed in ``_REFUSED_SYSCALLS``; rlimits bound memory and
CPU. :func:`self_test` proves in the confined process that a write, a
socket, an exec and a read outside the rules are refused. This module
imports nothing of graphgrad: it runs before TensorFlow is loaded.
"""

import ctypes
import dataclasses
import errno
import os
import resource
import signal
import socket
import stat
import sys
import tempfile
from typing import Iterable, List, Optional, Sequence

# Landlock: <linux/landlock.h>. The syscall numbers are the same on every
# architecture (they were added after the tables were unified).
_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
MIN_ABI = 3  # ABI 3 governs truncation; before it a file could be emptied.

_FS_EXECUTE = 1 << 0
_FS_WRITE_FILE = 1 << 1
_FS_READ_FILE = 1 << 2
_FS_READ_DIR = 1 << 3
# REMOVE_DIR .. MAKE_SYM are bits 4-12, REFER 13 (ABI 2), TRUNCATE 14
# (ABI 3), IOCTL_DEV 15 (ABI 5).
_FS_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1,
              5: (1 << 16) - 1}
_NET_BIND_TCP, _NET_CONNECT_TCP = 1 << 0, 1 << 1  # ABI 4
_SCOPE_ABSTRACT_UNIX, _SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6

_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_SET_NO_NEW_PRIVS = 1, 4, 38

# seccomp, through libseccomp: <seccomp.h>.
_SCMP_ACT_ALLOW = 0x7FFF0000
_SCMP_ACT_ERRNO = 0x00050000

# System calls the confined process never needs, refused with EPERM.
_REFUSED_SYSCALLS = (
    # no network, no UNIX sockets, no other program
    "socket socketpair connect bind listen accept accept4 execve execveat "
    # no other process, no new namespace, no mount
    "ptrace process_vm_readv process_vm_writev pidfd_getfd kcmp unshare "
    "setns mount umount2 pivot_root chroot fsopen fsmount fsconfig fspick "
    "move_mount open_tree mount_setattr "
    # file metadata, which Landlock does not govern
    "chmod fchmod fchmodat fchmodat2 chown fchown lchown fchownat utime "
    "utimes utimensat futimesat setxattr lsetxattr fsetxattr setxattrat "
    "removexattr lremovexattr fremovexattr removexattrat "
    "name_to_handle_at open_by_handle_at "
    # the kernel's other doors, and the limits set here
    "bpf perf_event_open userfaultfd io_uring_setup io_uring_enter "
    "io_uring_register keyctl add_key request_key kexec_load "
    "kexec_file_load init_module finit_module delete_module reboot swapon "
    "swapoff acct quotactl syslog setrlimit prlimit64 capset"
).split()


class SandboxError(Exception):
  """The sandbox cannot be set up. The child reports it to the parent,
  which raises a ``GraphGradError`` (this module imports nothing of
  graphgrad: it runs before TensorFlow is loaded)."""


class SandboxUnavailable(SandboxError):
  """The kernel lacks a mechanism the sandbox needs."""


class SandboxBroken(SandboxError):
  """A mechanism the sandbox relies on did not refuse what it must."""


@dataclasses.dataclass(frozen=True)
class Limits:
  """What the confined process may use.

  Attributes:
    memory_bytes: private writable memory (``RLIMIT_DATA``).
    cpu_seconds: CPU time, all threads together (``RLIMIT_CPU``).
  """
  memory_bytes: int
  cpu_seconds: int


class _RulesetAttr(ctypes.Structure):
  _fields_ = [("handled_access_fs", ctypes.c_uint64),
              ("handled_access_net", ctypes.c_uint64),
              ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
  _pack_ = 1
  _fields_ = [("allowed_access", ctypes.c_uint64),
              ("parent_fd", ctypes.c_int32)]


def _libc():
  return ctypes.CDLL(None, use_errno=True)


def landlock_abi() -> int:
  """The kernel's Landlock ABI version; 0 where it has none (or not Linux)."""
  if not sys.platform.startswith("linux"):
    return 0
  libc = _libc()
  libc.syscall.restype = ctypes.c_long
  abi = libc.syscall(ctypes.c_long(_SYS_CREATE_RULESET), None,
                     ctypes.c_size_t(0),
                     ctypes.c_uint32(_CREATE_RULESET_VERSION))
  return max(int(abi), 0)


def _seccomp_library():
  """libseccomp, or ``None``."""
  name = "libseccomp.so.2"
  try:
    lib = ctypes.CDLL(name, use_errno=True)
  except OSError:
    return None
  lib.seccomp_init.restype = ctypes.c_void_p
  lib.seccomp_init.argtypes = [ctypes.c_uint32]
  lib.seccomp_syscall_resolve_name.restype = ctypes.c_int
  lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
  lib.seccomp_rule_add.restype = ctypes.c_int
  lib.seccomp_rule_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32,
                                   ctypes.c_int, ctypes.c_uint]
  lib.seccomp_load.restype = ctypes.c_int
  lib.seccomp_load.argtypes = [ctypes.c_void_p]
  lib.seccomp_release.argtypes = [ctypes.c_void_p]
  return lib


def missing() -> Optional[str]:
  """What this system lacks for the sandbox, or ``None`` if it has it all.

  Example:
    >>> missing() is None or isinstance(missing(), str)
    True
  """
  if not sys.platform.startswith("linux"):
    return f"the sandbox needs Linux's Landlock and seccomp; this is " \
           f"{sys.platform}"
  abi = landlock_abi()
  if abi < MIN_ABI:
    return (f"the kernel's Landlock ABI is {abi or 'absent'} (Linux "
            f"{os.uname().release}); the sandbox needs ABI {MIN_ABI} or "
            f"later (Linux 6.2+), enabled with lsm=landlock")
  if _seccomp_library() is None:
    return "libseccomp.so.2 is not installed (Debian: libseccomp2)"
  return None


def _check(result: int, what: str) -> int:
  if result < 0:
    err = ctypes.get_errno()
    raise SandboxUnavailable(f"{what} failed: {os.strerror(err)} "
                             f"(errno {err})")
  return result


def _set_limits(limits: Limits) -> None:
  resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
  resource.setrlimit(resource.RLIMIT_DATA,
                     (limits.memory_bytes, limits.memory_bytes))
  # SIGXCPU at the soft limit names the cause; SIGKILL follows at the hard.
  resource.setrlimit(resource.RLIMIT_CPU,
                     (limits.cpu_seconds, limits.cpu_seconds + 5))
  # No regular file may grow (a write that got past Landlock would be
  # SIGXFSZ); the pipes to the parent are not regular files.
  resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))


def _prctl(libc, option: int, value: int) -> None:
  _check(libc.prctl(option, ctypes.c_ulong(value), ctypes.c_ulong(0),
                    ctypes.c_ulong(0), ctypes.c_ulong(0)), f"prctl({option})")


def _landlock(libc, abi: int, read_paths: Sequence[str]) -> None:
  fs = _FS_BY_ABI[max(k for k in _FS_BY_ABI if k <= abi)]
  attr = _RulesetAttr(fs, (_NET_BIND_TCP | _NET_CONNECT_TCP) if abi >= 4
                      else 0,
                      (_SCOPE_ABSTRACT_UNIX | _SCOPE_SIGNAL) if abi >= 6
                      else 0)
  size = ctypes.sizeof(_RulesetAttr) if abi >= 6 else 16 if abi >= 4 else 8
  libc.syscall.restype = ctypes.c_long
  ruleset = _check(libc.syscall(ctypes.c_long(_SYS_CREATE_RULESET),
                                ctypes.byref(attr), ctypes.c_size_t(size),
                                ctypes.c_uint32(0)),
                   "landlock_create_ruleset")
  try:
    for path in read_paths:
      try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
      except OSError:
        continue  # gone since it was listed: nothing to allow
      try:
        is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
        access = _FS_READ_FILE | (_FS_READ_DIR if is_dir else 0)
        rule = _PathBeneathAttr(access, fd)
        _check(libc.syscall(ctypes.c_long(_SYS_ADD_RULE),
                            ctypes.c_int(ruleset),
                            ctypes.c_int(_RULE_PATH_BENEATH),
                            ctypes.byref(rule), ctypes.c_uint32(0)),
               f"landlock_add_rule({path!r})")
      finally:
        os.close(fd)
    _check(libc.syscall(ctypes.c_long(_SYS_RESTRICT_SELF),
                        ctypes.c_int(ruleset), ctypes.c_uint32(0)),
           "landlock_restrict_self")
  finally:
    os.close(ruleset)


def _seccomp(lib) -> None:
  ctx = lib.seccomp_init(_SCMP_ACT_ALLOW)
  if not ctx:
    raise SandboxUnavailable("seccomp_init failed")
  try:
    refuse = _SCMP_ACT_ERRNO | errno.EPERM
    for name in _REFUSED_SYSCALLS:
      number = lib.seccomp_syscall_resolve_name(name.encode())
      if number < 0:
        continue  # not a system call on this architecture
      rc = lib.seccomp_rule_add(ctx, refuse, number, 0)
      if rc < 0:
        raise SandboxUnavailable(f"seccomp_rule_add({name}) failed: "
                                 f"{os.strerror(-rc)}")
    rc = lib.seccomp_load(ctx)
    if rc < 0:
      raise SandboxUnavailable(f"seccomp_load failed: {os.strerror(-rc)}")
  finally:
    lib.seccomp_release(ctx)


def _drop_capabilities(libc) -> None:
  """A process started as root keeps no capability (it could otherwise
  raise its hard limits or override file permissions)."""
  header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
  data = (ctypes.c_uint32 * 6)()
  libc.syscall.restype = ctypes.c_long
  _check(libc.syscall(ctypes.c_long(126 if os.uname().machine == "x86_64"
                                    else 91), header, data), "capset")


def threads() -> int:
  """How many threads this process has (from ``/proc/self/task``)."""
  return len(os.listdir("/proc/self/task"))


def confine(read_paths: Iterable[str], limits: Limits) -> None:
  """Confines the calling process for good; see the module docstring.

  Args:
    read_paths: files and directories it may still read.
    limits: its memory and CPU time.

  Raises:
    SandboxUnavailable: the kernel lacks a mechanism, or the process
      already runs more than one thread.
  """
  why = missing()
  if why:
    raise SandboxUnavailable(why)
  if threads() != 1:
    raise SandboxUnavailable(
        f"the process already runs {threads()} threads; Landlock and "
        f"seccomp bind the calling thread only, so it must confine itself "
        f"before it starts any")
  libc = _libc()
  _set_limits(limits)
  _prctl(libc, _PR_SET_PDEATHSIG, signal.SIGKILL)
  if os.getppid() == 1:  # the parent is already gone
    os._exit(2)  # pylint: disable=protected-access
  _prctl(libc, _PR_SET_DUMPABLE, 0)
  _prctl(libc, _PR_SET_NO_NEW_PRIVS, 1)
  _landlock(libc, landlock_abi(), list(read_paths))
  if os.geteuid() == 0 and os.uname().machine in ("x86_64", "aarch64"):
    _drop_capabilities(libc)
  _seccomp(_seccomp_library())


def _refused(attempt, what: str) -> Optional[str]:
  """``None`` if ``attempt()`` raised PermissionError, else ``what``."""
  try:
    attempt()
  except PermissionError:
    return None
  except OSError as e:
    return f"{what} failed with {type(e).__name__} ({e}), not a refusal"
  return f"{what} succeeded"


def _create(directory: str) -> None:
  path = os.path.join(directory, f".graphgrad-sandbox-probe-{os.getpid()}")
  fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
  os.close(fd)
  os.unlink(path)  # only reached when the sandbox is broken


def _read(path: str) -> None:
  with open(path, "rb") as f:
    f.read(1)


def _spawn() -> None:
  pid = os.posix_spawn(sys.executable, [sys.executable, "-c", "pass"],
                       dict(os.environ))
  os.waitpid(pid, 0)


def self_test(write_dirs: Sequence[str], unreadable: str) -> None:
  """Proves, in the confined process, that the kernel refuses what it must.

  Args:
    write_dirs: directories a write is attempted in (the model's own, and
      the temporary directory, which an unconfined process may write).
    unreadable: an existing file outside the read rules.

  Raises:
    SandboxBroken: naming each attempt that was not refused.
  """
  failures: List[Optional[str]] = []
  for d in write_dirs:
    failures.append(_refused(lambda d=d: _create(d),
                             f"creating a file in {d!r}"))
  failures.append(_refused(lambda: _read(unreadable),
                           f"reading {unreadable!r}"))
  failures.append(_refused(
      lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM).close(),
      "opening a TCP socket"))
  failures.append(_refused(
      lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).close(),
      "opening a UNIX socket"))
  failures.append(_refused(_spawn, f"running {sys.executable}"))
  found = [f for f in failures if f]
  if found:
    raise SandboxBroken(
        "the sandbox's self-test failed: " + "; ".join(found)
        + ". The kernel does not confine as graphgrad relies on")


def enter(spec: dict, channel) -> None:
  """The child's first step: confine, prove it, and say so on ``channel``.

  Args:
    spec: the parent's ``read`` paths, ``memory_bytes``, ``cpu_seconds``,
      ``probe_dirs`` (where the self-test tries to write: the model's
      directory and the temporary directory) and ``unreadable`` probe
      file.
    channel: the child's writable message file.

  Raises:
    SandboxError: after it is reported on ``channel``.
  """
  # Libraries ask for the temporary directory at import (absl's tests do);
  # finding it would try to write there, so it is the parent's answer.
  tempfile.tempdir = spec["probe_dirs"][-1]
  try:
    confine(spec["read"], Limits(spec["memory_bytes"], spec["cpu_seconds"]))
    self_test(spec["probe_dirs"], spec["unreadable"])
  except SandboxError as e:
    send(channel, "sandbox", message=str(e))
    raise
  send(channel, "confined")


def send(channel, kind: str, **fields) -> None:
  """Writes one message, a JSON line, to the parent."""
  import json  # pylint: disable=g-import-not-at-top
  channel.write(json.dumps(dict(fields, kind=kind)) + "\n")
  channel.flush()
