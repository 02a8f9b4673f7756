"""The one part of mqds-client that pyproject.toml cannot say: its C extension.

``mqds.client._wire_columns`` reads ``Next`` answers without a Python object per message
(``mqds.client.wire_columns``). It is optional: where no C compiler or Python headers are
present the package installs without it and the client parses answers with protobuf (slower).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("mqds.client._wire_columns", sources=["mqds/client/_wire_columns.c"], optional=True),
    ]
)
