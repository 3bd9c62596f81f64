"""The stages wired together: decode → patchify → plan → tower → write, one window at a time.

Files are taken in their sorted order in windows of a few batches' worth of patches; each
window is decoded, planned and encoded, then its files are handed to the shard writer in
order. Host memory stays bounded by the window whatever the folder's size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .decode import DecodeError, Frames, decode
from .discover import Item
from .options import Options
from .patches import Patches, patchify
from .plan import Unit, batches
from .shards import ShardWriter


@dataclass
class Summary:
    files: int = 0
    ok: int = 0
    failed: int = 0
    frames: int = 0
    patches: int = 0
    tokens: int = 0
    seconds: float = 0.0
    by_status: dict[str, int] = field(default_factory=dict)

    def count(self, status: str) -> None:
        self.files += 1
        self.by_status[status] = self.by_status.get(status, 0) + 1
        if status == "ok":
            self.ok += 1
        else:
            self.failed += 1


class Progress:
    """What the pipeline tells the outside world; the CLI puts a bar or lines behind it."""

    def advance(self, files: int, patches: int) -> None:
        pass


@dataclass
class Decoded:
    item: Item
    frames: Frames | None = None
    patches: list[Patches] = field(default_factory=list)
    error: DecodeError | None = None


def prepare(item: Item, options: Options) -> Decoded:
    """Decode + patchify one file; any failure is caught and kept with the file."""
    if item.error:
        status = "not_found" if "not found" in item.error or "symlink" in item.error else "unreadable"
        return Decoded(item, error=DecodeError(status, item.error))
    if item.kind == "unknown":
        return Decoded(item, error=DecodeError("unsupported", "not an image or video format we know"))
    if item.size == 0:
        return Decoded(item, error=DecodeError("empty", "the file is empty (0 bytes)"))
    try:
        frames = decode(item.path, item.kind, options.sampling, options.video_backend, options.max_image_pixels)
        budget = options.image_tokens if item.kind == "image" else options.video_tokens
        return Decoded(item, frames, [patchify(image, budget) for image in frames.images])
    except DecodeError as e:
        return Decoded(item, error=e)
    except FileNotFoundError:
        return Decoded(item, error=DecodeError("not_found", "the file vanished before it was decoded"))
    except Exception as e:  # noqa: BLE001 - a decoder's surprise must cost one file, not the run
        return Decoded(item, error=DecodeError("decode_error", f"{type(e).__name__}: {str(e)[:300]}"))


def base_row(item: Item) -> dict:
    return {"path": item.path, "kind": item.kind, "size": item.size, "mtime_ns": item.mtime_ns}


def ok_row(d: Decoded, frames: list[torch.Tensor]) -> dict:
    info, first = d.frames.info, d.frames.images[0]
    height, width = first.shape[:2] if isinstance(first, np.ndarray) else (first.height, first.width)
    row = base_row(d.item) | {
        "status": "ok", "error": None, "shard": None, "index": None,
        "tokens": sum(f.shape[0] for f in frames), "frames": len(frames),
        "frame_tokens": [f.shape[0] for f in frames], "width": int(width), "height": int(height),
    }
    if d.item.kind == "video":
        row |= {"frame_indices": d.frames.indices, "timestamps": d.frames.timestamps,
                **{k: info[k] for k in ("fps", "duration", "total_frames", "backend") if k in info}}
    return row


def failed_row(item: Item, status: str, message: str) -> dict:
    return base_row(item) | {"status": status, "error": message, "shard": None, "index": None,
                             "tokens": 0, "frames": 0}


class Encoder:
    """Runs planned batches through the tower; halves a batch on out-of-memory."""

    def __init__(self, tower, mode: str, max_patches: int):
        self.tower, self.mode, self.max_patches = tower, mode, max_patches

    def run(self, units: list[Unit]) -> tuple[dict[tuple[int, int], torch.Tensor], dict[int, str]]:
        """(file, frame) → tokens, and file → error for units that failed even alone."""
        out: dict[tuple[int, int], torch.Tensor] = {}
        failed: dict[int, str] = {}
        for batch in batches(units, self.mode, self.max_patches):
            self._encode(batch, out, failed)
        return out, failed

    def _encode(self, batch: list[Unit], out, failed) -> None:
        try:
            tokens = self.tower.encode([u.patches for u in batch], pack=self.mode == "pack")
        except torch.OutOfMemoryError:
            if self.tower.device.type == "cuda":
                torch.cuda.empty_cache()
            if len(batch) == 1:
                u = batch[0]
                failed[u.file] = f"out of memory encoding {u.patches.n} patches alone"
                return
            half = len(batch) // 2
            self.max_patches = max(1, sum(u.patches.n for u in batch[:half]))  # remember the lesson
            self._encode(batch[:half], out, failed)
            self._encode(batch[half:], out, failed)
            return
        for u, t in zip(batch, tokens):
            out[(u.file, u.frame)] = t


def run(items: list[Item], tower, options: Options, writer: ShardWriter, mode: str, max_patches: int,
        progress: Progress | None = None, window_patches: int | None = None) -> Summary:
    """Encode every item; rows and shards go to `writer`. Returns counts for the summary."""
    progress = progress or Progress()
    encoder = Encoder(tower, mode, max_patches)
    window_patches = window_patches or max(4 * max_patches, 20_000)
    summary, start = Summary(), time.perf_counter()
    window: list[Decoded] = []
    size = 0
    for item in items:
        d = prepare(item, options)
        window.append(d)
        size += sum(p.n for p in d.patches)
        if size >= window_patches:
            _finish(window, encoder, writer, summary, progress)
            window, size = [], 0
    _finish(window, encoder, writer, summary, progress)
    writer.flush()
    summary.seconds = time.perf_counter() - start
    return summary


def _finish(window: list[Decoded], encoder: Encoder, writer: ShardWriter, summary: Summary,
            progress: Progress) -> None:
    units = [Unit(i, f, p) for i, d in enumerate(window) for f, p in enumerate(d.patches)]
    tokens, oom = encoder.run(units)
    for i, d in enumerate(window):
        if d.error is not None:
            writer.add(failed_row(d.item, d.error.status, str(d.error)))
            summary.count(d.error.status)
        elif i in oom:
            writer.add(failed_row(d.item, "oom", oom[i]))
            summary.count("oom")
        else:
            frames = [tokens[(i, f)] for f in range(len(d.patches))]
            writer.add(ok_row(d, frames), frames)
            summary.count("ok")
            summary.frames += len(frames)
            summary.tokens += sum(f.shape[0] for f in frames)
        n = sum(p.n for p in d.patches)
        summary.patches += n
        progress.advance(1, n)
