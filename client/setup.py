"""What pyproject.toml cannot say of mqds-client: its C extensions, and the generated synchronous client.

``mqds.client.core._wire_columns`` reads ``Next`` answers without a Python object per message
(``mqds.client.core.wire_columns``); ``mqds.client.core._store_frames`` checks, sizes and encodes
pipelined writes and reads their answers (``mqds.client.core.store_frames``). Both take their
protobuf tags from ``mqds/client/core/wire_tags.h``, which ``proto/generate.py`` writes from the
descriptors (a dependency here, so a changed header rebuilds them and goes into the sdist). Both
are optional: where no C compiler or Python headers are present the package installs without them
and the client encodes and parses in Python and with protobuf (slower).

The synchronous client's API modules are written from the asyncio client's by
``generate_sync.py`` (beside this file) before the modules are collected, for a wheel and for an
editable install alike.
"""

import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

sys.path.insert(0, str(Path(__file__).resolve().parent))
import generate_sync


class BuildWithSyncClient(build_py):
    def run(self) -> None:
        generate_sync.generate(check=False)
        super().run()


setup(
    cmdclass={"build_py": BuildWithSyncClient},
    ext_modules=[
        Extension(
            "mqds.client.core._wire_columns",
            sources=["mqds/client/core/_wire_columns.c"],
            depends=["mqds/client/core/wire_tags.h"],
            optional=True,
        ),
        Extension(
            "mqds.client.core._store_frames",
            sources=["mqds/client/core/_store_frames.c"],
            depends=["mqds/client/core/wire_tags.h"],
            optional=True,
        ),
    ],
)
