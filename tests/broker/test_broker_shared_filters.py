"""What `mqds broker` takes for a shared subscription, and the settings it refuses at start (no broker needed)."""

from __future__ import annotations

import pytest

from mqds.broker.amqtt.plugin import MqdsPlugin, check_shared_settings
from mqds.broker.amqtt.shared import SharedFilter, shared_filter


def test_shared_filters_are_taken_apart() -> None:
    assert shared_filter("$share/workers/jobs/#") == SharedFilter("workers", "jobs/#")
    assert shared_filter("$share/g/a/+/c") == SharedFilter("g", "a/+/c")
    assert shared_filter("$queue/jobs/+") == SharedFilter("$queue", "jobs/+")  # EMQX's group $queue
    assert shared_filter("jobs/#") is None
    assert shared_filter("$SYS/broker") is None


@pytest.mark.parametrize(
    ("subscription", "says"),
    [
        ("$share/g", "expected $share/<group>/<filter>"),
        ("$share//jobs/#", "share group name ''"),
        ("$share/g+/jobs", "share group name 'g+'"),
        ("$share/g/", "filter"),
        ("$share/g/a/#/b", "#"),
        ("$queue/", "filter"),
    ],
)
def test_a_malformed_shared_filter_is_refused_with_what_is_wrong(subscription: str, says: str) -> None:
    with pytest.raises(ValueError) as err:
        shared_filter(subscription)
    assert subscription in str(err.value) and says in str(err.value), str(err.value)


def test_shared_settings_out_of_bounds_stop_the_plugin_at_start() -> None:
    check_shared_settings(MqdsPlugin.Config())  # the defaults
    for bad, says in [
        ({"shared_poll_ms": 0}, "shared_poll_ms 0"),
        ({"shared_lease_s": 0}, "shared_lease_s 0"),
        ({"shared_lease_s": 3601}, "1 to 3600 seconds"),
    ]:
        with pytest.raises(ValueError, match=says):
            check_shared_settings(MqdsPlugin.Config(**bad))  # type: ignore[arg-type]
