"""The manifest: rows appended as shards land, read once per run into a compact map, compacted.

OUT/manifest.jsonl stays the readable contract (one JSON row per line, later rows replace
earlier ones for the same path). A run reads it once into a `Ledger`: path → its latest row's
size, mtime, where it starts, status, shard… in flat columns, 100–140 bytes a file, and reads on from where it stopped when the file grew. Whole rows are fetched by offset only
when needed. Nothing here imports torch: a run with nothing to do never loads it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from array import array
from pathlib import Path
from typing import Any, BinaryIO, Iterator, NamedTuple

from ..rows import Status
from .files import MANIFEST, bounded_lines, own_opener


class Entry(NamedTuple):
    """What a run needs of a file's latest row without parsing it again."""

    size: int  # -1 where the row has none
    mtime_ns: int
    offset: int  # byte offset of the row in the manifest
    tokens: int
    index: int  # type: ignore[assignment]  # -1: no shard (the field shadows tuple.index; rows name it so)
    shard: str | None
    status: str
    kind: str
    root: str | None  # the walked root the row records, when its path is root + its rel (adoption)


CHUNK = 1 << 16  # rows turned into Python ints at a time when iterating
# one column per field, one item per manifest line read (codes index `strings`: 4 bytes, so no
# count of shard names can overflow them)
_COLUMNS = {
    "size": "q",
    "mtime": "q",
    "offset": "q",
    "tokens": "I",
    "index": "i",
    "shard": "I",
    "status": "I",
    "kind": "I",
    "root": "I",
    "dir": "I",
    "name_end": "Q",
    "hash": "q",
}


