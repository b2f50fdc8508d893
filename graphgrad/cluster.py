"""Local TF1 ps/worker clusters for tests and examples.

Example:
  >>> import graphgrad as gg
  >>> c = gg.cluster.LocalCluster(num_ps=1, num_workers=2, isolate=False)
  >>> [len(c.spec[job]) for job in ("ps", "worker")]
  [1, 2]
  >>> c.stop()
"""

from graphgrad.distributed._cluster import (
                                ClusterError,
                                LocalCluster,
                                free_ports,
                                session_config,
                                start_server,
                                wait_until_initialized,
)

__all__ = [
    "ClusterError", "LocalCluster", "free_ports", "session_config",
    "start_server", "wait_until_initialized",
]
