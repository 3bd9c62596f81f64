"""The reader without torch: `gemma4enc.open(OUT, framework="numpy")` gives float32 numpy arrays.

numpy has no bfloat16, so the shards are read by hand: a safetensors file is an 8-byte
little-endian header length, a JSON header (dtype, shape, data_offsets per tensor), then the
raw bytes. Only the rows asked for are read. bfloat16 is the top half of a float32: its 16
bits shifted left by 16 are that float32 exactly.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from math import prod
from pathlib import Path

import numpy as np

from ..errors import UsageError
from ..media.remote import is_url
from ..rows import Row, Status
from .names import MANIFEST, not_an_output
from .ledger import Ledger
from .out import Out

HEADER_MAX = 100 << 20  # safetensors' own bound on a header
DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64}


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


class Shard:
    """One shard's header, and rows of its tensors read on demand."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            n = int.from_bytes(f.read(8), "little")
            if not 2 <= n <= min(HEADER_MAX, size - 8):  # read with a bound: never "192 TiB"
                raise self.bad(f"a header of {n} bytes in a file of {size}")
            try:
                self.header = json.loads(f.read(n))
            except ValueError:
                raise self.bad("a header that is not JSON") from None
        self.base, self.size = 8 + n, size
        if not isinstance(self.header, dict):
            raise self.bad("a header that is not a JSON object")

    def bad(self, why: str) -> UsageError:
        """A shard a reader cannot trust: one line naming it and the fix (never exit 70)."""
        return UsageError(f"{self.path}: {why}; `gemma4enc verify OUT --repair` finds and mends it")

    def __contains__(self, name: str) -> bool:
        return name in self.header

    def length(self, name: str) -> int:
        """Rows of tensor `name` (its shape's first number), checked."""
        return self._info(name)[2][0]

    def _info(self, name: str):
        """(its dtype, its first byte, its shape) of tensor `name`, every claim checked against the file."""
        info = self.header.get(name)
        try:
            dtype, shape = np.dtype(DTYPES[info["dtype"]]), [int(d) for d in info["shape"]]
            start, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise self.bad(f"tensor {name!r} is missing or has a dtype, shape or offsets this reader cannot read") from None
        if not shape or min(shape) < 0 or not 0 <= start <= end <= self.size - self.base \
                or end - start != prod(shape) * dtype.itemsize:
            raise self.bad(f"tensor {name!r} claims a shape {shape} or offsets [{start}, {end}] the file does not hold")
        return dtype, start, shape

    def rows(self, name: str, lo: int, hi: int) -> np.ndarray:
        """tensor[lo:hi] as a numpy array (floats as float32); rows outside it are refused."""
        info = self.header[name]
        dtype, start, shape = self._info(name)
        if not 0 <= lo <= hi <= shape[0]:
            raise self.bad(f"rows [{lo}, {hi}) of {name!r} asked, which has {shape[0]}: a row's index is wrong")
        per_row = prod(shape[1:])
        offset = self.base + start + lo * per_row * dtype.itemsize
        data = np.fromfile(self.path, dtype, (hi - lo) * per_row, offset=offset).reshape(
            hi - lo, *shape[1:]
        )
        if info["dtype"] == "BF16":
            return bf16_to_float32(data)
        return data.astype(np.float32) if info["dtype"] == "F16" else data


def key_of(path) -> str:
    """How the manifest keys a file: a URL as written, a local path made absolute."""
    path = os.fspath(path)
    return path if is_url(path) else os.path.abspath(path)


class Rows:
    """The lookups both readers share, over the compact ledger of `self.out`'s manifest.

    Rows are not held as dicts: the ledger keeps each file's latest row in columns (about 100
    bytes a file) and a whole row is read from its offset when asked for, from the manifest as it
    was opened (a compaction that replaces the file later does not move the rows under the reader).
    """

    out: Out
    ledger: Ledger

    def _open(self, out) -> None:
        self.out = out
        if not self.out.found():
            raise FileNotFoundError(not_an_output(self.out.url))
        self.ledger = self.out.ledger(pin=True)

    @property
    def url(self) -> str:
        """OUT as it was named (a store's URL, a folder's path)."""
        return self.out.url

    @property
    def rows(self) -> Mapping[str, Row]:
        """path → latest row (any status), read on demand."""
        return _RowsView(self)

    def ok_rows(self) -> Iterator[tuple[str, Row]]:
        """(path, row) of every file that has tokens, in the order of `iter(self)`, one at a time."""
        offsets = (e.offset for _, e in self.ledger.entries() if e.status == Status.OK)
        return ((r["path"], Row.from_json(r)) for r in self.ledger.rows_at(offsets, rising=False))

    def __len__(self) -> int:
        return sum(1 for _, e in self.ledger.entries() if e.status == Status.OK)

    def __iter__(self):
        return (p for p, e in self.ledger.entries() if e.status == Status.OK)

    def __contains__(self, path) -> bool:
        entry = self.ledger.get(key_of(path))
        return bool(entry and entry.status == Status.OK)

    def row(self, path) -> Row:
        """The manifest row of `path` (any status); KeyError for a path not in it."""
        key = key_of(path)
        if key not in self.ledger:
            raise KeyError(f"{path}: not in {self.out.named(MANIFEST)}")
        return Row.from_json(self.ledger.row(key))

    def ok_row(self, path) -> Row:
        """The row of a file that has tokens; KeyError saying why for one that has none."""
        row = self.row(path)
        if row["status"] != Status.OK:
            raise KeyError(f"{path}: status {row['status']}: {row.get('error')}")
        return row


