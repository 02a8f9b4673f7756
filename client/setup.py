"""The one part of mqds-client that pyproject.toml cannot say: its C extensions.

``mqds.client._wire_columns`` reads ``Next`` answers without a Python object per message
(``mqds.client.wire_columns``); ``mqds.client._store_frames`` checks, sizes and encodes pipelined
writes and reads their answers (``mqds.client.store_frames``). Both are optional: where no C
compiler or Python headers are present the package installs without them and the client encodes
and parses in Python and with protobuf (slower).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("mqds.client._wire_columns", sources=["mqds/client/_wire_columns.c"], optional=True),
        Extension("mqds.client._store_frames", sources=["mqds/client/_store_frames.c"], optional=True),
    ]
)
