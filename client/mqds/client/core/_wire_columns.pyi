# The C extension's signatures (_wire_columns.c); mqds.client.core.wire_columns documents them.
from _typeshed import ReadableBuffer

def envelope(answer: ReadableBuffer, /) -> tuple[int, bytes, bool, bytes, int]: ...
def columns(
    answers: list[bytes], want: int, /
) -> tuple[
    int,
    bytes | None,
    bytes | None,
    bytes | None,
    bytes | None,
    bytes | None,
    bytes | None,
    bytes | None,
    bytes | None,
    bytes | None,
    bytes | None,
    bytes | None,
    bytes | None,
    bytes | None,
    bytes | None,
    int,
]: ...
