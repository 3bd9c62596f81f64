"""Rows whose shard went missing or unreadable, superseded by `shard_lost` rows (their files are
encoded again): by a run's repair (Out.repair, which also cuts what a kill leaves) and by
`verify --repair`."""

from __future__ import annotations

from ..rows import Row, Status
from .ledger import Ledger

LOST = Status.SHARD_LOST  # a row whose shard went missing or unreadable: always encoded again


def mark_lost(out, shards: set[str], ledger: Ledger) -> list[str]:
    """Rows into these shards are superseded by LOST rows, before any new shard could take a name.
    They are appended here; a store sends them with its next append (or `sync()`)."""
    if not shards:
        return []
    offsets = [e.offset for _, e in ledger.entries() if e.status == Status.OK and e.shard in shards]
    rows = [
        Row.from_json(r).replace(
            status=LOST,
            shard=None,
            index=None,
            tokens=0,
            frames=0,
            error=f"its shard {r['shard']} was missing or unreadable; the next run encodes it again",
        )
        for r in ledger.rows_at(offsets)
    ]
    out.append(rows, later=True)
    ledger.refresh()
    if not rows:
        return []
    return [
        f"{len(shards)} shard(s) missing or unreadable ({', '.join(sorted(shards)[:3])}): "
        f"their {len(rows)} file(s) are encoded again"
    ]