class Ledger:
    """path → latest row of OUT's manifest, in columns; `refresh()` reads only what was appended since.

    Each line read is a row of flat arrays (no Python object per row): its folder as a code, its
    file name in one byte string, size, mtime, offset, counts and codes, and its path's hash.
    The latest row of each path is found by sorting the hashes (numpy) after a read, and a
    lookup is a binary search, checked against the stored path. 100–140 bytes a file.
    """

    def __init__(self, out: Path):
        self.path = Path(out) / MANIFEST
        self._file: BinaryIO | None = None  # the manifest held open (load(pin=True))
        self._reset(None)

    def _reset(self, ino) -> None:
        self._col = {name: array(code) for name, code in _COLUMNS.items()}
        self._names = bytearray()  # file names (UTF-8, lone surrogates kept), one after another
        self._sha = (
            bytearray()
        )  # 33 bytes a row once some row carries a sha256 (--hash): 1 + it, or 33 zeros
        self.strings: list[str | None] = [
            None
        ]  # code 0 is None: shard names, statuses, kinds, roots, folders
        self.codes: dict[str | None, int] = {None: 0}
        self._live = None  # (sorted hashes, their rows) of the latest rows: built when first asked
        self._counts: Any = None  # shard code → latest rows that name it (a numpy array once built)
        self._roots: list[
            int
        ] = []  # codes of the roots latest rows record (a few): where a moved file's row may be
        self.end = 0  # bytes read: up to the end of the last complete line
        self.lines = 0
        self.unreadable = 0
        self.ino = ino

    @classmethod
    def load(cls, out: Path, pin: bool = False) -> Ledger:
        """Read OUT's manifest. `pin`: keep it open, so rows are read from this very file even if a
        compaction replaces it later (a reader's snapshot)."""
        ledger = cls(out)
        if pin:
            ledger._file = open(ledger.path, "rb", opener=own_opener)
            ledger.ino = os.fstat(ledger._file.fileno()).st_ino
        ledger.refresh()
        return ledger

    def refresh(self) -> Ledger:
        """Read on from where the last read stopped; start over if the file was replaced or shrank."""
        try:
            st = os.lstat(self.path)  # a link is refused when it is opened
        except (
            FileNotFoundError,
            NotADirectoryError,
        ):  # no manifest yet (encode says why OUT is unusable)
            self._reset(None)
            return self
        if self._file is not None:
            st = os.fstat(self._file.fileno())  # pinned: this file, not whatever now has its name
        if st.st_ino != self.ino or st.st_size < self.end:
            self._reset(st.st_ino)
        if st.st_size > self.end:
            self._read_from(self.end)
        return self

    def _open(self):
        if self._file is not None:
            return contextlib.nullcontext(self._file)
        return open(self.path, "rb", opener=own_opener)  # never through a link

    def _read_from(self, start: int) -> None:
        offset = start
        with self._open() as f:
            f.seek(start)
            for line, size, whole in bounded_lines(f):
                if not whole:
                    break  # a torn last line (a killed run's); repair() truncates it, the file is redone
                if line is None:  # too long to be a row: never held
                    self.lines += 1
                    self.unreadable += 1
                else:
                    self._add(line, offset)
                offset += size
        self.end = offset
        self._live = self._counts = None

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
            if not isinstance(path, str):
                raise TypeError(path)
            cut = path.rindex("/") + 1 if "/" in path else 0
        except (ValueError, KeyError, TypeError, AttributeError):
            self.unreadable += 1
            return
        index, tokens = row.get("index"), row.get("tokens") or 0
        if not (
            _fits(tokens, 0, 1 << 32)
            and (index is None or _fits(index, -(1 << 31), 1 << 31))
            and _schema_ok(row)
        ):
            self.unreadable += 1  # not a row we wrote; the file is encoded again
            return
        c, code = self._col, self._code
        root = row.get("root")
        # rel is not kept: it is the path past its root (a row where it is not cannot be adopted)
        root = code(root) if root and row.get("rel") and os.path.join(root, row["rel"]) == path else 0
        self._names += path[cut:].encode("utf-8", "surrogatepass")
        c["size"].append(_int(row.get("size")))
        c["mtime"].append(_int(row.get("mtime_ns")))
        c["offset"].append(offset)
        c["tokens"].append(tokens)
        c["index"].append(-1 if index is None else index)
        c["shard"].append(code(row.get("shard")))
        c["status"].append(code(row.get("status")))
        c["kind"].append(code(row.get("kind")))
        c["root"].append(root)
        c["dir"].append(code(path[:cut]))
        c["name_end"].append(len(self._names))
        c["hash"].append(hash(path))
        digest = row.get("sha256")
        if digest or self._sha:
            if not self._sha:
                self._sha = bytearray(33 * (len(c["hash"]) - 1))
            self._sha += b"\x01" + bytes.fromhex(digest) if digest else bytes(33)

    def _path(self, r: int) -> str:
        return _path_in(self._col, self._names, self.strings, r)

    def _index(self):
        """(sorted hashes, rows) of each path's latest row, and the shard counts, built once per read."""
        if self._live is None:
            import numpy as np

            hashes = np.array(self._col["hash"], dtype=np.int64)  # a copy: the arrays keep growing
            order = np.argsort(hashes, kind="stable")  # equal hashes keep the manifest's order
            ordered = hashes[order]
            del hashes
            keep = np.ones(len(order), dtype=bool)
            first = order.copy()  # each path's first row: files are listed in the order they first came
            same = np.flatnonzero(ordered[1:] == ordered[:-1]).tolist()  # i shares its hash with i + 1
            for lo, hi in _runs(same):  # positions lo..hi share a hash: superseded rows (or a collision)
                latest, earliest = {}, {}
                for pos in range(lo, hi + 1):
                    path = self._path(int(order[pos]))
                    latest[path] = pos  # later rows replace earlier
                    earliest.setdefault(path, int(order[pos]))
                keep[lo : hi + 1] = False
                for path, pos in latest.items():
                    keep[pos], first[pos] = True, earliest[path]
            live = order[keep]
            small = np.int32 if len(order) < 2**31 else np.int64
            self._live = (ordered[keep], live.astype(small))
            self._listed = live[np.argsort(first[keep], kind="stable")].astype(small)
            del order, ordered, keep, first
            shard = np.array(self._col["shard"], dtype=np.int64)[live]
            self._counts = np.bincount(shard, minlength=len(self.strings))
            self._roots = (
                np.unique(np.array(self._col["root"], dtype=np.int64)[live]).tolist()
                if len(live)
                else []
            )
        return self._live

    def _find(self, path: str) -> int:
        """The row of `path`'s latest line, or -1 (its folder code and name bytes compared, not rebuilt)."""
        hashes, rows = self._live or self._index()
        h = hash(path)
        i, n = int(hashes.searchsorted(h)), len(hashes)
        if i == n or hashes[i] != h:
            return -1
        cut = path.rfind("/") + 1
        folder, name = self.codes.get(path[:cut]), path[cut:].encode("utf-8", "surrogatepass")
        ends, dirs = self._col["name_end"], self._col["dir"]
        while i < n and hashes[i] == h:  # several only if two paths share a hash
            r = int(rows[i])
            if dirs[r] == folder and self._names[ends[r - 1] if r else 0 : ends[r]] == name:
                return r
            i += 1
        return -1

    def _live_rows(self) -> Iterator[int]:
        """Each file's latest row, files in the order they first appear, a chunk at a time (no list of all)."""

        self._index()
        rows = self._listed
        for lo in range(0, len(rows), CHUNK):
            yield from rows[lo : lo + CHUNK].tolist()

    @property
    def superseded(self) -> int:
        """Lines a later line for the same path replaces."""
        return self.lines - self.unreadable - len(self)

    def __len__(self) -> int:
        return len(self._index()[0])

    def __bool__(self) -> bool:
        # a ledger is OUT's manifest, read or not yet: `ledger or another` must never swap an unread
        # (empty) one for a second that its caller never sees (a compaction once deleted every shard so)
        return True

    def __contains__(self, path) -> bool:
        return self._find(path) >= 0

    def __iter__(self) -> Iterator[str]:
        return (self._path(r) for r in self._live_rows())

    def _entry(self, r: int) -> Entry:
        c, s = self._col, self.strings
        return Entry(
            c["size"][r],
            c["mtime"][r],
            c["offset"][r],
            c["tokens"][r],
            c["index"][r],
            s[c["shard"][r]],
            s[c["status"][r]] or "",  # every row has a status and a kind: code 0 never stands here
            s[c["kind"][r]] or "",
            s[c["root"][r]],
        )

    def entry(self, path: str) -> Entry:
        """The latest row's entry of a path the manifest holds (KeyError for one it does not)."""
        found = self.get(path)
        if found is None:
            raise KeyError(path)
        return found

    def get(self, path: str) -> Entry | None:
        r = self._find(path)
        return self._entry(r) if r >= 0 else None

    def entries(self) -> Iterator[tuple[str, Entry]]:
        """(path, latest row) of every file, in the order files first appear; one at a time."""
        for r in self._live_rows():
            yield self._path(r), self._entry(r)

    def digest(self, path: str) -> str | None:
        r = self._find(path)
        if r < 0 or not self._sha or not self._sha[33 * r]:
            return None
        return self._sha[33 * r + 1 : 33 * r + 33].hex()

    def known_kind(self, path: str, size: int, mtime_ns: int) -> str | None:
        """The kind the latest row records, if that row is for this very size and mtime."""
        r = self.match(path, size, mtime_ns)
        return self.strings[self._col["kind"][r]] if r >= 0 else None

    def match(self, path: str, size: int, mtime_ns: int) -> int:
        """The row of `path`'s latest line if it is for this very size and mtime, else -1.

        A row number names one readable manifest line while the file only grows: see status_at, kind_at, live."""
        r = self._find(path)
        return r if r >= 0 and (self._col["size"][r], self._col["mtime"][r]) == (size, mtime_ns) else -1

    def status_at(self, r: int) -> str | None:
        return self.strings[self._col["status"][r]]

    def kind_at(self, r: int) -> str | None:
        return self.strings[self._col["kind"][r]]

    @property
    def rows_read(self) -> int:
        """Rows in the columns: the lines read less the unreadable ones (row numbers run below it)."""
        return len(self._col["offset"])

    def live(self):
        """One bool per row read: whether it is its path's latest row (numpy, a byte a line)."""
        import numpy as np

        mask = np.zeros(self.rows_read, dtype=bool)
        mask[self._index()[1]] = True
        return mask

    def path_reader(self):
        """r → (path, root it records) of the lines read so far, from these very columns: still
        readable after a refresh that starts over on a replaced manifest (they are then kept)."""
        col, names, strings = self._col, self._names, self.strings
        return lambda r: (_path_in(col, names, strings, r), strings[col["root"][r]])

    def same_rel(self, rel: str, size: int) -> Iterator[tuple[str, Entry]]:
        """Latest ok rows of another root with this rel and size: where a moved root's file was."""
        self._index()
        for code in (c for c in self._roots if c):
            root = self.strings[code]
            assert root is not None  # code 0 (None) is left out above
            path = os.path.join(root, rel)
            entry = self.get(path)
            if (
                entry is not None
                and entry.status == Status.OK
                and entry.size == size
                and entry.root == root
            ):
                yield path, entry

    def shards(self) -> set[str]:
        """Shards that some latest row names (a shard only superseded rows name is dead)."""
        self._index()
        return {self.strings[code] for code in self._counts.nonzero()[0].tolist() if code}

    def row(self, path: str) -> dict:
        """The whole latest row, read from its offset."""
        return next(self.rows_at([self.entry(path).offset]))

    def rows_at(self, offsets, rising: bool = True) -> Iterator[dict]:
        """Rows at these offsets (read in rising order, one pass over the file; or as given)."""
        with self._open() as f:
            for offset in sorted(offsets) if rising else offsets:
                f.seek(offset)
                yield json.loads(f.readline())

    def ok_by_shard(self) -> tuple[dict, list[str]]:
        """(shard → rising offsets of the ok latest rows in it, as numpy arrays; paths of ok rows that
        name no shard or index): what verify checks, 8 bytes an encoded file, no Python int each."""
        import numpy as np

        self._index()
        rows, c = self._listed, self._col
        shard = np.array(c["shard"], dtype=np.uint32)[rows]
        code = self.codes.get(Status.OK)  # None: no row is ok
        ok = (
            np.array(c["status"], dtype=np.uint32)[rows] == code
            if code
            else np.zeros(len(rows), dtype=bool)
        )
        placed = (shard != 0) & (np.array(c["index"], dtype=np.int32)[rows] >= 0)
        unplaced = [self._path(int(r)) for r in rows[ok & ~placed].tolist()]
        keep = ok & placed
        shard, offsets = shard[keep], np.array(c["offset"], dtype=np.int64)[rows[keep]]
        del keep, ok, placed
        order = np.lexsort((offsets, shard))  # by shard, then offset
        shard, offsets = shard[order], offsets[order]
        starts = (
            np.flatnonzero(np.r_[True, shard[1:] != shard[:-1]])
            if len(shard)
            else np.zeros(0, dtype=np.int64)
        )
        ends = np.r_[starts[1:], len(shard)]
        return {
            self.strings[int(shard[a])]: offsets[a:b] for a, b in zip(starts.tolist(), ends.tolist())
        }, unplaced

    def live_offsets(self):
        """Offsets of the latest lines, rising (a numpy array: 8 bytes a file)."""
        import numpy as np

        return np.sort(np.array(self._col["offset"], dtype=np.int64)[self._index()[1]])


