"""The manifest: rows appended as shards land, read once per run into a compact map, compacted.

OUT/manifest.jsonl stays the readable contract (one JSON row per line, later rows replace
earlier ones for the same path). A run reads it once into a `Ledger`: path → one packed
record (size, mtime, where its latest row starts, status, shard…), about 200 bytes a file,
and reads on from where it stopped when the file grew. Whole rows are fetched by offset only
when needed. Nothing here imports torch: a run with nothing to do never loads it.
"""

from __future__ import annotations

import functools
import json
import os
import re
import struct
from pathlib import Path
from typing import Iterator, NamedTuple

from .rows import Status

MANIFEST = "manifest.jsonl"
# shard-000012 from a local run; shard-<16 hex of the task's files>-000 from a Ray task
SHARD_RE = re.compile(r"^shard-(\d{6}|[0-9a-f]{16}-\d{3})\.safetensors$")
# our temp files, and only ours (a user's .draft.tmp in OUT is never touched): .gemma4enc-<name>.<pid>.tmp,
# and the names earlier versions used (.<our file>.<pid>.tmp, .write-test-<pid>.tmp)
TEMP_RE = re.compile(r"^\.gemma4enc-.+\.\d+\.tmp$|^\.(shard-[0-9a-f-]+\.safetensors|manifest\.jsonl|settings\.json)"
                     r"\.\d+\.tmp$|^\.write-test-\d+\.tmp$")


def temp_name(name: str) -> str:
    return f".gemma4enc-{name}.{os.getpid()}.tmp"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@functools.cache
