"""Snapshots of a cluster: per vnode, the fence to read up to, and the generations that existed then.

A vnode's fence is the last timestamp it assigned. Timestamps only grow, so
reading a vnode up to its fence returns the same messages from any replica
that has applied that far, today or tomorrow, while writers keep writing:
a consistent snapshot of the vnode. A :class:`Snapshot` holds one fence per
vnode, and its token (JSON text, meant to be read by people too) lets a
later read return exactly the same rows. The generations are kept with their
time ranges, so a read can tell which of them retention dropped since.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from mqds.client import Client, ConnectionSettings, Fence

TOKEN_VERSION = 1
_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)


def _iso(timestamp_us: int) -> str:
    when = _EPOCH + datetime.timedelta(microseconds=timestamp_us)
    return when.isoformat(timespec="microseconds").replace("+00:00", "Z")


@dataclass(frozen=True)
class GenerationRange:
    """A generation of a vnode and its time range ``[since_us, until_us)``; ``until_us`` None while current."""

    generation: int
    since_us: int
    until_us: int | None

    def overlaps(self, lo_us: int, hi_us: int) -> bool:
        """Whether the generation may hold timestamps in ``[lo_us, hi_us]``."""
        return self.since_us <= hi_us and (self.until_us is None or self.until_us > lo_us)


@dataclass(frozen=True)
class VnodeFence:
    """One vnode of a snapshot: read it up to ``fence_us`` (0: it had stored nothing)."""

    shard: int
    fence_us: int
    generations: tuple[GenerationRange, ...]


@dataclass(frozen=True)
class Snapshot:
    """A consistent snapshot of every vnode of a cluster; :meth:`to_token` / :meth:`from_token` carry it."""

    pinned_at_us: int
    vnodes: tuple[VnodeFence, ...]

    @classmethod
    def from_fences(cls, fences: Iterable[Fence], pinned_at_us: int) -> Snapshot:
        vnodes = tuple(
            VnodeFence(
                f.shard,
                f.timestamp_us,
                tuple(GenerationRange(g.generation, g.since_us, g.until_us) for g in f.generations),
            )
            for f in sorted(fences, key=lambda f: f.shard)
        )
        return cls(pinned_at_us, vnodes)

    def fence(self, shard: int) -> VnodeFence | None:
        return next((v for v in self.vnodes if v.shard == shard), None)

    def to_token(self) -> str:
        """JSON text: the pin time, and per vnode its fence (microseconds, and as a UTC time) and generations."""
        body = {
            "mqds_snapshot": TOKEN_VERSION,
            "pinned_at": _iso(self.pinned_at_us),
            "vnodes": {
                str(v.shard): {
                    "fence_us": v.fence_us,
                    "fence": _iso(v.fence_us) if v.fence_us else None,
                    "generations": [[g.generation, g.since_us, g.until_us] for g in v.generations],
                }
                for v in self.vnodes
            },
        }
        return json.dumps(body, separators=(",", ":"))

    @classmethod
    def from_token(cls, token: str) -> Snapshot:
        """Parse a token made by :meth:`to_token`; ValueError says what is wrong with a bad one."""
        hint = "pass the text mqds.spark.pin_snapshot() returned, unchanged"
        try:
            body = json.loads(token)
        except ValueError as err:
            raise ValueError(f"not a snapshot token (not JSON: {err}); {hint}") from None
        if not isinstance(body, dict) or body.get("mqds_snapshot") != TOKEN_VERSION:
            raise ValueError(f'not a snapshot token (no "mqds_snapshot": {TOKEN_VERSION}); {hint}')
        vnodes_raw = body.get("vnodes")
        if not isinstance(vnodes_raw, dict) or not vnodes_raw:
            raise ValueError(f"snapshot token without vnodes; {hint}")
        try:
            pinned = body.get("pinned_at")
            pinned_at_us = (
                (datetime.datetime.fromisoformat(pinned) - _EPOCH) // datetime.timedelta(microseconds=1)
                if isinstance(pinned, str)
                else 0
            )
            vnodes = []
            for key, raw in vnodes_raw.items():
                fence_us = raw["fence_us"]
                if not str(key).isdigit() or not isinstance(fence_us, int) or fence_us < 0:
                    raise ValueError(f"vnode {key!r}")
                generations = tuple(_generation(item) for item in raw["generations"])
                vnodes.append(VnodeFence(int(key), fence_us, generations))
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"malformed snapshot token ({type(err).__name__}: {err}); {hint}") from None
        return cls(pinned_at_us, tuple(sorted(vnodes, key=lambda v: v.shard)))


def _generation(item: Sequence[object]) -> GenerationRange:
    number, since, until = item
    if not isinstance(number, int) or not isinstance(since, int) or not (until is None or isinstance(until, int)):
        raise ValueError(f"generation {item!r}")
    return GenerationRange(number, since, until)


def pin(client: Client) -> Snapshot:
    """Ask every vnode's leader for its fence now: the snapshot a read or a token pins."""
    fences = client.get_fences()
    now_us = int(datetime.datetime.now(datetime.UTC).timestamp() * 1_000_000)
    return Snapshot.from_fences(fences, now_us)


def pin_snapshot(
    endpoints: str | Sequence[str], *, settings: ConnectionSettings | None = None, timeout_s: float | None = None
) -> str:
    """Pin a consistent snapshot of the cluster at ``endpoints`` and return its token (JSON text).

    Reads with ``.option("snapshot", token)`` return exactly the messages
    stored up to the fences, however many times they run and whatever is
    written meanwhile (until retention drops a generation they cover).
    """
    with Client(endpoints, settings=settings, timeout_s=timeout_s) as client:
        return pin(client).to_token()
