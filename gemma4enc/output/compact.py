"""The manifest rewritten with one row per file (the latest), and shards rewritten without pruned tokens;
run by `compact`, and by a run itself once superseded rows outnumber the live ones (Out.finish)."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import UsageError
from ..media.sources import exists
from .files import atomic_write, bounded_lines, line_of, own_opener
from .ledger import Ledger
from .names import LOCAL_NAME, not_an_output


def compact(out, ledger: Ledger | None = None, prune: bool = False) -> dict:
    """Rewrite OUT's manifest (`out`: an Out, out.py) with each file's latest row only; with prune,
    only files that still exist.

    Call under the lock, through `Out.compact`, which makes the result OUT's and removes the shards
    no row names any more. Pruned files' tokens go too: each shard holding one is copied without
    it under a new name first, then the manifest is replaced (temp, fsync, rename), then the old
    shards are removed. A kill at any point leaves a valid folder (at worst unnamed shards, which
    the next run clears).
    """
    ledger = (ledger if ledger is not None else out.ledger(read=False)).refresh()
    if not ledger.path.exists():
        raise UsageError(not_an_output(out.url))
    gone = {ledger.entry(p).offset: p for p in ledger if not exists(p)} if prune else {}
    moved, replaced = (
        _rewrite_shards(out, ledger, gone) if gone else ({}, [])
    )  # before the manifest: see above
    live = ledger.live_offsets()

    def write(tmp: Path) -> None:
        with open(ledger.path, "rb", opener=own_opener) as src, open(tmp, "wb") as dst:
            offset, at = 0, 0
            for line, size, _ in bounded_lines(src):  # a line past LINE_MAX is no live row
                if offset >= ledger.end:
                    break  # a torn tail; under the lock nothing else is appended
                if at < len(live) and offset == live[at]:
                    at += 1
                    if offset in moved:
                        dst.write(line_of(json.loads(line) | moved[offset]))
                    elif offset not in gone:
                        dst.write(line)
                offset += size

    before = ledger.lines
    atomic_write(ledger.path, write)
    tokens = sum(ledger.entry(p).tokens for p in gone.values())
    ledger.refresh()  # the manifest is a new file now: read anew
    return {
        "out": out.url,
        "rows_before": before,
        "rows_after": len(ledger),
        "pruned": len(gone),
        "pruned_tokens": tokens,
        "shards_rewritten": len(replaced),
    }


def _rewrite_shards(
    out, ledger: Ledger, gone: dict[int, str]
) -> tuple[dict[int, dict], list[str]]:
    """Copy every shard that holds a pruned file without it; (offset → new shard/index, old shard names)."""
    by_shard: dict[str, list[tuple[int, int]]] = {}
    for _, e in ledger.entries():
        if e.shard and e.index >= 0:
            by_shard.setdefault(e.shard, []).append((e.index, e.offset))
    hit = sorted({s for p in gone.values() if (s := ledger.entry(p).shard)} & set(by_shard))
    moved: dict[int, dict] = {}
    number = out.next_shard()
    for name in hit:
        kept = sorted((i, off) for i, off in by_shard[name] if off not in gone)
        if kept:
            new = LOCAL_NAME.format(number)
            number += 1
            with out.shard(name) as path:
                rewrite_shard(path, [i for i, _ in kept], out.folder / new)
            out.publish(out.folder / new)  # a store's uploaded before the manifest names it
            moved.update({off: {"shard": new, "index": j} for j, (_, off) in enumerate(kept)})
    return moved, hit


def rewrite_shard(src: Path, keep: list[int], dst: Path) -> None:
    """A copy of shard `src` holding only its items `keep` (in that order), written atomically to `dst`."""
    import torch  # only a pruning compaction needs it
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src), framework="pt") as f:
        meta = f.metadata()
        t = {k: f.get_tensor(k) for k in f.keys()}
    items, frames, item_frames = t["item_offsets"], t["frame_offsets"], t["item_frames"]
    tokens, frame_sizes, item_sizes, frame_counts = [], [0], [0], [0]
    kept = (
        "tokens" if "tokens" in t else "frame_pooled"
    )  # --store pooled: a row per frame, not per token
    for i in keep:
        a, b = item_frames[i].item(), item_frames[i + 1].item()
        tokens.append(
            t["tokens"][items[i] : items[i + 1]] if kept == "tokens" else t["frame_pooled"][a:b]
        )
        frame_sizes += (frames[a + 1 : b + 1] - frames[a:b]).tolist()
        item_sizes.append((items[i + 1] - items[i]).item())
        frame_counts.append(b - a)
    tensors = {
        kept: torch.cat(tokens),
        "item_offsets": torch.tensor(item_sizes).cumsum(0),
        "frame_offsets": torch.tensor(frame_sizes).cumsum(0),
        "item_frames": torch.tensor(frame_counts).cumsum(0),
    }
    if "pooled" in t:
        tensors["pooled"] = t["pooled"][keep].contiguous()
    atomic_write(dst, lambda tmp: save_file(tensors, str(tmp), metadata=meta))
