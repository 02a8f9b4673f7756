"""Replaying the node's Raft log at start: every group's entries and state, and what each segment holds.

The segments are read in order and every record applied to its group
(:class:`Recovered`); each retained segment after the first starts with
every group's state, so what is left after older segments were dropped
still rebuilds every group. Replay also tells the log what it needs to know
which segments hold live entries (:class:`Replay`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mqds.server.raft.segments import (
    CLEAR,
    DROP,
    ENTRY,
    HEAD,
    STATE,
    TRUNCATE,
    Entry,
    decode_entry,
    decode_index,
    decode_state,
    entry_index,
    list_segments,
    read_segment,
    segment_number,
)


@dataclass
class Recovered:
    """One group as the log holds it: entries, term, commit index, vote and members."""

    entries: list[Entry] = field(default_factory=list)
    term: int = 0
    commit: int = 1
    voted_for: str | None = None
    members: list[str] | None = None

    def apply(self, kind: int, body: bytes) -> None:
        entries = self.entries
        if kind == ENTRY:
            entry = decode_entry(body)
            index = entry[1]
            while entries and entries[-1][1] >= index:
                entries.pop()
            entries.append(entry)
        elif kind == TRUNCATE:
            index = decode_index(body)
            while entries and entries[-1][1] >= index:
                entries.pop()
        elif kind == HEAD:
            index = decode_index(body)
            keep = next((i for i, e in enumerate(entries) if e[1] >= index), len(entries))
            del entries[:keep]
        elif kind == CLEAR:
            entries.clear()
        elif kind == STATE:
            self.term, self.commit, self.voted_for, members = decode_state(body)
            if members is not None:
                self.members = members
        else:
            raise ValueError(f"unknown record kind {kind}")


@dataclass
class Replay:
    """What replaying the log's segments found."""

    groups: dict[int, Recovered] = field(default_factory=dict)
    """Every group the log holds (dropped ones left out)."""
    segment_entries: dict[int, dict[int, int]] = field(default_factory=dict)
    """Per segment (by number), per group, the highest entry index written to it."""
    cleared_in: dict[int, int] = field(default_factory=dict)
    """Per group, the last segment with a CLEAR (or DROP) of it: its entries in earlier segments are dead."""


def replay(directory: str) -> Replay:
    """Read every segment in ``directory`` in order (cutting a torn record off the last one)."""
    result = Replay()
    groups = result.groups
    segments = list_segments(directory)
    for position, path in enumerate(segments):
        last = position == len(segments) - 1
        written: dict[int, int] = {}
        number = segment_number(path)
        for group, kind, body in read_segment(path, last):
            if kind == DROP:
                groups.pop(group, None)
                result.cleared_in[group] = number
            else:
                groups.setdefault(group, Recovered()).apply(kind, body)
                if kind == ENTRY:
                    written[group] = max(written.get(group, 0), entry_index(body))
                elif kind == CLEAR:
                    result.cleared_in[group] = number
        result.segment_entries[number] = written
    return result
