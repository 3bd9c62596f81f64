"""An OUT as an encoder cache keyed by content: the one key scheme of `export --to vllm`, the vLLM
connector and the request helper, and the reads that serve a key's tokens straight from a shard.

Runs inside a serving engine's own environment (vLLM pins an older transformers than ours), so it
imports only the standard library, numpy and torch, fsspec for an OUT at a URL, and of gemma4enc
only output/names.py (OUT's names: the standard library alone): gemma4enc's other modules need
packages that environment does not have.

The key of a file (docs/serving.md):

    key = "g4e-" + sha256("gemma4enc-ec/1\\0" + KIND + "\\0" + CONTENT_SHA256 + "\\0" + SHAPE)[:40 hex]

CONTENT_SHA256 is the hex sha256 of the file's bytes (the row's `sha256` from `encode --hash`; for
a row without one, computed from the local file when its size and mtime are still the row's), KIND
`image` or `video`, SHAPE the settings that decide a file's tokens beside its bytes, as compact
JSON with sorted keys: `{"image_tokens": N, "resize": R}` for an image, `{"resize": R, "sampling":
{...}, "seek": S, "video_tokens": N}` for a video. The same bytes encoded the same way get the same
key on any machine, under any path; the model is not in it (one OUT, one export folder, one model).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import struct
from typing import Union

import numpy as np

from ..output.names import LINE_MAX, MANIFEST, PARTS, PART_RE, SETTINGS, manifest_chain

CACHE_FILE = "encoder_cache.safetensors"  # what vLLM's ECExampleConnector reads: DIR/<key>/this
TENSOR = "ec_cache"  # the one tensor in it: (tokens, text width)
KEY_RE = re.compile(r"^g4e-[0-9a-f]{40}$")


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def shape_of(kind: str, settings: dict) -> dict:
    """The settings besides the bytes that decide a file's tokens (the model aside)."""
    if kind == "image":
        return {"image_tokens": settings.get("image_tokens"), "resize": settings.get("resize")}
    return {key: settings.get(key) for key in ("resize", "sampling", "seek", "video_tokens")}


def key_of(kind: str, content_sha256: str, settings: dict) -> str:
    shape = json.dumps(shape_of(kind, settings), sort_keys=True, separators=(",", ":"))
    text = f"gemma4enc-ec/1\0{kind}\0{content_sha256}\0{shape}"
    return "g4e-" + hashlib.sha256(text.encode()).hexdigest()[:40]


