"""Writing the shards: safetensors files of many files' soft tokens, each named by manifest rows only
once it is on disk.

OUT/shard-NNNNNN.safetensors (shard-<task>-NNN with --engine ray) holds many files' soft tokens stacked:
  tokens        [T, D]  out dtype   every soft token of the shard, file after file, frame after frame
  item_offsets  [N+1]   int64       file i's tokens are tokens[item_offsets[i]:item_offsets[i+1]]
  frame_offsets [F+1]   int64       token offsets of every frame (an image is one frame)
  item_frames   [N+1]   int64       file i's frames are frame_offsets rows item_frames[i]..item_frames[i+1]
  pooled        [N, D]  out dtype   mean of each file's tokens (float32 mean, then cast)
With --store pooled (header "store": "pooled") `tokens` is absent and
  frame_pooled  [F, D]  out dtype   mean of each frame's tokens; the offsets still count the tokens
OUT/manifest.jsonl has one row per input file; a row naming a shard is written only after
that shard is on disk (temp name, fsync, rename, fsync of the folder).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from .._version import __version__
from ..errors import OutputError, output_error
from ..rows import Row
from .files import atomic_write
from .names import MANIFEST

if TYPE_CHECKING:
    from ..model.tower import Tower
    from ..options import Options

FORMAT_VERSION = "1"


class ShardSink(Protocol):
    """Where a ShardWriter's shards and rows go: an `Out` (output/out.py), or a Ray task's own
    (run/ray/actor.py), which collects the rows for the driver."""

    @property
    def folder(self) -> Path: ...  # where a shard is written (temp name, fsync, rename)

    records: bool  # its rows are the run's manifest: an error can say how many were saved

    def first_shard(self) -> int: ...  # the number of the writer's first shard

    def shard_name(self, k: int) -> str: ...

    def publish(self, path: Path) -> None: ...  # a shard just written, made OUT's, before its rows

    def append(self, rows: list) -> None: ...  # rows naming published shards (or none)


def shard_metadata(options: Options, tower: Tower) -> dict[str, str]:
    """Shard header: everything a reader needs to know what the numbers are."""
    ckpt = tower.checkpoint
    return {
        "producer": f"gemma4enc {__version__}",
        "model": options.model,
        "revision": str(ckpt.revision) if ckpt and ckpt.revision else "",
        "dtype": str(tower.dtype).removeprefix("torch."),
        "out_dtype": options.out_dtype,
        "image_soft_tokens": str(options.image_tokens),
        "resize": options.resize,
        "video_soft_tokens": str(options.video_tokens),
        "sampling": json.dumps(asdict(options.sampling)),
        "hidden_size": str(tower.out_dim),
    } | ({"store": "pooled"} if options.store == "pooled" else {})


@dataclass
class Pending:
    """A file's result waiting for its shard to be written."""

    row: Row
    frames: list[torch.Tensor] = field(default_factory=list)  # (tokens_f, T) per frame, on the CPU
    # --store pooled: (1, D) float32 frame means in `frames`, the tokens per frame here, the file's mean
    sizes: list[int] | None = None
    mean: torch.Tensor | None = None


def file_mean(frames: list[torch.Tensor]) -> torch.Tensor:
    """A file's pooled vector as a shard stores it, before the cast to the out dtype: the float32
    mean of its tokens (`frames`, already in the out dtype)."""
    return torch.cat(frames).float().mean(0)


def pooled_as_read(frames: list[torch.Tensor], dtype: torch.dtype, stored: bool):
    """The pooled vector (numpy float32) that reading a shard holding these tokens gives
    (vectors.records): the stored mean cast to `dtype`, or where none is stored (--no-pooled), the
    mean numpy takes of the tokens. A file encoded in memory is found exactly as it would be in OUT."""
    import numpy as np

    if stored:
        return file_mean(frames).to(dtype).float().numpy()
    return torch.cat(frames).float().numpy().mean(0, dtype=np.float32)


