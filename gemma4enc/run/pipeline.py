"""The stages wired together: decode → patchify → plan → tower → write, one window at a time.

Files are taken in their sorted order in windows of a few batches' worth of patches, decoded
ahead by the worker pool; each window is planned and encoded, then its files are handed to
the shard writer in order. Host memory stays bounded by the window and the pool's look-ahead
whatever the folder's size.
"""

from __future__ import annotations

import queue
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..errors import TooManyFailures  # noqa: F401 - raised here, imported from here by the engines
from ..media.kinds import Item
from ..media.prepare import Decoded
from ..media.workers import DecodePool
from ..model.batching import Unit, batches
from ..options import Options
from ..output.shards import ShardWriter
from ..rows import Row, Status
from .heap import give_back_free_memory
from .summary import NOTHING_TIMED, Summary  # noqa: F401 - where the engines long found them


class Progress:
    """What the pipeline tells the outside world; the CLI puts a bar or lines behind it."""

    def advance(self, files: int, patches: int) -> None:
        pass

    def close(self) -> None:  # the run is over: a bar is finished
        pass


def ok_row(d: Decoded, frames: list[torch.Tensor]) -> Row:
    item = d.item
    return Row(
        item.path,
        item.kind,
        item.size,
        item.mtime_ns,
        Status.OK,
        tokens=sum(f.shape[0] for f in frames),
        frames=len(frames),
        root=item.root if item.rel else None,
        rel=item.rel,
        frame_tokens=[f.shape[0] for f in frames],
        width=d.width,
        height=d.height,
        video=d.video,
        sha256=d.sha256,
        extra={"sidecar": d.sidecar} if d.sidecar else {},
    )


def failed_row(item: Item, status: str, message: str) -> Row:
    return Row.failed(item, status, message)


class Encoder:
    """Runs planned batches through the tower; halves a batch on out-of-memory."""

    def __init__(self, tower, mode: str, max_patches: int):
        self.tower, self.mode, self.max_patches = tower, mode, max_patches
        self.patches = 0  # encoded so far: how the work was shared between devices

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
        self.patches += sum(u.patches.n for u in batch)
        for u, t in zip(batch, tokens):
            out[(u.file, u.frame)] = t


def run(
    items: list[Item],
    towers: list,
    options: Options,
    writer: ShardWriter,
    mode: str,
    max_patches: int,
    progress: Progress | None = None,
    window_patches: int | None = None,
    pool: DecodePool | None = None,
) -> Summary:
    """Encode every item; rows and shards go to `writer`. Returns counts for the summary.

    With several towers (--devices) each window goes to the first free one, so devices share
    the work by its size, and since a window is planned the same way whatever runs it, the
    output equals a single-device run's. Windows are recorded in input order.
    `pool`: decode workers already started (see DecodePool.start); by default made here."""
    progress = progress or Progress()
    encoders = [Encoder(t, mode, max_patches) for t in towers]
    free: queue.SimpleQueue[Encoder] = queue.SimpleQueue()
    for e in encoders:
        free.put(e)
    window_patches = window_patches or default_window(mode, max_patches)
    summary, start = Summary(), time.perf_counter()
    threads = (
        ThreadPoolExecutor(len(towers), thread_name_prefix="gemma4enc-tower")
        if len(towers) > 1
        else None
    )
    inflight: deque[tuple[list[Decoded], Future]] = deque()  # windows being encoded, in input order

    def submit(window: list[Decoded]) -> None:
        if threads is None:
            _record(window, *_encode(window, free), writer, summary, progress, options)
            return
        inflight.append((window, threads.submit(_encode, window, free)))
        while inflight and (len(inflight) > len(towers) or inflight[0][1].done()):
            w, result = inflight.popleft()
            _record(w, *result.result(), writer, summary, progress, options)

    window: list[Decoded] = []
    size = 0
    pool = pool or DecodePool(options, options.workers, options.decode_timeout)
    decoded = pool.map(items)
    try:
        for d in _timed(decoded, summary):
            window.append(d)
            size += sum(p.n for p in d.patches)
            if size >= window_patches:
                submit(window)
                window, size = [], 0
        submit(window)
        while inflight:
            w, result = inflight.popleft()
            _record(w, *result.result(), writer, summary, progress, options)
    finally:
        decoded.close()  # stops the workers, whatever ended the loop
        if threads is not None:
            threads.shutdown(cancel_futures=True)
    writer.flush()
    summary.seconds = time.perf_counter() - start
    summary.device_patches = [e.patches for e in encoders]
    return summary


