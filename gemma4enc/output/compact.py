"""The manifest rewritten with one row per file (the latest), and shards rewritten without pruned tokens;
run by `compact`, and by a run itself once superseded rows outnumber the live ones."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import UsageError
from ..media.sources import exists
from .files import MANIFEST, SHARD_RE, atomic_write, line_of, not_an_output
from .ledger import Ledger
from .mirror import shard_file

# a run compacts the manifest when superseded rows pass this many and outnumber the live ones:
# then the rewrite costs no more than the rows appended since the last one
AUTO_COMPACT_ROWS = 100_000


def maybe_compact(out: Path, ledger: Ledger) -> str | None:
    """Compact once the manifest is mostly superseded rows (call under the lock, at the end of a run)."""
    dead = ledger.superseded + ledger.unreadable
    if dead < max(AUTO_COMPACT_ROWS, len(ledger)):
        return None
    report = compact(out, ledger)
    return f"compacted {MANIFEST}: {report['rows_before']} rows → {report['rows_after']}"


def compact(out: Path, ledger: Ledger | None = None, prune: bool = False) -> dict:
    """Rewrite the manifest with each file's latest row only; with prune, only files that still exist.

    Call under the lock. Pruned files' tokens go too: each shard holding one is copied without
    it under a new name first, then the manifest is replaced (temp, fsync, rename), then the old
    shards are removed. A kill at any point leaves a valid folder (at worst unnamed shards, which
    the next run clears).
    """
    out = Path(out)
    ledger = (ledger or Ledger(out)).refresh()
    if not ledger.path.exists():
        raise UsageError(not_an_output(out))
    gone = {ledger.get(p).offset: p for p in ledger if not exists(p)} if prune else {}
    moved, replaced = (
        _rewrite_shards(out, ledger, gone) if gone else ({}, [])
    )  # before the manifest: see above
    live = ledger.live_offsets()

    def write(tmp: Path) -> None:
        with open(ledger.path, "rb") as src, open(tmp, "wb") as dst:
            offset, at = 0, 0
            for line in src:
                if offset >= ledger.end:
                    break  # a torn tail; under the lock nothing else is appended
                if at < len(live) and offset == live[at]:
                    at += 1
                    if offset in moved:
                        dst.write(line_of(json.loads(line) | moved[offset]))
                    elif offset not in gone:
                        dst.write(line)
                offset += len(line)

    before = ledger.lines
    atomic_write(ledger.path, write)
    tokens = sum(ledger.get(p).tokens for p in gone.values())
    ledger.refresh()  # the manifest is a new file now: read anew
    named = ledger.shards()
    for p in out.iterdir():  # the shards pruned files left, and those only superseded rows named
        if SHARD_RE.match(p.name) and p.name not in named:
            p.unlink(missing_ok=True)
    return {
        "out": str(out),
        "rows_before": before,
        "rows_after": len(ledger),
        "pruned": len(gone),
        "pruned_tokens": tokens,
        "shards_rewritten": len(replaced),
    }


def _rewrite_shards(
    out: Path, ledger: Ledger, gone: dict[int, str]
) -> tuple[dict[int, dict], list[str]]:
    """Copy every shard that holds a pruned file without it; (offset → new shard/index, old shard names)."""
    from .shards import LOCAL_NAME, next_shard_number, rewrite_shard

    by_shard: dict[str, list[tuple[int, int]]] = {}
    for _, e in ledger.entries():
        if e.shard and e.index >= 0:
            by_shard.setdefault(e.shard, []).append((e.index, e.offset))
    hit = sorted({ledger.get(p).shard for p in gone.values()} & set(by_shard))
    moved, number = {}, next_shard_number(out)
    for name in hit:
        kept = sorted((i, off) for i, off in by_shard[name] if off not in gone)
        if kept:
            new = LOCAL_NAME.format(number)
            number += 1
            rewrite_shard(shard_file(out, name), [i for i, _ in kept], out / new)
            moved.update({off: {"shard": new, "index": j} for j, (_, off) in enumerate(kept)})
    return moved, hit