def _own(path: str) -> int:
    """A file of OUT opened as gemma4enc opens its own (output/files.own_opener): never through a
    link, and only a regular file, so a handed-over OUT whose settings.json is a FIFO or links to
    /dev/zero cannot hang or fill the serving engine."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path}: not a regular file: gemma4enc reads only its own regular files in OUT")
    return fd


class FolderSource:
    """OUT's files by name in a local folder, read-only, by byte range (as gemma4enc opens its own)."""

    def __init__(self, out: str):
        self.out = out

    def read(self, name: str) -> bytes | None:
        try:
            with os.fdopen(_own(os.path.join(self.out, name)), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def read_range(self, name: str, start: int, end: int) -> bytes:
        with os.fdopen(_own(os.path.join(self.out, name)), "rb") as f:
            f.seek(start)
            return f.read(end - start)

    def parts(self) -> list[str]:
        return []  # a folder's manifest is one file


class UrlSource:
    """OUT's objects by name under a URL (fsspec), read-only, by byte range."""

    def __init__(self, out: str):
        try:
            from fsspec.core import url_to_fs

            self.fs, root = url_to_fs(out)
        except ImportError as e:
            raise ImportError(f"{out}: reading it needs fsspec and its protocol's package "
                              f"(s3://: pip install s3fs): {e}") from None
        self.root = root.rstrip("/")

    def read(self, name: str) -> bytes | None:
        try:
            return self.fs.cat_file(f"{self.root}/{name}")
        except FileNotFoundError:
            return None

    def read_range(self, name: str, start: int, end: int) -> bytes:
        return self.fs.cat_file(f"{self.root}/{name}", start=start, end=end)

    def parts(self) -> list[str]:
        """manifest.parts/*.jsonl names, in name order."""
        try:
            names = [p.rsplit("/", 1)[-1] for p in self.fs.ls(f"{self.root}/{PARTS}", detail=False)]
        except FileNotFoundError:
            return []
        return sorted(n for n in names if PART_RE.match(f"{PARTS}/{n}"))


Source = Union[FolderSource, UrlSource]


def source(out: str) -> Source:
    """OUT as the user named it → its reader: the one place here that tells a URL from a folder
    (output/opening.py is gemma4enc's; this module may import none of it but names.py)."""
    out = str(out).rstrip("/")
    return UrlSource(out) if "://" in out else FolderSource(out)


# the colour of a stand-in's every pixel (requests.py): a flat image of it is no real file's, so the
# connector can tell a stand-in that no key answers and fail its request rather than answer from it
STAND_IN = (1, 2, 3)



def manifest_rows(source: Source) -> list[dict]:
    """Every row, in order: the base then the parts; from the last `~compacted` part on where one is
    (it holds the whole manifest while a compaction replaces the base: docs/remote.md)."""
    chain, with_base = manifest_chain([f"{PARTS}/{n}" for n in source.parts()])
    texts = [source.read(MANIFEST) or b""] if with_base else []
    texts += [source.read(name) or b"" for name in chain]
    rows = []
    for text in texts:
        for line in text.decode("utf-8", "surrogateescape").splitlines():
            if line.strip() and len(line) <= LINE_MAX:  # longer: no row gemma4enc wrote, never parsed
                try:
                    row = json.loads(line)
                except ValueError:  # a torn last line of a killed run: the row was never there
                    continue
                if isinstance(row, dict) and isinstance(row.get("path"), str):  # else no row of ours
                    rows.append(row)
    return rows


class Entry:
    __slots__ = ("key", "row")

    def __init__(self, key: str, row: dict):
        self.key, self.row = key, row


class OutCache:
    """OUT's latest ok rows by key and by path; `tokens(key)` reads one file's tokens from its shard.

    Rows without a content hash get one from their local file where its size and mtime are still
    the row's (the trust a re-run's change check gives); the rest cannot be keyed and are counted
    in `unkeyed` (encode with --hash to key every row, inputs by URL and tar members included).
    """

    def __init__(self, out: str, hash_files: bool = True):
        self.source = source(out)
        settings = self.source.read(SETTINGS)
        rows = manifest_rows(self.source)
        if settings is None or not rows and self.source.read(MANIFEST) is None:
            raise FileNotFoundError(f"{out}: not a gemma4enc output folder (no {SETTINGS} and {MANIFEST})")
        self.settings = json.loads(settings)
        if not isinstance(self.settings, dict):  # ValueError: the export says it in one line
            raise ValueError(f"{out}: {SETTINGS} is not the settings gemma4enc writes (a JSON object)")
        latest: dict[str, dict] = {}
        for row in rows:
            latest[row["path"]] = row
        self.by_key: dict[str, Entry] = {}
        self.by_path: dict[str, Entry] = {}
        self.unkeyed: list[str] = []
        self.changed: list[str] = []  # files changed (or gone) since their encode: their tokens are not theirs
        self.hashed = 0  # content hashes computed here, for rows encoded without --hash
        for path, row in latest.items():
            if row.get("status") != "ok" or row.get("kind") not in ("image", "video"):
                continue
            if self.settings.get("store") == "pooled":
                self.unkeyed.append(path)  # no tokens kept: nothing to serve
                continue
            digest = row.get("sha256") or (self._hash(row) if hash_files else None)
            if digest is None:
                self.unkeyed.append(path)
                continue
            entry = Entry(key_of(row["kind"], digest, self.settings), row)
            self.by_key[entry.key] = self.by_path[path] = entry
        self._headers: dict[str, tuple[int, dict]] = {}
        self._offsets: dict[str, np.ndarray] = {}

    def _hash(self, row: dict) -> str | None:
        path = row["path"]
        if "://" in path or row.get("root", "") and str(row.get("root")).endswith(".tar"):
            return None  # a URL or a tar member: only --hash gives its content hash
        try:
            st = os.stat(path)
            if (st.st_size, st.st_mtime_ns) != (row.get("size"), row.get("mtime_ns")):
                self.changed.append(path)
                return None  # changed since it was encoded: these are not its tokens
            digest = file_sha256(path)
        except OSError:
            self.changed.append(path)  # gone (or unreadable) since it was encoded
            return None
        self.hashed += 1
        return digest

    def key(self, path: str) -> str | None:
        entry = self.by_path.get(path) or self.by_path.get(os.path.abspath(path))
        return entry.key if entry else None

    def __contains__(self, key: str) -> bool:
        return key in self.by_key

    def _header(self, shard: str) -> tuple[int, dict]:
        if shard not in self._headers:
            (n,) = struct.unpack("<Q", self.source.read_range(shard, 0, 8))
            self._headers[shard] = (8 + n, json.loads(self.source.read_range(shard, 8, 8 + n)))
        return self._headers[shard]

    def _tensor_rows(self, shard: str, name: str, lo: int, hi: int):
        import torch

        base, header = self._header(shard)
        info = header[name]
        dtype = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64}[
            info["dtype"]
        ]
        shape = info["shape"]
        row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        start = base + info["data_offsets"][0] + lo * row_bytes
        data = bytearray(self.source.read_range(shard, start, start + (hi - lo) * row_bytes))
        return torch.frombuffer(data, dtype=dtype).reshape(hi - lo, *shape[1:])

    def tokens(self, key: str):
        """(tokens, text width) torch tensor in the stored dtype: a video's frames one after another,
        as vLLM's Gemma 4 embed_multimodal gives a video."""
        row = self.by_key[key].row
        shard = row["shard"]
        if shard not in self._offsets:
            base, header = self._header(shard)
            n = header["item_offsets"]["shape"][0]
            self._offsets[shard] = self._tensor_rows(shard, "item_offsets", 0, n).numpy()
        offsets = self._offsets[shard]
        i = row["index"]
        if not (type(i) is int and 0 <= i < len(offsets) - 1):  # never another file's tokens
            raise KeyError(f"{key}: its row's index {i} is not one of the {len(offsets) - 1} items of {shard}")
        lo, hi = int(offsets[i]), int(offsets[i + 1])
        return self._tensor_rows(shard, "tokens", lo, hi)
