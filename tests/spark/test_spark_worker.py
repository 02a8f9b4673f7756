"""The Python worker a Spark task reads in: its heap frozen once, so PySpark's collection after each task is cheap.

No Spark session and no cluster. The tuning runs in a process of its own,
since it freezes the heap of the process it runs in.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.spark

_SETTLE = """
import gc, weakref
from pyspark.sql.datasource import InputPartition
from mqds.spark import arrow_schema
from mqds.spark.batch import read_partition
from mqds.spark.options import parse_options

options = parse_options({"endpoints": "127.0.0.1:1", "topicfilter": "a/#"}, streaming=False)
tracked = len(gc.get_objects())
assert list(read_partition(options, InputPartition(None), arrow_schema())) == []  # a task with nothing to read
frozen = gc.get_freeze_count()
left = len(gc.get_objects())
assert list(read_partition(options, InputPartition(None), arrow_schema())) == []
assert gc.get_freeze_count() == frozen, "a second task froze the heap again"

class Node:
    pass

cycle = Node()
cycle.me = cycle
gone = weakref.ref(cycle)
del cycle
gc.collect()
print(tracked, frozen, left, gone() is None)
"""


def test_a_worker_freezes_its_startup_heap_once_and_still_collects_what_tasks_leave() -> None:
    """PySpark collects a reused worker's whole heap after every task; a task's first read freezes the objects
    the imports left out of that walk, once per process, and a cycle a later task leaves behind is still
    collected."""
    out = subprocess.run([sys.executable, "-c", _SETTLE], capture_output=True, text=True, timeout=120, check=True)
    tracked, frozen, left, collected = out.stdout.split()
    assert int(frozen) > 10_000, f"only {frozen} objects frozen: the imports' objects were not"
    assert int(left) < int(tracked) // 10, f"a collection still walks {left} of the {tracked} objects"
    assert collected == "True"
