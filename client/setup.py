"""The one part of mqds-client that pyproject.toml cannot say: its C extensions.

``mqds.client._wire_columns`` reads ``Next`` answers without a Python object per message
(``mqds.client.wire_columns``); ``mqds.client._store_frames`` checks, sizes and encodes pipelined
writes and reads their answers (``mqds.client.store_frames``). Both take their protobuf tags from
``mqds/client/wire_tags.h``, which ``proto/generate.py`` writes from the descriptors (a dependency
here, so a changed header rebuilds them and goes into the sdist). Both are optional: where no C
compiler or Python headers are present the package installs without them and the client encodes
and parses in Python and with protobuf (slower).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "mqds.client._wire_columns",
            sources=["mqds/client/_wire_columns.c"],
            depends=["mqds/client/wire_tags.h"],
            optional=True,
        ),
        Extension(
            "mqds.client._store_frames",
            sources=["mqds/client/_store_frames.c"],
            depends=["mqds/client/wire_tags.h"],
            optional=True,
        ),
    ]
)
