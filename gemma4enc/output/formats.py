"""The export formats' writers: the clip layout (streamed .npy beside Parquet metadata), Parquet
with `datasets`' Array2D tokens, and WebDataset tars (our own ustar headers and .npy bytes).
Each writes under temporary names, batch by batch, bounded in rows and bytes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from ..errors import UsageError
from .files import temp_name
from .vectors import Record

BATCH_ROWS = 1 << 16  # metadata rows written at once


BATCH_BYTES = 32 << 20  # vector and token bytes held before they are written


HEADER = 128  # bytes of a streamed .npy header (numpy's own size for 2-D shapes), patched at the end


# column → Arrow type name and datasets' Value dtype (the same words)
META = {
    "path": "string",
    "rel": "string",
    "kind": "string",
    "frames": "int32",
    "tokens": "int32",
    "width": "int32",
    "height": "int32",
    "size": "int64",
    "mtime_ns": "int64",
    "sha256": "string",
    # a WebDataset member's sidecars (img2dataset's KEY.txt / KEY.json): the caption and url as
    # clip-retrieval and datasets name them, and the whole sidecar as JSON text (nothing dropped)
    "caption": "string",
    "url": "string",
    "sidecar": "string",
}


PER_FRAME = {"frame": "int32", "frame_index": "int64", "timestamp": "float64"}


def text_of(value):
    """A string as Arrow, Parquet and JSON text can hold it: a file name that is not UTF-8 (lone
    surrogates, as Python reads such names) gets its undecodable bytes as \\xNN escapes instead of
    stopping the export (exit 70). The manifest keeps the exact bytes (docs/format.md)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return value


def row_meta(rec: Record, per_frame: bool) -> dict:
    """The row's metadata columns: rel where the walk knew the root, sha256 where --hash made one."""
    row = rec.row
    meta = {
        "path": text_of(row["path"]),
        "rel": text_of(row.get("rel")),
        "kind": row.get("kind"),
        "frames": row.get("frames"),
        "tokens": row.get("tokens"),
        "width": row.get("width"),
        "height": row.get("height"),
        "size": row.get("size"),
        "mtime_ns": row.get("mtime_ns"),
        "sha256": row.get("sha256"),
        **_sidecar_meta(row.get("sidecar")),
    }
    if per_frame:
        f, video = rec.frame, row.get("kind") == "video"
        at = f or 0  # a record of a video's frame carries its frame
        pick = (lambda key: (row.get(key) or [None] * (at + 1))[at]) if video else (lambda key: None)
        meta |= {"frame": f, "frame_index": pick("frame_indices"), "timestamp": pick("timestamps")}
        if video:
            meta["tokens"] = pick("frame_tokens")
    return meta


def _sidecar_meta(sidecar) -> dict:
    """caption (the .txt, else the .json's "caption"), url (the .json's) and the sidecar as JSON text."""
    if not sidecar:
        return {"caption": None, "url": None, "sidecar": None}
    described = sidecar.get("json") if isinstance(sidecar.get("json"), dict) else {}
    caption = sidecar.get("txt") if isinstance(sidecar.get("txt"), str) else described.get("caption")
    url = described.get("url")
    return {
        "caption": caption if isinstance(caption, str) else None,
        "url": url if isinstance(url, str) else None,
        "sidecar": json.dumps(sidecar, ensure_ascii=False),
    }


def columns_of(per_frame: bool) -> dict[str, str]:
    return META | (PER_FRAME if per_frame else {})


