"""The benchmarks of mqds: development tools, never in the client library or the image.

``mqds bench`` (:mod:`mqds.bench.command`, added to the command line through
the ``mqds.commands`` entry point) drives a running or a fresh local cluster:
write load (:mod:`mqds.bench.load`), small writes beside the peer
(:mod:`mqds.bench.small`, :mod:`mqds.bench.peer`), subscribers
(:mod:`mqds.bench.fanout`), MQTT brokers (:mod:`mqds.bench.mqtt`), ExHook
(:mod:`mqds.bench.exhook_load`), backup (:mod:`mqds.bench.backup`) and
session storms (:mod:`mqds.bench.storm`, :mod:`mqds.bench.sessions`).
``make bench-cluster`` is :mod:`mqds.bench.cluster`, ``make bench-spark``
:mod:`mqds.bench.spark`; :mod:`mqds.bench.front`, :mod:`mqds.bench.links`
and :mod:`mqds.bench.client_call` measure one part each (``python -m``).
How to run them and what they measured: ``docs/performance.md``.
"""
