"""The synchronous mqds client's driver: threads where the asyncio driver (``mqds.client.aio``) has tasks.

Import the client from :mod:`mqds.client` (``from mqds.client import Client``).
The modules here have the names of their asyncio twins. ``backup.py``,
``client.py``, ``reads.py``, ``retention.py`` and ``share_members.py`` are
generated from the asyncio driver's by ``client/generate_sync.py`` (``make
generate``; a wheel or an editable install writes them too) and are not kept
in git; ``concurrency.py``, ``routing.py``, ``pipeline.py``, ``handles.py``,
``follow.py`` and ``replay.py`` are written by hand, because they wait
differently.
"""
