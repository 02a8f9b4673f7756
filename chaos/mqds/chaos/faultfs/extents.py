"""Sets of byte ranges: which parts of a file were saved, written, or lost to a failed fsync.

:class:`Extents` keeps half-open ranges ``[start, end)`` sorted, merged and
non-empty; a file's records hold a handful of them, so lists are enough.

>>> e = Extents()
>>> e.add(0, 10); e.add(20, 30); e.add(10, 12)
>>> e.ranges()
[(0, 12), (20, 30)]
>>> e.missing(5, 25)
[(12, 20)]
>>> e.remove(8, 22); e.ranges()
[(0, 8), (22, 30)]
>>> e.clip(25); e.ranges(), e.total()
([(0, 8), (22, 25)], 11)
"""

from __future__ import annotations

from collections.abc import Iterator


class Extents:
    """A set of byte offsets, held as sorted, disjoint, non-adjacent ``[start, end)`` ranges."""

    def __init__(self, ranges: list[tuple[int, int]] | None = None) -> None:
        self._ranges: list[tuple[int, int]] = []
        for start, end in ranges or []:
            self.add(start, end)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(list(self._ranges))

    def __bool__(self) -> bool:
        return bool(self._ranges)

    def __repr__(self) -> str:
        return f"Extents({self._ranges!r})"

    def ranges(self) -> list[tuple[int, int]]:
        return list(self._ranges)

    def total(self) -> int:
        """How many bytes the set covers."""
        return sum(end - start for start, end in self._ranges)

    def clear(self) -> None:
        self._ranges = []

    def add(self, start: int, end: int) -> None:
        if end <= start:
            return
        out: list[tuple[int, int]] = []
        for s, e in self._ranges:
            if e < start or s > end:
                out.append((s, e))
            else:  # overlapping or adjacent: merge into the new range
                start, end = min(s, start), max(e, end)
        out.append((start, end))
        out.sort()
        self._ranges = out

    def remove(self, start: int, end: int) -> None:
        if end <= start:
            return
        out: list[tuple[int, int]] = []
        for s, e in self._ranges:
            if e <= start or s >= end:
                out.append((s, e))
                continue
            if s < start:
                out.append((s, start))
            if e > end:
                out.append((end, e))
        self._ranges = out

    def clip(self, size: int) -> None:
        """Forget everything at or past ``size``."""
        self.remove(size, max(size, self._ranges[-1][1]) if self._ranges else size)

    def missing(self, start: int, end: int) -> list[tuple[int, int]]:
        """The parts of ``[start, end)`` the set does not cover, in order."""
        out: list[tuple[int, int]] = []
        pos = start
        for s, e in self._ranges:
            if e <= pos:
                continue
            if s >= end:
                break
            if s > pos:
                out.append((pos, s))
            pos = max(pos, e)
            if pos >= end:
                break
        if pos < end:
            out.append((pos, end))
        return out

    def overlap(self, start: int, end: int) -> list[tuple[int, int]]:
        """The parts of ``[start, end)`` the set covers, in order."""
        return [(max(s, start), min(e, end)) for s, e in self._ranges if s < end and e > start]
