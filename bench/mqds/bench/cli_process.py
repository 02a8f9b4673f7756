"""An ``mqds`` command run as a child process by a benchmark: started, waited for, its output, stopped."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

from mqds.cli.console import CommandError


class CliProcess:
    """``mqds ARGS`` in a child process, its output in ``log``; ready once its output matches ``ready``."""

    def __init__(self, args: list[str], log: Path, ready: str, what: str, timeout_s: float = 60) -> None:
        self.log = log
        command = [sys.executable, "-c", "import sys; from mqds.cli import main; sys.exit(main())", *args]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while not (found := re.search(ready, self.output())):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise CommandError(f"{what} did not start:\n{self.output()}")
            time.sleep(0.1)
        self.ready: re.Match[str] = found
        """The match of ``ready`` in the output (its groups: what the process printed, e.g. its address)."""

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
