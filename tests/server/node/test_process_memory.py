"""Process memory habits: malloc's thresholds (nodes and ``mqds`` commands) and the node's collector."""

from __future__ import annotations

import subprocess
import sys

import pytest

# A child process builds and drops answer-sized buffers (0.9-1.5 MiB, as Next answers) in four
# threads, the way a node's gRPC workers or a replaying client's readers do, and prints the minor
# page faults that took.
CHURN = """
import resource, sys, threading
setup = sys.argv[1]
if setup == "malloc":
    from mqds.protocol.malloc import tune_malloc
    assert tune_malloc()
elif setup == "node":
    from mqds.server.node import runtime
    runtime.tune_process()
parts = [bytes(range(256)) * 64 for _ in range(96)]  # 16 KiB each

def answers():
    for i in range(100):
        answer = b"".join(parts[: 60 + i % 36])
        del answer

before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
threads = [threading.Thread(target=answers) for _ in range(4)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(setup: str) -> int:
    done = subprocess.run([sys.executable, "-c", CHURN, setup], capture_output=True, text=True, timeout=60, check=True)
    return int(done.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux")
def test_answer_buffers_are_reused_not_faulted_in_again_once_malloc_is_tuned() -> None:
    # 400 answers of 240-384 pages each: glibc's defaults fault most pages in again for each one
    # (23,000 faults here); from the heaps, the pages are faulted in once per thread.
    assert faults("none") > 12_000
    for setup in ("malloc", "node"):
        assert faults(setup) < 4_000, setup


def test_the_node_collects_young_objects_less_often_and_freezes_what_it_started_with() -> None:
    code = (
        "import gc; from mqds.server.node import runtime; runtime.tune_process(); "
        "print(gc.get_threshold()); x = [[] for _ in range(1000)]; runtime.freeze_startup_objects(); "
        "print(gc.get_freeze_count() >= 1000)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    threshold, frozen = out.stdout.split("\n")[:2]
    assert threshold == "(50000, 20, 20)"
    assert frozen == "True"
