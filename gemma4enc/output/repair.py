"""What a killed run leaves in a folder, made right before the next one: a torn last manifest line,
temp files, shards no row names, and rows whose shard went missing (superseded by `shard_lost` rows).
A store's own repair is StoreOut.repair; both mark lost rows with `mark_lost`."""

from __future__ import annotations

import os

from ..rows import Row, Status
from .files import own_opener
from .ledger import Ledger
from .names import TEMP_RE, unnamed_shards

LOST = Status.SHARD_LOST  # a row whose shard went missing or unreadable: always encoded again


def repair(out, ledger: Ledger | None = None) -> list[str]:
    """Undo what a kill can leave in a folder OUT (`out`: an Out, out.py): a torn last manifest line,
    temp files, shards no row names."""
    folder = out.folder
    notes = []
    ledger = (ledger or Ledger(folder)).refresh()  # stops before a torn last line: ledger.end is where it starts
    manifest = ledger.path
    if manifest.exists() and manifest.stat().st_size > ledger.end:
        with open(manifest, "rb+", opener=own_opener) as f:  # the next append must start on a line of its own
            f.truncate(ledger.end)
            os.fsync(f.fileno())
        notes.append("dropped a torn last line of the manifest (its file will be encoded again)")
    temps = [p for p in folder.iterdir() if TEMP_RE.match(p.name)]
    for p in temps:
        p.unlink(missing_ok=True)
    notes += mark_lost(out, broken_shards(out, ledger), ledger)
    named = ledger.shards()  # shards only older rows name are dead too
    orphans = [folder / n for n in unnamed_shards((p.name for p in folder.iterdir()), named)]
    for p in orphans:
        p.unlink(missing_ok=True)
    if temps or orphans:
        notes.append(
            f"removed {len(temps)} temp file(s) and {len(orphans)} shard(s) of an interrupted run"
        )
    return notes


def broken_shards(out, ledger: Ledger) -> set[str]:
    """Shards that ok rows name but that are gone or whose header cannot be read (cheap: headers only)."""
    from safetensors import safe_open

    broken = set()
    for name in ledger.shards():  # only ok rows name a shard
        try:
            with safe_open(str(out.folder / name), framework="numpy"):  # not "pt": a no-op run never imports torch
                pass
        except Exception:  # noqa: BLE001 - missing, truncated, garbage: all mean its tokens are lost
            broken.add(name)
    return broken


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