def cast(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 → the export dtype; a value past float16's range is refused, not written as inf."""
    with np.errstate(over="ignore"):  # said below, in words
        cast = values.astype(np.dtype(dtype), copy=False)
    if dtype == "float16" and not np.isfinite(cast).all() and np.isfinite(values).all():
        raise UsageError("values beyond float16's range (±65504): export with --dtype float32")
    return cast


class Writer:
    """Rows into numbered files: a file is opened for its first row and closed when full."""

    def __init__(self, dest: Path, info: dict, pa, rows_per_file: int, file_bytes: int):
        self.dest, self.info, self.pa = dest, info, pa
        self.rows_per_file, self.file_bytes = rows_per_file, file_bytes
        self.dtype, self.dim = info["dtype"], info["hidden_size"]
        self.columns = columns_of(info["per_frame"])
        self.schema_meta = {b"gemma4enc": json.dumps(info).encode()}
        self.number, self.rows, self.bytes, self.open = 0, 0, 0, False
        self.files: list[str] = []
        self.temps: list[tuple[Path, Path]] = []  # (temp, final) of the file being written

    def add(self, rec: Record, meta: dict) -> None:
        if self.open and (self.rows >= self.rows_per_file or self.bytes >= self.file_bytes):
            self._close_file()
        if not self.open:
            self._open_file(self.number)
            self.open, self.rows, self.bytes = True, 0, 0
        self.rows += 1
        self.bytes += self.write(rec, meta)

    def close(self) -> list[str]:
        if self.open:
            self._close_file()
        return self.files

    def abort(self) -> None:
        """Close and remove the file being written (the files closed before stay, as export.json is not written)."""
        if self.open:
            try:
                self.finish()
            except Exception:  # noqa: BLE001 - the error that stopped the export is the one to report
                pass
        for tmp, _ in self.temps:
            tmp.unlink(missing_ok=True)

    def _close_file(self) -> None:
        self.finish()
        for tmp, final in self.temps:
            os.replace(tmp, final)
            self.files.append(final.relative_to(self.dest).as_posix())
        self.temps, self.open = [], False
        self.number += 1

    def temp(self, name: str) -> Path:
        """A temporary path for DEST/name, renamed into place when the file is closed."""
        final = self.dest / name
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(temp_name(final.name))
        self.temps.append((tmp, final))
        return tmp

    def parquet(self, name: str, schema):
        import pyarrow.parquet as pq

        return pq.ParquetWriter(
            self.temp(name), schema.with_metadata({**(schema.metadata or {}), **self.schema_meta})
        )

    def meta_schema(self):
        pa = self.pa
        return pa.schema([(name, getattr(pa, kind)()) for name, kind in self.columns.items()])

    def meta_batch(self, metas: list[dict]):
        return {name: [m[name] for m in metas] for name in self.columns}

    # per format
    def _open_file(self, number: int) -> None:
        raise NotImplementedError

    def write(self, rec: Record, meta: dict) -> int:
        raise NotImplementedError

    def finish(self) -> None:
        raise NotImplementedError


class NpyStream:
    """A 2-D .npy file written row block by row block: the shape in its header is patched at the end."""

    def __init__(self, path: Path, dtype, dim: int):
        self.f, self.dtype, self.dim, self.count = open(path, "wb"), np.dtype(dtype), dim, 0
        self.f.write(self._header())

    def _header(self) -> bytes:
        text = f"{{'descr': '{self.dtype.str}', 'fortran_order': False, 'shape': ({self.count}, {self.dim}), }}"
        return (
            b"\x93NUMPY\x01\x00"
            + (HEADER - 10).to_bytes(2, "little")
            + text.ljust(HEADER - 11).encode()
            + b"\n"
        )

    def write(self, block: np.ndarray) -> None:
        self.f.write(np.ascontiguousarray(block, self.dtype).tobytes())
        self.count += len(block)

    def close(self) -> None:
        if not self.f.closed:
            self.f.seek(0)
            self.f.write(self._header())
            self.f.flush()
            os.fsync(self.f.fileno())
            self.f.close()


class ClipWriter(Writer):
    """img_emb/img_emb_N.npy (pooled vectors) and metadata/metadata_N.parquet, the same rows in each."""

    def _open_file(self, number: int) -> None:
        self.npy = NpyStream(self.temp(f"img_emb/img_emb_{number}.npy"), np.dtype(self.dtype), self.dim)
        self.pq = self.parquet(f"metadata/metadata_{number}.parquet", self.meta_schema())
        self.vectors: list[np.ndarray] = []
        self.metas: list[dict] = []
        self.held = 0

    def write(self, rec: Record, meta: dict) -> int:
        self.vectors.append(np.array(rec.pooled))  # a copy: a view would hold on to its whole window
        self.metas.append(meta)
        self.held += rec.pooled.nbytes
        if len(self.metas) >= BATCH_ROWS or self.held >= BATCH_BYTES:
            self._flush()
        return rec.pooled.size * np.dtype(self.dtype).itemsize

    def _flush(self) -> None:
        if self.metas:
            self.npy.write(cast(np.stack(self.vectors), self.dtype))
            self.pq.write_table(self.pa.table(self.meta_batch(self.metas), schema=self.pq.schema))
            self.vectors, self.metas, self.held = [], [], 0

    def finish(self) -> None:
        try:
            self._flush()
        finally:
            self.npy.close()
            self.pq.close()


class ParquetWriter(Writer):
    """data/train-NNNNN.parquet: metadata, `soft_tokens` list<list<half>> ((n, D), datasets' Array2D storage),
    `pooled` fixed_size_list<half>[D]; the datasets features in the schema's `huggingface` metadata."""

    def _open_file(self, number: int) -> None:
        pa = self.pa
        value = pa.float16() if self.dtype == "float16" else pa.float32()
        # datasets' Array2D as its Arrow extension type names itself: datasets reads the column back as
        # Array2D (it keeps a feature only where the field's type is the feature's), others see the lists
        array2d = {
            b"ARROW:extension:name": b"datasets.features.features.Array2DExtensionType",
            b"ARROW:extension:metadata": json.dumps([[None, self.dim], self.dtype]).encode(),
        }
        schema = pa.schema(
            [
                *self.meta_schema(),
                pa.field("soft_tokens", pa.list_(pa.list_(value)), metadata=array2d),
                ("pooled", pa.list_(value, self.dim)),
            ]
        )
        features: dict[str, dict] = {
            name: {"dtype": kind, "_type": "Value"} for name, kind in self.columns.items()
        }
        features["soft_tokens"] = {"shape": [None, self.dim], "dtype": self.dtype, "_type": "Array2D"}
        features["pooled"] = {
            "feature": {"dtype": self.dtype, "_type": "Value"},
            "length": self.dim,
            "_type": "List",
        }
        hf = {b"huggingface": json.dumps({"info": {"features": features}}).encode()}
        self.pq = self.parquet(f"data/train-{number:05d}.parquet", schema.with_metadata(hf))
        self.tokens: list[np.ndarray] = []
        self.pooled: list[np.ndarray] = []
        self.metas: list[dict] = []
        self.held = 0

    def write(self, rec: Record, meta: dict) -> int:
        assert rec.tokens is not None  # this layout exports tokens: they were read
        tokens = cast(rec.tokens, self.dtype)
        self.tokens.append(tokens)
        self.pooled.append(np.array(rec.pooled))
        self.metas.append(meta)
        self.held += tokens.nbytes + rec.pooled.nbytes
        if self.held >= BATCH_BYTES or len(self.metas) >= BATCH_ROWS:
            self._flush()
        return tokens.nbytes + rec.pooled.size * tokens.itemsize

    def _flush(self) -> None:
        if not self.metas:
            return
        pa = self.pa
        flat = np.concatenate(self.tokens)
        counts = np.array([0] + [len(t) for t in self.tokens], dtype=np.int32)
        inner = pa.ListArray.from_arrays(
            np.arange(0, flat.size + 1, self.dim, dtype=np.int32), pa.array(flat.ravel())
        )
        soft = pa.ListArray.from_arrays(np.cumsum(counts, dtype=np.int32), inner)
        pooled = pa.FixedSizeListArray.from_arrays(
            pa.array(cast(np.stack(self.pooled), self.dtype).ravel()), self.dim
        )
        columns = self.meta_batch(self.metas)
        arrays = [pa.array(columns[name], type=self.pq.schema.field(name).type) for name in self.columns]
        self.pq.write_table(pa.Table.from_arrays([*arrays, soft, pooled], schema=self.pq.schema))
        self.tokens, self.pooled, self.metas, self.held = [], [], [], 0

    def finish(self) -> None:
        try:
            self._flush()
        finally:
            self.pq.close()


class TarWriter(Writer):
    """NNNNNN.tar: per row KEY.npy (tokens), KEY.pooled.npy, KEY.json (the metadata and the key) and,
    for a member with a caption, KEY.txt.

    The ustar headers are made here: tarfile's cost more than the rest of a row (a copy of each
    TarInfo, every field formatted anew); names are short and plain, so one layout serves all."""

    def _open_file(self, number: int) -> None:
        self.tar = open(self.temp(f"{number:06d}.tar"), "wb")
        self.key = getattr(self, "key", 0)

    def write(self, rec: Record, meta: dict) -> int:
        key, self.key = f"{self.key:09d}", self.key + 1
        assert rec.tokens is not None  # this layout exports tokens: they were read
        tokens = cast(rec.tokens, self.dtype)
        mtime = max(meta["mtime_ns"] or 0, 0) // 10**9
        self._member(f"{key}.npy", _npy(tokens), mtime)
        self._member(f"{key}.pooled.npy", _npy(cast(rec.pooled, self.dtype)), mtime)
        # the sidecar as an object here (JSON holds it as it is), not as the columns' JSON text
        described = {"key": key, **meta, "sidecar": rec.row.get("sidecar") or None}
        self._member(f"{key}.json", json.dumps(described, ensure_ascii=False).encode(), mtime)
        if meta["caption"] is not None:  # KEY.txt, as img2dataset writes it: wds' "txt" field
            self._member(f"{key}.txt", meta["caption"].encode(), mtime)
        return tokens.nbytes

    def _member(self, name: str, data: bytes, mtime: int) -> None:
        self.tar.write(_ustar(name, len(data), mtime))
        self.tar.write(data)
        self.tar.write(bytes(-len(data) % 512))

    def finish(self) -> None:
        self.tar.write(bytes(1024))  # the end-of-archive marker: two zero blocks
        self.tar.flush()
        os.fsync(self.tar.fileno())
        self.tar.close()


def _ustar(name: str, size: int, mtime: int) -> bytes:
    """A POSIX ustar header of a regular file (mode 644, owner 0) for a name of under 100 ASCII bytes."""
    header = bytearray(512)
    header[0 : len(name)] = name.encode("ascii")
    for offset, width, value in (
        (100, 8, 0o644),
        (108, 8, 0),
        (116, 8, 0),
        (124, 12, size),
        (136, 12, mtime),
    ):
        header[offset : offset + width] = b"%0*o\0" % (width - 1, value)
    header[148:156] = b" " * 8  # the checksum counts its own field as spaces
    header[156:157] = b"0"  # a regular file
    header[257:265] = b"ustar\x0000"
    header[148:156] = b"%06o\0 " % sum(header)
    return bytes(header)


def _npy(array: np.ndarray) -> bytes:
    """The .npy file of a C-ordered array (np.save's bytes, with less done per call)."""
    text = f"{{'descr': '{array.dtype.str}', 'fortran_order': False, 'shape': {array.shape}, }}"
    pad = -(10 + len(text) + 1) % 64
    header = (
        b"\x93NUMPY\x01\x00"
        + (len(text) + pad + 1).to_bytes(2, "little")
        + text.encode()
        + b" " * pad
        + b"\n"
    )
    return header + np.ascontiguousarray(array).tobytes()


WRITERS = {"clip": ClipWriter, "parquet": ParquetWriter, "webdataset": TarWriter}
