"""The node's own files and directories under a power loss, on the chaos suite's fault filesystem.

Regression tests of two bugs the first power-loss runs found (issue 23):
directories the node made were never synced into their parents (a power loss
took a single node's every acknowledged write), and a snapshot manifest a
follower received from its leader was written and renamed into place by
pysyncobj without an fsync, after which the log dropped the entries it covers
(a power loss left it torn, and the replica wedged). Both need root and FUSE,
and are skipped with the reason elsewhere.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from pysyncobj.serializer import Serializer

from mqds.chaos.faultfs import FaultFs, unavailable_reason
from mqds.server.durable import make_dirs
from mqds.server.raft.snapshot import ManifestFiles, decode_manifest, encode_manifest

UNAVAILABLE = unavailable_reason()
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no fault filesystem here: {UNAVAILABLE}"),
]


def test_directories_the_node_makes_survive_a_power_loss_and_plain_ones_do_not(tmp_path: Path) -> None:
    with FaultFs(tmp_path / "disk", tmp_path / "mnt", metadata="posix") as fs:
        mnt = tmp_path / "mnt"
        make_dirs(str(mnt / "data" / "raft" / "shard-0001"))
        make_dirs(str(mnt / "data" / "raft"))  # there already: its name synced again, harmlessly
        os.makedirs(mnt / "plain" / "sub")  # what the node did before
        fs.power_loss()
        assert (mnt / "data" / "raft" / "shard-0001").is_dir()
        assert not (mnt / "plain").exists()


def test_a_snapshot_manifest_received_from_the_leader_is_durable_once_read(tmp_path: Path) -> None:
    with FaultFs(tmp_path / "disk", tmp_path / "mnt", metadata="posix") as fs:
        group_dir = tmp_path / "mnt" / "raft" / "shard-0002"
        make_dirs(str(group_dir))
        path = group_dir / "snapshot"
        raw = encode_manifest(2, "n2", (b"\x00", 7, 1), (b"\x00", 6, 1), ["n1", "n2", "n3"], b"the machine's state")
        # As pysyncobj receives one: written to a temporary file, renamed over the manifest, no fsync.
        received = Serializer(str(path), 1 << 20, False, None, None, None)
        assert received.setTransmissionData((raw, True, True))
        # Then it loads it (mqds's deserializer), and drops the log entries the manifest covers.
        machine = SimpleNamespace(applied_index=100)
        manifests = ManifestFiles(2, "shard 2", "n1", str(group_dir), machine, lambda _: None)  # type: ignore[arg-type]
        last, prev, members = manifests.read(str(path))
        assert (last[1], prev[1], [str(m.id) for m in members]) == (7, 6, ["n1", "n2", "n3"])
        fs.power_loss(torn=True, seed=3)
        assert path.read_bytes() == raw
        assert decode_manifest(raw).payload == b"the machine's state"
