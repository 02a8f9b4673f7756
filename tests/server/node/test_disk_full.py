"""A node whose disk fills up: writes refused with a clear retriable status, then it recovers by itself.

Regression test of a bug the first disk-full runs found (issue 23): a failed
write of the Raft log fenced it for good and RocksDB refused every write
after one failed, so the node stayed wedged (and, as a leader, kept its
vnodes) until someone restarted it. Now its disk guard cuts it off from its
peers, refuses leader work with UNAVAILABLE, and restarts the process in
place once the disk takes writes again. Needs root and FUSE (the chaos
suite's fault filesystem); skipped with the reason elsewhere.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from mqds.chaos.faultfs import FaultFs, unavailable_reason
from mqds.client import Client, Message
from mqds.client.errors import MqdsError, UnavailableError
from mqds.tools.processes import NodeProcess

UNAVAILABLE = unavailable_reason()
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no fault filesystem here: {UNAVAILABLE}"),
]


def _batch(tag: str, size: int = 100) -> list[Message]:
    return [Message(topic=f"k/{j % 5}", payload=tag.encode() + b"." * size, sender="p") for j in range(50)]


def test_a_node_whose_disk_fills_refuses_writes_clearly_and_recovers_by_itself_when_space_returns(
    tmp_path: Path,
) -> None:
    with FaultFs(tmp_path / "n1.disk", tmp_path / "n1", metadata="journal") as disk:
        # No free-space floor: this is the disk guard's test (a write that fails), not admission control's
        # (test_disk_quota.py), which would otherwise refuse the writes before they reach the full disk.
        node = NodeProcess(tmp_path / "n1", args=["--n-shards", "2", "--disk-min-free-bytes", "0"])
        try:
            node.start(60)
            pid = node.pid
            acked: list[Message] = []
            with Client(node.address, timeout_s=10) as c:
                for i in range(5):
                    acked += c.store_batch(_batch(f"before-{i}"))
            # A short deadline: a refusal is retriable, so the client tries again until it runs out.
            with Client(node.address, timeout_s=1.5) as c:
                disk.disk_full(free_bytes=0)
                refusals: list[str] = []
                for i in range(3):
                    try:
                        acked += c.store_batch(_batch(f"full-{i}", 4000))
                    except MqdsError as err:  # the first may time out: its outcome is unknown, as it should be
                        refusals.append(str(err))
                assert len(refusals) == 3
                assert any("disk failed" in r and "No space left on device" in r for r in refusals), refusals
                with pytest.raises(UnavailableError, match="disk failed"):
                    c.store_batch(_batch("refused"))
            assert node.running and node.pid == pid  # up all along
            disk.heal()
            deadline = time.monotonic() + 30
            with Client(node.address, timeout_s=5) as c:
                while True:
                    try:
                        acked += c.store_batch(_batch("after"))
                        break
                    except MqdsError:
                        assert time.monotonic() < deadline, (
                            f"no write accepted 30 s after the disk came back:\n{node.output()}"
                        )
                        time.sleep(0.5)
                got = {(m.topic, m.payload, m.timestamp_us) for m in c.replay("k/#")}
            assert node.pid == pid  # restarted in place
            assert "restarting from what is durable" in node.output()
        finally:
            node.kill()
    missing = {(m.topic, m.payload, m.timestamp_us) for m in acked} - got
    assert not missing, f"{len(missing)} of {len(acked)} acknowledged messages lost"
