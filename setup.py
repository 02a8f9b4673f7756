"""The one part of mqds-server that pyproject.toml cannot say: its C extensions.

``mqds.server._wire_native`` encodes read answers (``mqds.server.wire.encode_rows``);
``mqds.server.storage._store_native`` puts a stored batch's keys (``writes.put_batch_python``).
``_wire_native`` takes its protobuf tags from ``wire_tags.h`` beside it, which ``proto/generate.py``
writes from the descriptors (a dependency here, so a changed header rebuilds it and goes into the sdist).
They are optional: where no C compiler or Python headers are present the package installs
without them and nodes run the Python versions (slower; a node says so when it starts).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "mqds.server._wire_native",
            sources=["server/mqds/server/_wire_native.c"],
            depends=["server/mqds/server/wire_tags.h"],
            optional=True,
        ),
        Extension(
            "mqds.server.storage._store_native", sources=["server/mqds/server/storage/_store_native.c"], optional=True
        ),
    ]
)
