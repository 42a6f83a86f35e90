"""Communication accounting: how many calls and bytes each collective kind sends on this rank.

Every collective of :mod:`stormshard.parallel.comm` (the one place that communicates, and that
computes the bytes) calls :func:`record_communication` with the number of bytes this rank
*sends* under a bandwidth-optimal algorithm:

- ``all_gather``: this rank's shard, once to each of the other ``w - 1`` ranks;
- ``all_reduce``: ``2 (w - 1) / w`` times the tensor (ring reduce-scatter + all-gather);
- ``reduce_scatter``: ``(w - 1) / w`` times the full (padded) tensor;
- ``all_to_all``: the rows addressed to other ranks (the row exchange: halos, head all-to-all);
- ``send``: the same rows, moved by point-to-point sends instead.

Use it as a context manager; counters nest, and each open counter sees every call::

    with CommCounter() as counter:
        y = gather_tensor(x, 0, shapes, group)
    counter.bytes("all_gather"), counter.calls("all_gather"), counter.total_bytes
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

__all__ = ["CommCounter", "CommRecord", "record_communication"]


@dataclass
class CommRecord:
    """Calls and bytes recorded for one collective kind."""

    calls: int = 0
    bytes: int = 0


_OPEN_COUNTERS: list[CommCounter] = []


class CommCounter:
    """Records, per collective kind, the calls and bytes this rank sends while it is open."""

    def __init__(self) -> None:
        self.records: dict[str, CommRecord] = defaultdict(CommRecord)

    def __enter__(self) -> CommCounter:
        _OPEN_COUNTERS.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _OPEN_COUNTERS.remove(self)

    def calls(self, kind: str | None = None) -> int:
        """Number of calls of ``kind`` (all kinds when None)."""
        if kind is None:
            return sum(r.calls for r in self.records.values())
        return self.records[kind].calls if kind in self.records else 0

    def bytes(self, kind: str | None = None) -> int:
        """Bytes sent by ``kind`` (all kinds when None)."""
        if kind is None:
            return sum(r.bytes for r in self.records.values())
        return self.records[kind].bytes if kind in self.records else 0

    @property
    def total_bytes(self) -> int:
        return self.bytes()

    def reset(self) -> None:
        self.records.clear()

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {k: {"calls": r.calls, "bytes": r.bytes} for k, r in sorted(self.records.items())}

    def __repr__(self) -> str:
        return f"CommCounter({self.as_dict()})"


def record_communication(kind: str, nbytes: int) -> None:
    """Report one call of ``kind`` that sent ``nbytes`` from this rank to every open counter."""
    for counter in _OPEN_COUNTERS:
        rec = counter.records[kind]
        rec.calls += 1
        rec.bytes += int(nbytes)
