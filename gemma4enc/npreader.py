"""The reader without torch: `gemma4enc.open(OUT, framework="numpy")` gives float32 numpy arrays.

numpy has no bfloat16, so the shards are read by hand: a safetensors file is an 8-byte
little-endian header length, a JSON header (dtype, shape, data_offsets per tensor), then the
raw bytes. Only the rows asked for are read. bfloat16 is the top half of a float32: its 16
bits shifted left by 16 are that float32 exactly.
"""

from __future__ import annotations

import json
import os
from math import prod
from pathlib import Path

import numpy as np

MANIFEST = "manifest.jsonl"
DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64}


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


class Shard:
    """One shard's header, and rows of its tensors read on demand."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            self.header = json.loads(f.read(n))
        self.base = 8 + n

    def __contains__(self, name: str) -> bool:
        return name in self.header

    def rows(self, name: str, lo: int, hi: int) -> np.ndarray:
        """tensor[lo:hi] as a numpy array (floats as float32)."""
        info = self.header[name]
        dtype, shape = np.dtype(DTYPES[info["dtype"]]), info["shape"]
        per_row = prod(shape[1:])
        offset = self.base + info["data_offsets"][0] + lo * per_row * dtype.itemsize
        data = np.fromfile(self.path, dtype, (hi - lo) * per_row, offset=offset).reshape(hi - lo, *shape[1:])
        if info["dtype"] == "BF16":
            return bf16_to_float32(data)
        return data.astype(np.float32) if info["dtype"] == "F16" else data


class Rows:
    """The lookups both readers share, over `self.rows` (path → latest row) read from `self.out`."""

    out: Path
    rows: dict[str, dict]

    def __len__(self) -> int:
        return sum(1 for r in self.rows.values() if r["status"] == "ok")

    def __iter__(self):
        return (p for p, r in self.rows.items() if r["status"] == "ok")

    def __contains__(self, path) -> bool:
        row = self.rows.get(os.path.abspath(path))
        return bool(row and row["status"] == "ok")

    def row(self, path) -> dict:
        """The manifest row of `path` (any status); KeyError for a path not in it."""
        key = os.path.abspath(path)
        if key not in self.rows:
            raise KeyError(f"{path}: not in {self.out / MANIFEST}")
        return self.rows[key]

    def ok_row(self, path) -> dict:
        """The row of a file that has tokens; KeyError saying why for one that has none."""
        row = self.row(path)
        if row["status"] != "ok":
            raise KeyError(f"{path}: status {row['status']}: {row.get('error')}")
        return row


class NumpyEmbeddings(Rows):
    """As shards.Embeddings (`emb[path]`, `frames`, `pooled`, `row`), with numpy float32 arrays."""

    def __init__(self, out: str | os.PathLike):
        self.out = Path(out)
        if not (self.out / MANIFEST).exists():
            raise FileNotFoundError(f"{self.out}: no {MANIFEST}; is this a gemma4enc output folder?")
        self.rows: dict[str, dict] = {}
        with open(self.out / MANIFEST, encoding="utf-8") as f:
            for line in f:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue  # a torn last line from a killed run
                self.rows[row["path"]] = row

    def _shard(self, path) -> tuple[dict, Shard]:
        row = self.ok_row(path)
        return row, Shard(self.out / row["shard"])

    def __getitem__(self, path) -> np.ndarray:
        row, shard = self._shard(path)
        lo, hi = shard.rows("item_offsets", row["index"], row["index"] + 2).tolist()
        return shard.rows("tokens", lo, hi)

    def frames(self, path) -> list[np.ndarray]:
        row, shard = self._shard(path)
        a, b = shard.rows("item_frames", row["index"], row["index"] + 2).tolist()
        offsets = shard.rows("frame_offsets", a, b + 1).tolist()
        return [shard.rows("tokens", lo, hi) for lo, hi in zip(offsets, offsets[1:])]

    def pooled(self, path) -> np.ndarray:
        row, shard = self._shard(path)
        if "pooled" not in shard:
            raise KeyError(f"{path}: {row['shard']} holds no pooled tokens (encoded with --no-pooled)")
        return shard.rows("pooled", row["index"], row["index"] + 1)[0]
