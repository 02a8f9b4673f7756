"""Development tools around real ``mqds-server`` processes; not part of a node's runtime.

The local-process harness (the tests, the demo, the benchmarks, ``mqds
cluster`` and :mod:`mqds.chaos` use it), each name imported from the module
that defines it: :class:`~mqds.tools.local_cluster.LocalCluster` (N nodes on loopback forming
one cluster), :class:`~mqds.tools.processes.NodeProcess` (one node
process), :mod:`mqds.tools.ports` (free loopback ports) and
:mod:`mqds.tools.waiting` (bounded polling, readiness through the health
service). :mod:`mqds.tools.demo` is ``make demo``,
:mod:`mqds.bench.cluster` is ``make bench-cluster``. The package is
the ``mqds-tools`` distribution, installed by ``make install`` and not in
the container image; :mod:`mqds.tools.cluster_command` is ``mqds cluster``.
"""