def default_window(mode: str, max_patches: int) -> int:
    """Patches decoded before a window is planned. Bucket and pack group items, so a window holds a
    few calls' worth to group from; serial calls take one item each, so a window of one call's
    worth lets the tower start as soon as the first files are decoded (on a small folder the
    first window would otherwise wait for the last file)."""
    return max_patches if mode == "serial" else max(4 * max_patches, 20_000)


STALLED = (Status.TIMEOUT, Status.NOT_FOUND, Status.UNREADABLE)  # waits that are not decoding


def _timed(decoded, summary: Summary):
    """The decoded files, adding the time spent waiting for each to summary.decode_wait (or, for a
    file that timed out or was not there, to summary.stalled_wait)."""
    it = iter(decoded)
    while True:
        t = time.perf_counter()
        try:
            d = next(it)
        except StopIteration:
            summary.decode_wait += time.perf_counter() - t
            return
        if d.status in STALLED:
            summary.stalled_wait += time.perf_counter() - t
        else:
            summary.decode_wait += time.perf_counter() - t
        yield d


def where_time_went(summary: Summary, workers: int) -> tuple[dict, str | None]:
    """The summary's share of time the towers waited for decode, the decode rate per worker, and
    a sentence when decode was the bottleneck (the towers waited more than half the time)."""
    if not summary.seconds or not summary.files:
        return dict(NOTHING_TIMED), None
    # the time spent on files that timed out or were missing is left out: it says nothing of how
    # fast decoding goes (one 60 s timeout made "about 375 workers" of a run of small photos)
    seconds = max(summary.seconds - summary.stalled_wait, 1e-9)
    stalled = sum(summary.by_status.get(s, 0) for s in STALLED)
    waited = min(1.0, summary.decode_wait / seconds)
    workers = max(1, workers)
    facts = {
        "tower_waited_share": round(waited, 3),
        "decode_files_per_s_per_worker": round((summary.files - stalled) / seconds / workers, 3),
    }
    if waited <= 0.5 or summary.files == stalled:
        return facts, None
    busy = max(seconds - summary.decode_wait, 1e-9)
    needed = workers * seconds / busy  # workers that decode as fast as the towers encode
    return facts, (
        f"decode-bound: the tower waited {waited:.0%} of the time; about {needed:.0f} workers would "
        f"feed it (now {workers})"
    )


def _encode(window: list[Decoded], free: queue.SimpleQueue):
    """Plan and encode one window on the first free tower."""
    encoder = free.get()
    try:
        units = [Unit(i, f, p) for i, d in enumerate(window) for f, p in enumerate(d.patches)]
        return encoder.run(units)
    finally:
        free.put(encoder)


def _record(
    window: list[Decoded],
    tokens: dict,
    oom: dict,
    writer: ShardWriter,
    summary: Summary,
    progress: Progress,
    options: Options,
) -> None:
    """A window's files, in order, to the writer and the counts."""
    for i, d in enumerate(window):
        frames = None
        if d.status != Status.OK:
            row = failed_row(d.item, d.status, d.error)
        elif i in oom:
            row = failed_row(d.item, Status.OOM, oom[i])
        else:
            frames = [tokens[(i, f)] for f in range(len(d.patches))]
            row = ok_row(d, frames)
        writer.add(row, frames)
        n = sum(p.n for p in d.patches)
        summary.record([row], n)
        progress.advance(1, n)
        try:
            summary.check(options.max_failures)
        except TooManyFailures:
            writer.flush()  # the rest of the window is not recorded: a re-run does it
            raise
    give_back_free_memory()  # the window's pixels and temporaries are gone now