class ShardWriter:
    """Collects finished files, writes a shard when it reaches `shard_bytes`, then their rows.

    The shards and rows go to `sink` (a ShardSink: an `Out`, or a Ray task's own): each shard
    written in `sink.folder`, published, then the rows naming it appended.
    """

    def __init__(
        self,
        sink: ShardSink,
        out_dtype: str,
        metadata: dict[str, str],
        shard_bytes: int = 1 << 30,
        pooled: bool = True,
        flush_seconds: float = 60.0,
    ):
        self.sink = sink
        self.out, self.dtype = self.sink.folder, getattr(torch, out_dtype)  # a name of options.OUT_DTYPES
        self.metadata = {"format_version": FORMAT_VERSION, **metadata}
        self.shard_bytes, self.pooled, self.flush_seconds = shard_bytes, pooled, flush_seconds
        self.pooled_only = metadata.get("store") == "pooled"
        self.out.mkdir(parents=True, exist_ok=True)
        # rows this writer saved; None where its rows are not the run's (a Ray task's): an error
        # then cannot tell whether the run saved any
        self.saved: int | None = 0 if self.sink.records else None
        self.next_shard = self.sink.first_shard()
        self.pending: list[Pending] = []
        self.bytes = 0
        self.last_flush = time.monotonic()
        self._executor = None
        self._writing = None  # the Future of the write in flight

    def add(self, row: Row, frames: list[torch.Tensor] | None = None) -> None:
        """A finished file: ok with its per-frame tokens, or failed (row only)."""
        item = Pending(row, [f.to("cpu", self.dtype) for f in frames or []])
        if (
            self.pooled_only and item.frames
        ):  # the means as a tokens shard has them; the tokens go at once
            item.mean = file_mean(item.frames)
            item.sizes = [f.shape[0] for f in item.frames]
            item.frames = [f.float().mean(0, keepdim=True) for f in item.frames]
        self.pending.append(item)
        self.bytes += (
            sum(f.shape[-1] * self.dtype.itemsize for f in item.frames)
            if self.pooled_only
            else sum(f.numel() * f.element_size() for f in item.frames)
        )
        # by size, or by time: a kill must not cost more than a minute or so of finished files
        if self.bytes >= self.shard_bytes or time.monotonic() - self.last_flush >= self.flush_seconds:
            self.flush(wait=False)

    def flush(self, wait: bool = True) -> None:
        """Hand the pending files to the writing thread; with wait, return once all is on disk.

        One write is in flight at most (memory holds two shards at most), in order, so the
        encoder goes on while a shard is stacked, written and fsynced. A write error surfaces
        here or at the next add, as OutputError.
        """
        self._join()
        if self.pending:
            name = self.sink.shard_name(self.next_shard)
            if any(p.frames for p in self.pending):
                self.next_shard += 1
            self._writing = self._thread().submit(self._write, self.pending, name)
            self.pending, self.bytes, self.last_flush = [], 0, time.monotonic()
        if wait:
            self._join()

    def close(self, discard: bool = False) -> None:
        """Write what is pending (or drop it) and end the writing thread (a Ray actor makes many writers)."""
        try:
            if discard:
                self.pending = []
            self.flush()
        finally:
            if self._executor is not None:
                self._executor.shutdown()
                self._executor = None

    def _thread(self):
        if self._executor is None:
            from concurrent.futures import ThreadPoolExecutor

            self._executor = ThreadPoolExecutor(1, thread_name_prefix="gemma4enc-shard-writer")
        return self._executor

    def _join(self) -> None:
        writing, self._writing = self._writing, None
        if writing is not None:
            try:
                writing.result()
            except OutputError:
                self.pending = []  # what was not written is redone by the next run
                raise

    def _write(self, pending: list[Pending], name: str) -> None:
        """Write the shard (if any file has tokens), then append every pending row."""
        ok = [p for p in pending if p.frames]
        try:
            if ok:
                tensors = self._stack(ok)
                atomic_write(
                    self.out / name, lambda tmp: save_file(tensors, str(tmp), metadata=self.metadata)
                )
                self.sink.publish(self.out / name)
                for index, p in enumerate(ok):
                    p.row = p.row.replace(shard=name, index=index)
            self.sink.append([p.row for p in pending])
            if self.saved is not None:
                self.saved += len(pending)
        except (OSError, SafetensorError) as e:
            raise output_error(f"{name} or {MANIFEST}" if ok else MANIFEST, self.out, e, self.saved) from None

    def _stack(self, ok: list[Pending]) -> dict[str, torch.Tensor]:
        if self.pooled_only:
            return self._stack_pooled(ok)
        frames = [f for p in ok for f in p.frames]
        frame_sizes = torch.tensor([0] + [f.shape[0] for f in frames])
        item_sizes = torch.tensor([0] + [sum(f.shape[0] for f in p.frames) for p in ok])
        item_frames = torch.tensor([0] + [len(p.frames) for p in ok])
        tensors = {
            "tokens": torch.cat(frames),  # (T_total, D)
            "item_offsets": item_sizes.cumsum(0),
            "frame_offsets": frame_sizes.cumsum(0),
            "item_frames": item_frames.cumsum(0),
        }
        if self.pooled:
            means = [file_mean(p.frames) for p in ok]
            tensors["pooled"] = torch.stack(means).to(self.dtype)  # (N, D)
        return tensors

    def _stack_pooled(self, ok: list[Pending]) -> dict[str, torch.Tensor]:
        """--store pooled: the offsets as a tokens shard has them, the means, no tokens."""
        sizes = [p.sizes or [] for p in ok]  # every ok file's, under --store pooled
        means = [p.mean for p in ok if p.mean is not None]
        assert len(means) == len(ok)
        frame_sizes = torch.tensor([0] + [s for each in sizes for s in each])
        return {
            "item_offsets": torch.tensor([0] + [sum(each) for each in sizes]).cumsum(0),
            "frame_offsets": frame_sizes.cumsum(0),
            "item_frames": torch.tensor([0] + [len(each) for each in sizes]).cumsum(0),
            "pooled": torch.stack(means).to(self.dtype),
            "frame_pooled": torch.cat([f for p in ok for f in p.frames]).to(self.dtype),
        }
