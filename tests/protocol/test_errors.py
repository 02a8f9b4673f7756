"""The error table: every reason has a code, a retry rule and a client class, and survives the wire."""

from __future__ import annotations

import grpc
import pytest
from grpc_status import rpc_status

from mqds.client import errors as client_errors
from mqds.protocol import errors
from mqds.protocol.errors import REASONS, MqdsError, Reason


def test_table_is_complete() -> None:
    assert set(REASONS) == set(Reason)
    for reason, info in REASONS.items():
        assert issubclass(info.error_class, MqdsError), reason
        assert isinstance(info.code, grpc.StatusCode)
        # Only transport-level conditions are worth retrying.
        if info.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND):
            assert not info.retriable, reason
    assert client_errors.REASONS is REASONS


class _FakeCall(grpc.RpcError):
    """What a failed call looks like to a client: code, details and trailing metadata."""

    def __init__(self, status: grpc.Status | None, code: grpc.StatusCode, details: str) -> None:
        self._status = status
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self):  # type: ignore[no-untyped-def]
        return self._status.trailing_metadata if self._status else ()


@pytest.mark.parametrize("reason", list(Reason))
def test_every_reason_round_trips_through_a_status(reason: Reason) -> None:
    err = errors.error(reason, f"what went wrong with {reason.value}", leader="n2")
    status = errors.to_status(err)
    assert status.code == REASONS[reason].code
    back = errors.from_rpc_error(_FakeCall(status, status.code, status.details))
    assert type(back) is REASONS[reason].error_class
    assert back.reason is reason
    assert back.message == err.message
    assert back.metadata == {"leader": "n2"}
    assert back.retriable == REASONS[reason].retriable


def test_status_without_error_info_is_classified_by_code() -> None:
    back = errors.from_rpc_error(_FakeCall(None, grpc.StatusCode.UNAVAILABLE, "connection refused"))
    assert isinstance(back, errors.UnavailableError) and back.retriable
    back = errors.from_rpc_error(_FakeCall(None, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
    assert isinstance(back, TimeoutError) and back.retriable
    back = errors.from_rpc_error(_FakeCall(None, grpc.StatusCode.UNKNOWN, "boom"))
    assert back.reason is Reason.INTERNAL and not back.retriable


def test_errors_are_also_builtin_kinds() -> None:
    assert isinstance(errors.error(Reason.INVALID_TOPIC, "x"), ValueError)
    assert isinstance(errors.error(Reason.GENERATION_DROPPED, "x"), LookupError)
    assert str(errors.error(Reason.INVALID_TOPIC, "bad topic")) == "INVALID_TOPIC: bad topic"


def test_rpc_status_helper_agrees() -> None:
    status = errors.to_status(errors.error(Reason.UNKNOWN_SHARD, "shard 99"))
    parsed = rpc_status.from_call(_FakeCall(status, status.code, status.details))
    assert parsed is not None and parsed.message == "shard 99"
