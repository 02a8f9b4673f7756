"""The local-process harness in one place: local clusters, node processes, ports and waits.

Used by the demo, the tests, the benchmarks, ``mqds cluster`` and the chaos
runner. The names live in modules of their own (:mod:`mqds.tools.local_cluster`,
:mod:`mqds.tools.processes`, :mod:`mqds.tools.ports`, :mod:`mqds.tools.waiting`,
:mod:`mqds.tools.errors`); this module re-exports them.
"""

from __future__ import annotations

from mqds.tools.errors import LocalClusterError
from mqds.tools.local_cluster import STATE_FILE, STATE_FORMAT, LocalCluster
from mqds.tools.ports import free_port, free_port_block, port_in_use
from mqds.tools.processes import SERVER, NodeProcess
from mqds.tools.waiting import READY_SERVICE, wait_serving, wait_until

__all__ = [
    "READY_SERVICE",
    "SERVER",
    "STATE_FILE",
    "STATE_FORMAT",
    "LocalCluster",
    "LocalClusterError",
    "NodeProcess",
    "free_port",
    "free_port_block",
    "port_in_use",
    "wait_serving",
    "wait_until",
]