_HEX64 = re.compile(r"[0-9a-f]{64}\Z")
_PLAIN = re.compile(r"[^/\\\x00.][^/\\\x00]*\Z")  # a file name of OUT's own: no folder, not hidden


def _schema_ok(row: dict) -> bool:
    """A row every reader can act on (docs/format.md): its status and kind are names, a sha256 is
    64 hex digits, a shard is a plain name in OUT (no `/`, so no `../` and no absolute path) and an
    index is an integer at or above 0 (a reader checks it against the shard's length). A row that
    is not is left out, as a torn line is: one row from a hostile or broken manifest never hands a
    reader another file's tokens nor a file outside OUT, and stops no command (docs/security.md).
    (An ok row naming no shard is kept: verify reports it, and there is nothing to read.)"""
    status, kind, digest = row.get("status"), row.get("kind", ""), row.get("sha256")
    if not isinstance(status, str) or not isinstance(kind, (str, type(None))):
        return False
    if digest is not None and not (isinstance(digest, str) and _HEX64.match(digest)):
        return False
    index, shard = row.get("index"), row.get("shard")
    if index is not None and not (type(index) is int and index >= 0):
        return False
    return shard is None or (isinstance(shard, str) and _PLAIN.match(shard) is not None)


def _path_in(col: dict, names: bytearray, strings: list, r: int) -> str:
    ends = col["name_end"]
    return strings[col["dir"][r]] + names[ends[r - 1] if r else 0 : ends[r]].decode(
        "utf-8", "surrogatepass"
    )


def _runs(positions: list[int]) -> Iterator[tuple[int, int]]:
    """Rising positions i (each meaning i and i + 1 go together) → (first, last) of each run."""
    lo: int | None = None
    prev = 0
    for i in positions:
        if lo is None or i != prev + 1:
            if lo is not None:
                yield lo, prev + 1
            lo = i
        prev = i
    if lo is not None:
        yield lo, prev + 1


def _fits(value, lo: int, hi: int) -> bool:
    return isinstance(value, int) and lo <= value < hi


def _int(value) -> int:
    return value if _fits(value, -(1 << 63), 1 << 63) else -1
