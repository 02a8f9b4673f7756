"""The one part of mqds-server that pyproject.toml cannot say: its C extension.

``mqds.server._wire_native`` encodes read answers (``mqds.server.wire.encode_rows``). It is
optional: where no C compiler or Python headers are present the package installs without it
and nodes encode in Python (slower; a node says so when it starts).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("mqds.server._wire_native", sources=["server/mqds/server/_wire_native.c"], optional=True),
    ]
)
