"""The client's I/O-free core, shared by both drivers (``mqds.client.sync`` and ``mqds.client.aio``).

Requests are built and answers parsed (``operations``, ``offline``, ``deletes``,
``share_group``), retries, leader hints and map refreshes decided (``retry``,
``routing_table``, ``fanout``), pipelined writes planned (``pipeline``,
``pipeline_calls``, ``store_frames``), push subscriptions' positions kept
(``follow``), replays planned and merged (``rank_read``, ``merge``,
``stream_reads``) and backups' files written and checked (``backup_files``,
``backup_runs``, which read and write a backup's files) here, with no call to
the cluster, thread or event loop: what waits is in the drivers. The C
extensions (``_wire_columns``, ``_store_frames``) are here too.
"""