class _RowsView(Mapping):
    def __init__(self, rows: Rows):
        self._rows = rows

    def __getitem__(self, path) -> Row:
        if path not in self._rows.ledger:
            raise KeyError(path)
        return Row.from_json(self._rows.ledger.row(path))

    def __iter__(self):
        return iter(self._rows.ledger)

    def __len__(self) -> int:
        return len(self._rows.ledger)


class NumpyEmbeddings(Rows):
    """As shards.Embeddings (`emb[path]`, `frames`, `pooled`, `row`, `pooled_matrix`), with numpy
    float32 arrays; `mm_encoder_outputs` hands Gemma 4 torch tensors, so it alone needs torch."""

    def __init__(self, out: Out):
        self._open(out)

    def _shard(self, path) -> tuple[Row, Shard]:
        row = self.ok_row(path)
        return row, Shard(self.out.shard_path(row["shard"]))

    def _tokens_shard(self, path) -> tuple[Row, Shard]:
        row, shard = self._shard(path)
        if "tokens" not in shard:
            raise KeyError(
                f"{path}: {self.out} was encoded with --store pooled: it keeps the pooled vectors, "
                "not the tokens"
            )
        return row, shard

    def __getitem__(self, path) -> np.ndarray:
        row, shard = self._tokens_shard(path)
        lo, hi = shard.rows("item_offsets", row["index"], row["index"] + 2).tolist()
        return shard.rows("tokens", lo, hi)

    def frames(self, path) -> list[np.ndarray]:
        row, shard = self._tokens_shard(path)
        a, b = shard.rows("item_frames", row["index"], row["index"] + 2).tolist()
        offsets = shard.rows("frame_offsets", a, b + 1).tolist()
        return [shard.rows("tokens", lo, hi) for lo, hi in zip(offsets, offsets[1:])]

    def pooled(self, path) -> np.ndarray:
        row, shard = self._shard(path)
        if "pooled" not in shard:
            raise KeyError(f"{path}: {row['shard']} holds no pooled tokens (encoded with --no-pooled)")
        return shard.rows("pooled", row["index"], row["index"] + 1)[0]

    def pooled_matrix(self, per_frame: bool = False, window: int = 1 << 16):
        """(keys, (N, D) float32) as shards.Embeddings.pooled_matrix gives, without torch: one row
        per file (its latest) in manifest order; with per_frame, one per sampled video frame."""
        keys: list = []  # paths, or (path, frame) with per_frame
        by_shard: dict[str, list] = {}
        for path, row in self.ok_rows():
            frames = per_frame and row["kind"] == "video"
            by_shard.setdefault(row["shard"], []).append((row["index"], len(keys), frames))
            keys += (
                [(path, k) for k in range(row["frames"])]
                if frames
                else [(path, 0) if per_frame else path]
            )
        matrix = None
        for name, members in by_shard.items():
            shard = Shard(self.out.shard_path(name))
            if matrix is None:  # --store pooled keeps no tokens: the width is the pooled vectors'
                wide = "pooled" if "pooled" in shard else "tokens"
                matrix = np.empty((len(keys), shard.header[wide]["shape"][1]), np.float32)
            pooled = "pooled" in shard
            stored = sorted((i, pos) for i, pos, frames in members if pooled and not frames)
            for at in range(0, len(stored), window):  # windows of rows, read in one piece each
                run = stored[at : at + window]
                block = shard.rows("pooled", run[0][0], run[-1][0] + 1)
                for i, pos in run:
                    matrix[pos] = block[i - run[0][0]]
            for i, pos, frames in members:
                if frames or not pooled:  # per frame, or a folder written with --no-pooled
                    matrix[pos : pos + (self._frame_count(shard, i) if frames else 1)] = self._means(
                        shard, i, frames
                    )
        return keys, matrix if matrix is not None else np.empty((0, 0), np.float32)

    @staticmethod
    def _frame_count(shard: Shard, index: int) -> int:
        a, b = shard.rows("item_frames", index, index + 2).tolist()
        return b - a

    @staticmethod
    def _means(shard: Shard, index: int, per_frame: bool) -> np.ndarray:
        if "frame_pooled" in shard:  # --store pooled: the frames' means are stored, as retrieval reads them
            a, b = shard.rows("item_frames", index, index + 2).tolist()
            return shard.rows("frame_pooled", a, b)
        lo, hi = shard.rows("item_offsets", index, index + 2).tolist()
        tokens = shard.rows("tokens", lo, hi)
        if not per_frame:
            return tokens.mean(0, keepdims=True)
        a, b = shard.rows("item_frames", index, index + 2).tolist()
        offsets = (shard.rows("frame_offsets", a, b + 1) - lo).tolist()
        return np.stack([tokens[s:e].mean(0) for s, e in zip(offsets[:-1], offsets[1:])])

    def mm_encoder_outputs(self, paths, device=None, dtype=None, model=None):
        """As shards.Embeddings.mm_encoder_outputs: torch tensors for Gemma 4's generate (needs torch)."""
        from .gemma import model_inputs

        return model_inputs(self, paths, device, dtype, model)
