"""Each file's latest ok row with its vectors, shard by shard: what export and search read.

A row that a later one supersedes, or one that failed, is never yielded, however many shards
still hold its tokens. Rows come shard after shard (by name), in stored order within a shard,
so each shard is read once, front to back, through npreader (numpy, no torch; bfloat16 widened
to float32 exactly). Memory holds one shard's offsets and the rows that name it, a window of
its pooled vectors, and one file's tokens: never the folder.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ..errors import UsageError
from .npreader import Rows, Shard

WINDOW = 1 << 12  # pooled rows read at once (stored rows between the wanted ones included)


@dataclass
class Record:
    """One exported row: a file, or with per_frame one sampled frame of a video (an image is frame 0)."""

    row: dict  # the file's manifest row
    frame: int | None  # per_frame: which sampled frame; else None
    pooled: (
        np.ndarray
    )  # (D,) float32: the stored pooled vector, or the mean of the tokens (per frame: the frame's)
    tokens: np.ndarray | None  # (n, D) float32, when asked for


def placed(emb: Rows) -> dict[str, np.ndarray]:
    """shard → manifest offsets of the latest ok rows stored in it (8 bytes a file)."""
    by_shard, _ = (
        emb.ledger.ok_by_shard()
    )  # an ok row naming no shard: verify reports it; nothing to read
    return by_shard


def hidden_size(emb: Rows, shards) -> int:
    """The stored width, from the first shard's header (0 for a folder with no tokens)."""
    for name in sorted(shards):
        header = _open(emb, name).header
        return header["tokens" if "tokens" in header else "pooled"]["shape"][
            1
        ]  # --store pooled: no tokens
    return 0


def records(emb: Rows, per_frame: bool = False, tokens: bool = False, shards=None) -> Iterator[Record]:
    """Every latest ok row's Record, shard after shard. `shards`: placed(emb), if already read."""
    shards = placed(emb) if shards is None else shards
    for name in sorted(shards):
        rows = sorted(emb.ledger.rows_at(shards[name].tolist()), key=lambda r: r["index"])
        shard = _open(emb, name)
        try:
            yield from shard_records(shard, rows, per_frame, tokens)
        finally:
            emb.out.drop(name)  # OUT in a store: the disk holds one shard at a time


def _open(emb: Rows, name: str) -> Shard:
    try:
        return Shard(emb.out.shard_path(name))
    except (OSError, ValueError) as e:
        raise UsageError(
            f"{emb.out.named(name)}: {getattr(e, 'strerror', None) or e}; "
            f"gemma4enc verify {emb.out} --repair encodes its files again"
        ) from None


def shard_records(shard: Shard, rows: list[dict], per_frame: bool, tokens: bool) -> Iterator[Record]:
    n = shard.header["item_offsets"]["shape"][0] - 1
    if rows and not 0 <= rows[0]["index"] <= rows[-1]["index"] < n:
        raise UsageError(
            f"{shard.path}: holds {n} files, the manifest names row {rows[-1]['index']}; "
            f"gemma4enc verify {shard.path.parent} --repair encodes them again"
        )
    items = shard.rows("item_offsets", 0, n + 1)
    item_frames = shard.rows("item_frames", 0, n + 1)
    frame_offsets = shard.rows("frame_offsets", 0, shard.header["frame_offsets"]["shape"][0])
    stored = "pooled" in shard
    if "tokens" not in shard:  # --store pooled
        if tokens:
            raise UsageError(
                f"{shard.path.parent} was encoded with --store pooled: it keeps no tokens to export "
                "(--to clip exports its pooled vectors)"
            )
        yield from _pooled_records(shard, rows, per_frame, item_frames)
        return
    block, start = None, 0
    for row in rows:
        i = row["index"]
        frames = per_frame and row["kind"] == "video"
        if stored and not frames and (block is None or i >= start + len(block)):
            start = i
            block = shard.rows("pooled", i, min(i + WINDOW, n))
        t = (
            shard.rows("tokens", int(items[i]), int(items[i + 1]))
            if tokens or frames or not stored
            else None
        )
        if frames:
            assert t is not None  # read whenever frames are asked for
            offsets = frame_offsets[item_frames[i] : item_frames[i + 1] + 1] - items[i]
            for f, (lo, hi) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
                yield Record(row, f, t[lo:hi].mean(0, dtype=np.float32), t[lo:hi] if tokens else None)
        else:
            if stored:
                assert block is not None  # read above for every row that is not a video's frames
                pooled = block[i - start]
            else:
                assert t is not None  # read where no pooled means are stored
                pooled = t.mean(0, dtype=np.float32)
            yield Record(row, 0 if per_frame else None, pooled, t if tokens else None)


def _pooled_records(
    shard: Shard, rows: list[dict], per_frame: bool, item_frames: np.ndarray
) -> Iterator[Record]:
    """A --store pooled shard's rows: the stored file means, or per frame the stored frame means."""
    n = len(item_frames) - 1
    block, start = None, 0
    for row in rows:
        i = row["index"]
        if per_frame and row["kind"] == "video":
            a, b = int(item_frames[i]), int(item_frames[i + 1])
            for f, vector in enumerate(shard.rows("frame_pooled", a, b)):
                yield Record(row, f, vector, None)
            continue
        if block is None or i >= start + len(block):
            start = i
            block = shard.rows("pooled", i, min(i + WINDOW, n))
        yield Record(row, 0 if per_frame else None, block[i - start], None)
