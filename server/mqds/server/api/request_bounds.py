"""A request bounded where it is decoded: its bytes before it is parsed, its repeated fields right after.

gRPC calls a method's request deserializer for the request (and for each
message of a stream) before any handler code runs; an exception there is
answered INTERNAL ("Exception deserializing request!"), so a deserializer
here never raises: a request it refuses becomes a :class:`Refused` holding
the error, which the guard raises when the handler reads the request. That
way a request over its byte bound is never parsed, and one whose repeated
fields pass their limits (``methods.FIELD_LIMITS``) reaches no handler, so
nothing is built from fifty million ids before they are counted.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from google.protobuf import descriptor as pbd

from mqds.protocol import errors
from mqds.protocol.errors import MqdsError, Reason
from mqds.server.api.methods import Elsewhere, Limit, counted_fields


class Refused:
    """What a deserializer returns for a request it refuses: the error the call is answered with."""

    __slots__ = ("error",)

    def __init__(self, error: MqdsError) -> None:
        self.error = error


class WithRaw:
    """A parsed request and the bytes it was parsed from."""

    __slots__ = ("parsed", "raw")

    def __init__(self, parsed: Any, raw: bytes) -> None:
        self.parsed = parsed
        self.raw = raw


def malformed(type_name: str, err: Exception) -> Refused:
    return Refused(
        errors.error(
            Reason.MALFORMED_REQUEST,
            f"request is not a valid {type_name} ({err}); string fields such as topics must be valid UTF-8",
        )
    )


def check_parsed(request: Any) -> Any:
    """The request a deserializer produced; raises the error of one it refused."""
    if isinstance(request, Refused):
        raise request.error
    return request


class FieldBounds:
    """The field limits of one request type, compiled: which fields to count, which messages to look into."""

    def __init__(self, steps: list[tuple[str, int | None, Limit | None, FieldBounds | None, bool]]) -> None:
        self._steps = steps

    @classmethod
    def of(cls, descriptor: pbd.Descriptor, limits: Mapping[str, Limit | Elsewhere], config: Any) -> FieldBounds | None:
        """The bounds of ``descriptor`` (None when nothing in it is counted). A repeated field without an entry
        in ``limits`` is a KeyError: the table must name every one (``tests/server/api/test_methods.py``)."""
        return _compile(descriptor, limits, config, {})

    def check(self, message: Any, where: str = "") -> None:
        """Raise the limit's error for the first repeated field of ``message`` (or within it) over its limit."""
        for name, most, limit, nested, repeated in self._steps:
            value = getattr(message, name)
            if most is not None and len(value) > most:
                assert limit is not None
                raise errors.error(
                    limit.reason,
                    f"{where}{message.DESCRIPTOR.name}.{name} holds {len(value):,} entries; at most {most:,} "
                    f"({limit.name})",
                )
            if nested is None:
                continue
            if repeated:
                for index, item in enumerate(value):
                    nested.check(item, f"{where}{message.DESCRIPTOR.name}.{name}[{index}]: ")
            elif message.HasField(name):
                nested.check(value, f"{where}{message.DESCRIPTOR.name}.{name}: ")


def _compile(
    descriptor: pbd.Descriptor,
    limits: Mapping[str, Limit | Elsewhere],
    config: Any,
    memo: dict[str, FieldBounds | None],
) -> FieldBounds | None:
    if descriptor.full_name in memo:
        return memo[descriptor.full_name]
    memo[descriptor.full_name] = None  # a type that holds itself is looked into once
    steps: list[tuple[str, int | None, Limit | None, FieldBounds | None, bool]] = []
    counted = {field.name for field in counted_fields(descriptor)}
    for field in descriptor.fields:
        nested_type = field.message_type
        is_map = nested_type is not None and nested_type.GetOptions().map_entry
        nested = None
        if nested_type is not None and not is_map:
            nested = _compile(nested_type, limits, config, memo)
        if field.name in counted:
            entry = limits[f"{descriptor.full_name}.{field.name}"]
            if isinstance(entry, Elsewhere):
                continue  # bounded by the check the entry names; its elements too
            steps.append((field.name, entry.most(config), entry, nested, True))
        elif nested is not None:
            steps.append((field.name, None, None, nested, False))
    bounds = FieldBounds(steps) if steps else None
    memo[descriptor.full_name] = bounds
    return bounds


def bounded_parser(
    inner: Callable[[bytes], Any] | None,
    type_name: str,
    max_bytes: int,
    bound_name: str,
    fields: FieldBounds | None,
) -> Callable[[bytes], Any]:
    """A deserializer: ``inner``'s (None: the bytes as they are) within ``max_bytes`` and ``fields``; never raises."""

    def parse(raw: bytes) -> Any:
        if len(raw) > max_bytes:
            return Refused(
                errors.error(
                    Reason.INVALID_REQUEST,
                    f"request {type_name} is {len(raw):,} bytes, over the node's limit of {max_bytes:,} "
                    f"({bound_name}); split it into smaller calls",
                )
            )
        if inner is None:
            return raw
        try:
            value = inner(raw)
        except Exception as err:  # DecodeError, or a RuntimeError from upb
            return malformed(type_name, err)
        if fields is not None and not isinstance(value, Refused):
            try:
                fields.check(value.parsed if isinstance(value, WithRaw) else value)
            except MqdsError as err:
                return Refused(err)
        return value

    return parse
