"""The main job runs end to end and leaves nothing behind."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def test_demo_story_passes_its_own_checks() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "mqds.server.demo", "--devices", "4", "--readings", "300", "--batch", "100"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert "acknowledged 2,400  replayed 2,400  lost 0  duplicated 0" in out
    assert "replayed 1,200 temperature readings (expected 1,200)" in out
    assert "OK: nothing acknowledged was lost" in out
    leftover = subprocess.run(["pgrep", "-f", "mqds-demo-"], capture_output=True, text=True)
    assert leftover.stdout.strip() == ""
