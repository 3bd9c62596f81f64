"""What a killed run leaves, made right before the next one: a torn last manifest line, temp files,
shards no row names, and rows whose shard went missing (superseded by `shard_lost` rows)."""

from __future__ import annotations

import os
from pathlib import Path

from ..rows import Row, Status
from .files import MANIFEST, SHARD_RE, TEMP_RE, append_rows
from .ledger import Ledger

LOST = Status.SHARD_LOST  # a row whose shard went missing or unreadable: always encoded again


def repair(out: Path, ledger: Ledger | None = None) -> list[str]:
    """Undo what a kill can leave: a torn last manifest line, temp files, shards no row names."""
    notes = []
    ledger = (
        ledger or Ledger(out)
    ).refresh()  # stops before a torn last line: ledger.end is where it starts
    manifest = out / MANIFEST
    if manifest.exists() and manifest.stat().st_size > ledger.end:
        with open(manifest, "rb+") as f:  # the next append must start on a line of its own
            f.truncate(ledger.end)
            os.fsync(f.fileno())
        notes.append("dropped a torn last line of the manifest (its file will be encoded again)")
    temps = [p for p in out.iterdir() if TEMP_RE.match(p.name)]
    for p in temps:
        p.unlink(missing_ok=True)
    notes += mark_lost(out, broken_shards(out, ledger), ledger)
    named = ledger.shards()  # shards only older rows name are dead too
    orphans = [p for p in out.iterdir() if SHARD_RE.match(p.name) and p.name not in named]
    for p in orphans:
        p.unlink(missing_ok=True)
    if temps or orphans:
        notes.append(
            f"removed {len(temps)} temp file(s) and {len(orphans)} shard(s) of an interrupted run"
        )
    return notes


def broken_shards(out: Path, ledger: Ledger) -> set[str]:
    """Shards that ok rows name but that are gone or whose header cannot be read (cheap: headers only)."""
    from safetensors import safe_open

    broken = set()
    for name in ledger.shards():  # only ok rows name a shard
        try:
            with safe_open(
                str(out / name), framework="numpy"
            ):  # not "pt": a no-op run never imports torch
                pass
        except Exception:  # noqa: BLE001 - missing, truncated, garbage: all mean its tokens are lost
            broken.add(name)
    return broken


def mark_lost(out: Path, shards: set[str], ledger: Ledger) -> list[str]:
    """Rows into these shards are superseded by LOST rows, before any new shard could take a name."""
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
    append_rows(out, rows)
    ledger.refresh()
    if not rows:
        return []
    return [
        f"{len(shards)} shard(s) missing or unreadable ({', '.join(sorted(shards)[:3])}): "
        f"their {len(rows)} file(s) are encoded again"
    ]
