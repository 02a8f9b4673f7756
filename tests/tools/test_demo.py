"""The main job runs end to end, its checks catch what they claim to, and it leaves nothing behind."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from mqds.tools.demo import compare_readings


def reading(device: str, seq: int) -> bytes:
    return json.dumps({"device": device, "seq": seq, "temp": 21}).encode()


def test_the_demo_check_passes_an_exact_replay_and_names_every_kind_of_problem() -> None:
    acked = [("d1", 0), ("d1", 1), ("d2", 0)]
    exact = compare_readings(acked, [reading("d1", 0), reading("d2", 0), reading("d1", 1)])
    assert exact.problems() == []
    assert exact.summary().startswith("acknowledged 3  replayed 3  lost 0  duplicated 0  never acknowledged 0")

    lost = compare_readings(acked, [reading("d1", 0), reading("d1", 1)])
    assert lost.lost == [("d2", 0)] and len(lost.problems()) == 1

    duplicated = compare_readings(acked, [reading("d1", 0), reading("d1", 1), reading("d1", 1), reading("d2", 0)])
    assert duplicated.duplicated == 1 and "more than once" in duplicated.problems()[0]

    unexpected = compare_readings(acked, [reading("d1", 0), reading("d1", 1), reading("d2", 0), b"online"])
    assert unexpected.unexpected == 1 and "never acknowledged" in unexpected.problems()[0]

    reordered = compare_readings(acked, [reading("d1", 1), reading("d1", 0), reading("d2", 0)])
    assert reordered.out_of_order == ["d1"] and "out of order" in reordered.problems()[0]


@pytest.mark.integration
@pytest.mark.slow
def test_demo_story_passes_its_own_checks() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "mqds.tools.demo", "--devices", "4", "--readings", "600", "--batch", "20"],
        capture_output=True,
        text=True,
        timeout=300,  # the story, then a Spark job (a JVM start and a local session)
    )
    out = run.stdout
    assert run.returncode == 0, out + run.stderr
    assert "every one of the 16 vnodes has a leader" in out
    assert "dashboard read 4 hello messages" in out
    kill = re.search(r"kill -9 (n\d) \(pid \d+; mqds cluster kill n\d\), the leader of vnode (\d+)", out)
    assert kill, out
    victim, shard = kill.groups()
    elected = re.search(rf"vnode {shard}: (n\d) was elected leader ([\d.]+) s after the kill", out)
    assert elected and elected.group(1) != victim, out
    assert re.search(rf"writes to vnode {shard} waited at most [\d.]+ s after the kill", out), out
    assert "acknowledged 2,400  replayed 2,400  lost 0  duplicated 0  never acknowledged 0" in out
    assert "every replica of every vnode holds the same data" in out
    assert "OK: every acknowledged reading was replayed exactly once" in out
    leftover = subprocess.run(["pgrep", "-f", "mqds-demo-"], capture_output=True, text=True)
    assert leftover.stdout.strip() == ""
