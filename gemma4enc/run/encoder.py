"""Files → (row, per-frame tokens) in memory, with no OUT: the library's core (review_turn5 §6.5).

    from gemma4enc import Encoder
    with Encoder(model="path/to/gemma-4", device="cpu") as enc:
        for row, frames in enc.encode(["cat.jpg", "clip.mp4"]):
            print(row.path, row.status, [f.shape for f in frames or []])

The local engine (run/local.py) is this encoder plus a shard writer: the same preflight, towers,
batch budget and pipeline, with a ShardWriter as the pipeline's sink where this one keeps a list.
`search` encodes a query file OUT lacks here, with OUT's settings, and writes nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Iterator

from ..errors import UsageError
from ..options import Options
from ..rows import Row

if TYPE_CHECKING:
    import torch

    from ..media.kinds import Item
    from ..media.workers import DecodePool
    from .pipeline import Progress, Summary


@dataclass(frozen=True)
class Towers:
    """The model opened on each device, and how a call is batched and bounded."""

    towers: list
    dtype: str
    mode: str
    max_patches: int
    seconds: float  # to load them

    @property
    def names(self) -> str:
        return ", ".join(str(t.device) for t in self.towers)


def open_towers(options: Options, work: bool = True) -> Towers:
    """A tower per device (one kind only), the batching mode and the patches a call may hold
    (`work` False: nothing to encode, no budget measured)."""
    import time

    from ..model.batching import budget_patches
    from ..model.load import devices, open_tower

    start = time.perf_counter()
    opened = [open_tower(options, device) for device in devices(options)]
    (_, dtype, mode), towers = opened[0], [t for t, _, _ in opened]
    if len({(t.device.type, t.dtype) for t in towers}) > 1:
        raise UsageError("--devices: give devices of one kind (their outputs must be the same)")
    max_patches = min(budget_patches(t, options, mode) for t in towers) if work else 0
    return Towers(towers, dtype, mode, max_patches, time.perf_counter() - start)


class Encoder:
    """The Gemma 4 vision tower over files, in memory. `options` (or Options' fields by name: model,
    device, dtype, sampling, …) as `gemma4enc encode` takes them; the model is checked and loaded
    on the first `encode`, once, and kept until `close()`. `towers`: opened already, with `options`
    checked (the local engine's, whose run did the preflight)."""

    def __init__(self, options: Options | None = None, towers: Towers | None = None, **fields):
        self.options = options if options is not None else Options(**fields)
        self._towers = towers

    def towers(self) -> Towers:
        if self._towers is None:
            from .preflight import preflight

            options, _ = preflight(self.options)
            if options.dtype == "auto":  # decided once, as a run records it
                from ..model.load import resolve_dtype

                options = replace(options, dtype=resolve_dtype(options))
            self.options = options
            self._towers = open_towers(options)
        return self._towers

    def run(self, items: list[Item], sink, progress: Progress | None = None,
            pool: DecodePool | None = None) -> Summary:
        """Encode `items`, each finished file to `sink.add(row, frames)` in input order (a
        ShardWriter, or this encoder's list); `pool`: decode workers already started."""
        from .pipeline import run as pipeline

        t = self.towers()
        return pipeline(items, t.towers, self.options, sink, t.mode, t.max_patches, progress, pool=pool)

    def encode(self, paths, bar=None) -> Iterator[tuple[Row, list[torch.Tensor] | None]]:
        """Each media file among `paths` (files or folders, walked as `encode` walks them): its row
        and, where it is ok, its tokens per frame on the CPU in the out dtype a shard would hold;
        in input order. Holds every given file's tokens at once: a folder of many goes to
        `gemma4enc encode`, which writes them as it goes. `bar(total)`: a progress bar (Progress)."""
        from ..media.discover import discover
        from ..media.workers import DecodePool

        items, _ = discover([os.fspath(p) for p in paths])
        sink = _Kept(self.options.out_dtype)
        if items:
            workers = self.options.workers if self.options.workers is None else min(self.options.workers, len(items))
            pool = DecodePool(self.options, workers, self.options.decode_timeout).start()
            progress = bar(len(items)) if bar else None
            try:
                self.run(items, sink, progress, pool=pool)
            finally:
                pool.close()
                if progress is not None:
                    progress.close()
        yield from sink.kept

    def close(self) -> None:
        self._towers = None  # the towers' memory goes with the last reference

    def __enter__(self) -> Encoder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Kept:
    """The pipeline's sink when nothing is written: rows and tokens kept in a list."""

    def __init__(self, out_dtype: str):
        import torch

        self.dtype = getattr(torch, out_dtype)  # a name of options.OUT_DTYPES
        self.kept: list[tuple[Row, list[torch.Tensor] | None]] = []

    def add(self, row: Row, frames: list[torch.Tensor] | None = None) -> None:
        self.kept.append((row, [f.to("cpu", self.dtype) for f in frames] if frames else None))

    def flush(self) -> None:
        pass
