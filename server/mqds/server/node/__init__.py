"""The node itself: the composition root and the parts it wires above the layers.

``node.Node`` builds a node from its settings, wires its parts and starts and
stops them; ``main`` is the ``mqds-server`` command that runs one. The parts,
one concept per module: ``datadir`` (the data directory's lock and layout),
``hosting`` (the Raft groups and vnode replicas hosted here), ``health``
(liveness and readiness), ``maintenance`` and ``retention_rules`` (the
background loop and its retention job), ``snapshots`` (checkpoints streamed
between nodes), ``peers`` (channels to the other nodes), ``diskguard`` (what
the node does when its disk fails) and ``runtime`` (the process's malloc and
collector settings). These modules may import every layer (``api``,
``cluster``, ``raft``, ``storage``) and the base modules beside them; nothing
in a layer imports them. Import each name from the module that defines it:
this package re-exports nothing.
"""
