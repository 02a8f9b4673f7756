"""Fault-injection runs against a real multi-process mqds cluster (``python -m mqds.chaos``).

A run starts a cluster of ``mqds-server`` processes (:mod:`mqds.chaos.cluster`,
nodes optionally in network namespaces of their own: :mod:`mqds.chaos.network`),
drives a workload of publishers and readers that records every attempt
(:mod:`mqds.chaos.workload`, into a :class:`~mqds.chaos.history.History`),
injects faults on a seeded schedule (:mod:`mqds.chaos.nemesis`), heals them,
drains, and checks the history (:mod:`mqds.chaos.checker`): nothing
acknowledged lost, nothing unexpected, nothing stored twice, per-publisher order,
replicas converged, and how long writes stopped per fault.
:func:`mqds.chaos.runner.main` is the entry point (``python -m mqds.chaos``; a test tool, not a
command of the ``mqds`` command line); it drives :mod:`mqds.chaos.options`,
:mod:`mqds.chaos.phases` and :mod:`mqds.chaos.verify`.
"""
