"""``mqds retention set``'s arguments: periods and FILTER=PERIOD rules, and refusals that name what was wrong."""

from __future__ import annotations

import pytest

from mqds.protocol.retention import RetentionError, format_period, parse_period, parse_rule


@pytest.mark.parametrize(("text", "seconds"), [("90s", 90), ("12h", 43_200), ("1d12h", 129_600), ("keep", 0)])
def test_periods_read_as_seconds_and_back(text: str, seconds: int) -> None:
    assert parse_period(text) == seconds
    assert parse_period(format_period(seconds)) == seconds


def test_a_rule_is_a_filter_and_a_period() -> None:
    assert parse_rule("telemetry/#=1d") == ("telemetry/#", 86_400)
    assert parse_rule("a=b/c=2h") == ("a=b/c", 7_200)  # the last '=' splits


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("telemetry/#=soon", "is not a period"),
        ("telemetry/#=0s", "at least 1s"),
        ("a/#/b=1d", "'#'"),
        ("telemetry/#", "is not a rule"),
    ],
)
def test_a_bad_rule_is_refused_naming_the_rule(text: str, why: str) -> None:
    with pytest.raises(RetentionError) as refused:
        parse_rule(text)
    assert repr(text) in str(refused.value), "the refusal names the rule as written"
    assert why in str(refused.value)
