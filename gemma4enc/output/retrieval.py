"""Every file's pooled vector as one matrix, for nearest-neighbour search over an output folder.

Shards keep the rows of files that were encoded again later (the manifest's last row wins), so
the matrix takes, shard by shard, only the rows the manifest still points at, in windows of
`window` rows: memory holds the result and one window, never a shard's tokens.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch
from safetensors import safe_open


WINDOW = 1 << 16  # pooled rows read at once


def _windows(indices: list[int], window: int):
    """Sorted row indices → (start, stop, members) runs no longer than `window`."""
    run: list[int] = []
    for i in indices:
        if run and i - run[0] >= window:
            yield run[0], run[-1] + 1, run
            run = []
        run.append(i)
    if run:
        yield run[0], run[-1] + 1, run


def _token_means(f, index: int, per_frame: bool) -> torch.Tensor:
    """Float32 means of one file's tokens, each frame's or all, reading only its slice."""
    if "frame_pooled" in f.keys():  # --store pooled: the frames' means are stored (and so is the file's)
        a, b = f.get_slice("item_frames")[index : index + 2].tolist()
        return f.get_slice("frame_pooled")[a:b].float()
    lo, hi = f.get_slice("item_offsets")[index : index + 2].tolist()
    tokens = f.get_slice("tokens")[lo:hi].float()
    if not per_frame:
        return tokens.mean(0, keepdim=True)
    a, b = f.get_slice("item_frames")[index : index + 2].tolist()
    offsets = (f.get_slice("frame_offsets")[a : b + 1] - lo).tolist()
    return torch.stack([tokens[s:e].mean(0) for s, e in zip(offsets[:-1], offsets[1:])])


def _shard_rows(f, members: list[tuple[int, int, bool]], window: int):
    """(position, vector(s)) for the shard's wanted rows: stored pooled vectors, or frame means."""
    pooled = "pooled" in f.keys()
    stored = sorted((i, pos) for i, pos, frames in members if pooled and not frames)
    where = dict(stored)
    for start, stop, run in _windows([i for i, _ in stored], window):
        block = f.get_slice("pooled")[start:stop].float()
        for i in run:
            yield where[i], block[i - start : i - start + 1]
    for i, pos, frames in members:
        if frames or not pooled:  # per frame, or a folder written with --no-pooled
            yield pos, _token_means(f, i, frames)


def pooled_matrix(emb, per_frame: bool = False, window: int = WINDOW):
    """(keys, (N, D) float32): one row per file (its latest), in manifest order; with
    per_frame, one row per sampled video frame (keys (path, frame)), an image keeping one row."""
    keys: list = []  # paths, or (path, frame) with per_frame
    by_shard: defaultdict[str, list] = defaultdict(list)
    for path, row in emb.ok_rows():
        frames = per_frame and row["kind"] == "video"
        by_shard[row["shard"]].append((row["index"], len(keys), frames))
        keys += (
            [(path, k) for k in range(row["frames"])] if frames else [(path, 0) if per_frame else path]
        )
    matrix = None
    for shard, members in by_shard.items():
        with safe_open(str(emb.out.shard_path(shard)), framework="pt") as f:
            if matrix is None:
                matrix = np.empty(
                    (
                        len(keys),
                        f.get_slice("pooled" if "pooled" in f.keys() else "tokens").get_shape()[1],
                    ),
                    np.float32,
                )
            for pos, vectors in _shard_rows(f, members, window):
                matrix[pos : pos + len(vectors)] = vectors.numpy()
    return keys, matrix if matrix is not None else np.empty((0, 0), np.float32)