def _umask() -> int:
    """The process's umask, read without changing it (/proc), at the first write rather than at
    import; where /proc has no Umask line, set and put back at once."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def atomic_write(path: Path, write) -> None:
    """write(tmp_path), then fsync and rename into place: readers never see half a file."""
    tmp = path.with_name(temp_name(path.name))
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # safetensors writes 0600; others may need to read the shards
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass  # the folder went unwritable; the next run's cleanup removes it


def append_rows(out: Path, rows: list[dict]) -> None:
    """Append whole lines and fsync: a kill leaves at most a torn last line, which readers skip."""
    if not rows:
        return
    with open(Path(out) / MANIFEST, "ab") as f:
        f.write(b"".join(map(line_of, rows)))
        f.flush()
        os.fsync(f.fileno())


def line_of(row: dict) -> bytes:
    # a file name that is not UTF-8 holds lone surrogates: written as \udcXX escapes, JSON reads it back
    return (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8", errors="backslashreplace")


def read_manifest(out: Path) -> dict[str, dict]:
    """path -> its latest row as a dict (the reader's view; runs use the compact Ledger)."""
    rows: dict[str, dict] = {}
    path = Path(out) / MANIFEST
    if not path.exists():
        return rows
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a torn last line from a killed run
            rows[row["path"]] = row
    return rows


class Entry(NamedTuple):
    """What a run needs of a file's latest row without parsing it again."""

    size: int  # -1 where the row has none
    mtime_ns: int
    offset: int  # byte offset of the row in the manifest
    tokens: int
    index: int  # -1: no shard
    shard: str | None
    status: str
    kind: str
    root: str | None  # the walked root the row records, when its path is root + its rel (adoption)


# size, mtime_ns, offset, tokens, index, shard code, status code, kind code, root code
_PACK = struct.Struct("<qqqqiiHHi")


class Ledger:
    """path → packed latest row of OUT's manifest; `refresh()` reads only what was appended since."""

    def __init__(self, out: Path):
        self.path = Path(out) / MANIFEST
        self._reset(None)

    def _reset(self, ino) -> None:
        self.rows: dict[str, bytes] = {}
        self.sha256: dict[str, bytes] = {}  # only rows that carry one (--hash)
        self.strings: list[str | None] = [None]  # code 0 is None
        self.codes: dict[str | None, int] = {None: 0}
        self.per_shard: dict[int, int] = {}  # shard code → latest rows that name it
        self.roots: set[int] = set()  # codes of the roots rows record (a few): where a moved file's row may be
        self.end = 0  # bytes read: up to the end of the last complete line
        self.lines = 0
        self.unreadable = 0
        self.superseded = 0
        self.ino = ino

    @classmethod
    def load(cls, out: Path) -> Ledger:
        ledger = cls(out)
        ledger.refresh()
        return ledger

    def refresh(self) -> Ledger:
        """Read on from where the last read stopped; start over if the file was replaced or shrank."""
        try:
            st = os.stat(self.path)
        except (FileNotFoundError, NotADirectoryError):  # no manifest yet (encode says why OUT is unusable)
            self._reset(None)
            return self
        if st.st_ino != self.ino or st.st_size < self.end:
            self._reset(st.st_ino)
        if st.st_size > self.end:
            self._read_from(self.end)
        return self

    def _read_from(self, start: int) -> None:
        offset = start
        with open(self.path, "rb") as f:
            f.seek(start)
            for line in f:
                if not line.endswith(b"\n"):
                    break  # a torn last line (a killed run's); repair() truncates it, the file is redone
                self._add(line, offset)
                offset += len(line)
        self.end = offset

    def _code(self, text) -> int:
        code = self.codes.get(text)
        if code is None:
            code = self.codes[text] = len(self.strings)
            self.strings.append(text)
        return code

    def _add(self, line: bytes, offset: int) -> None:
        self.lines += 1
        try:
            row = json.loads(line)
            path = row["path"]
        except (ValueError, KeyError, TypeError):
            self.unreadable += 1
            return
        old = self.rows.get(path)
        if old is not None:
            self.superseded += 1
            self._count(_PACK.unpack(old)[5], -1)
        shard = self._code(row.get("shard"))
        index = row.get("index")
        root = row.get("root")
        # rel is not kept: it is the path past its root (a row where it is not cannot be adopted)
        root = self._code(root) if root and row.get("rel") and os.path.join(root, row["rel"]) == path else 0
        if root:
            self.roots.add(root)
        self.rows[path] = _PACK.pack(_int(row.get("size")), _int(row.get("mtime_ns")), offset,
                                     row.get("tokens") or 0, -1 if index is None else index, shard,
                                     self._code(row.get("status")), self._code(row.get("kind")), root)
        self._count(shard, 1)
        digest = row.get("sha256")
        if digest:
            self.sha256[path] = bytes.fromhex(digest)
        elif old is not None:
            self.sha256.pop(path, None)

    def _count(self, shard: int, n: int) -> None:
        if shard:
            self.per_shard[shard] = self.per_shard.get(shard, 0) + n

    def __len__(self) -> int:
        return len(self.rows)

    def __contains__(self, path) -> bool:
        return path in self.rows

    def __iter__(self) -> Iterator[str]:
        return iter(self.rows)

    def get(self, path: str) -> Entry | None:
        packed = self.rows.get(path)
        if packed is None:
            return None
        size, mtime, offset, tokens, index, shard, status, kind, root = _PACK.unpack(packed)
        s = self.strings
        return Entry(size, mtime, offset, tokens, index, s[shard], s[status], s[kind], s[root])

    def entries(self) -> Iterator[tuple[str, Entry]]:
        for path in self.rows:
            yield path, self.get(path)

    def digest(self, path: str) -> str | None:
        value = self.sha256.get(path)
        return value.hex() if value is not None else None

    def known_kind(self, path: str, size: int, mtime_ns: int) -> str | None:
        """The kind the latest row records, if that row is for this very size and mtime."""
        packed = self.rows.get(path)
        if packed is None:
            return None
        row_size, row_mtime, *_, kind, _root = _PACK.unpack(packed)
        return self.strings[kind] if (row_size, row_mtime) == (size, mtime_ns) else None

    def same_rel(self, rel: str, size: int) -> Iterator[tuple[str, Entry]]:
        """Latest ok rows of another root with this rel and size: where a moved root's file was."""
        for code in self.roots:
            path = os.path.join(self.strings[code], rel)
            entry = self.get(path)
            if entry is not None and entry.status == Status.OK and entry.size == size and entry.root == self.strings[code]:
                yield path, entry

    def shards(self) -> set[str]:
        """Shards that some latest row names (a shard only superseded rows name is dead)."""
        return {self.strings[code] for code, n in self.per_shard.items() if n > 0}

    def row(self, path: str) -> dict:
        """The whole latest row, read from its offset."""
        return next(self.rows_at([self.get(path).offset]))

    def rows_at(self, offsets) -> Iterator[dict]:
        """Rows at these offsets (read in rising order: one pass over the file)."""
        with open(self.path, "rb") as f:
            for offset in sorted(offsets):
                f.seek(offset)
                yield json.loads(f.readline())

    def live_offsets(self) -> list[int]:
        return sorted(_PACK.unpack(p)[2] for p in self.rows.values())


def _int(value) -> int:
    return value if isinstance(value, int) else -1
