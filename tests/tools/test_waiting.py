"""The harness's bounded wait: its TimeoutError says why the condition was still false at the end."""

from __future__ import annotations

import pytest

from mqds.tools.waiting import wait_until


def test_a_timeout_names_the_last_checks_error_not_an_earlier_one() -> None:
    # The chaos runner's readiness wait reported an error of an early check as the reason
    # for two minutes of waiting, though every later check had answered (and said "not yet").
    calls = []

    def check() -> bool:
        calls.append(1)
        if len(calls) == 1:
            raise OSError("early failure")
        return False

    with pytest.raises(TimeoutError) as err:
        wait_until("something", check, timeout_s=0.2, interval_s=0.01)
    assert len(calls) > 2
    assert "early failure" not in str(err.value)


def test_a_timeout_names_the_error_of_the_last_check() -> None:
    def check() -> bool:
        raise OSError("still failing")

    with pytest.raises(TimeoutError, match="still failing"):
        wait_until("something", check, timeout_s=0.1, interval_s=0.01)
