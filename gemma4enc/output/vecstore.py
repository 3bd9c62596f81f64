"""search's cache beside the shards: each latest ok file's pooled vector, L2-normalised, in float16,
one id a file, and the index ann.py chooses over them; kept current as OUT grows.

    search-index.json         what it was built from: the manifest's bytes read, digests of their
                              head and tail, the ids, the width, the index chosen
    search-index.vectors      (ids, D) float16 unit vectors, raw, read by row (pread): id i is row i
    search-index.rows.npy     per id: a stable hash of its path, size, mtime_ns, where its path
                              is in .paths, and `dead` (the tombstone of a superseded or failed file)
    search-index.paths        the ids' paths, UTF-8, one after another
    search-index.faiss        the IVF index, where the size calls for one (ann.py)

A run appends to the manifest, so the cache reads on from the bytes it had read: a later row for
a file already there turns its old id dead (a tombstone, filtered out of every search), and an ok
one adds a new id (to the vectors and to the IVF index). Where the head or tail digest no longer
matches (compaction, --overwrite, a replaced manifest), the cache is built again from the shards;
where a quarter of the ids are dead or the size calls for another index, it is rebuilt from its
own vectors. On a store OUT the files are fetched beside its working copy's manifest and uploaded
back when they change. A folder that cannot be written gets the cache in a temporary folder, once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import mmap
import os
import shutil
import tempfile
import time
import weakref
from pathlib import Path

import numpy as np

from ..errors import UsageError
from ..rows import Status
from . import ann
from .vecfile import VectorFile
from .files import atomic_write, bounded_lines, own_opener
from .names import MANIFEST, not_an_output, temp_name
from .out import Out
from .npreader import NumpyEmbeddings, Shard
from .vectors import shard_records, hidden_size, placed, records

META, VECTORS, ROWS, PATHS, FAISS, LOCK = (
    "search-index.json", "search-index.vectors", "search-index.rows.npy", "search-index.paths",
    "search-index.faiss", "search-index.lock",
)
FILES = (META, VECTORS, ROWS, PATHS, FAISS, LOCK)
VERSION = 2
SPAN = 1 << 16  # manifest bytes digested at the head and at the tail of what was read
ROW = np.dtype([("hash", "<u8"), ("size", "<i8"), ("mtime", "<i8"), ("start", "<i8"), ("stop", "<i8"),
                ("dead", "?")])
CHUNK = 1 << 14  # rows read, normalised and written at once
LOCK_WAIT = 120.0  # seconds another process may hold the cache's lock while it updates it
DEAD_SHARE = 0.25  # rebuilt from its own vectors past this share of dead ids
SCANS = 8  # lookups by a scan of the hashes (~2 ms at 1 M ids) before they are sorted (~0.1 s) once


def path_hash(path: str) -> int:
    return int.from_bytes(hashlib.blake2b(path.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


def unit16(vectors: np.ndarray) -> np.ndarray:
    v = np.asarray(vectors, np.float32)
    norms = np.linalg.norm(v, axis=1, keepdims=True)
    return (v / np.where(norms > 0, norms, 1)).astype(np.float16)


class Cache:
    """The vectors and their index, open: `search(queries, k)`, `find(path)`, `path(id)`, `vector(id)`."""

    def __init__(self, folder: Path, meta: dict, rows: np.ndarray):
        self.folder, self.meta, self.rows = folder, meta, rows
        self.n, self.dim, self.spec = meta["n"], meta["dim"], meta["spec"]
        self.vectors = VectorFile(folder / VECTORS, self.n, self.dim)
        self._paths_map = self._map(PATHS, int(rows["stop"][-1]) if self.n else 0)
        self.dead = rows["dead"]
        self._order: np.ndarray | None = None
        self._sorted: np.ndarray = np.zeros(0, np.uint64)  # the hashes in _order's order, once sorted
        self._scans = 0
        self.index = ann.read(folder / FAISS) if self.spec["kind"] == "ivfpq" else None

    def _map(self, name: str, size: int):
        if size == 0:
            return b""
        with open(self.folder / name, "rb") as f:
            return mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)

    @property
    def live(self) -> int:
        return int(self.n - self.dead.sum())

    def path(self, i: int) -> str:
        row = self.rows[i]
        return bytes(self._paths_map[row["start"]:row["stop"]]).decode("utf-8", "surrogatepass")

    def find(self, path: str) -> int:
        """The live id of `path`, or -1."""
        hashes = self.rows["hash"]
        h = np.uint64(path_hash(path))
        if self._order is None and self._scans < SCANS:  # a few lookups: a scan each, no sort
            self._scans += 1
            same = np.flatnonzero(hashes == h).tolist()
        else:
            if self._order is None:  # 16 bytes an id, small beside the vectors
                self._order = np.argsort(hashes, kind="stable")
                self._sorted = hashes[self._order]
            lo = hi = int(np.searchsorted(self._sorted, h))
            while hi < self.n and self._sorted[hi] == h:
                hi += 1
            same = self._order[lo:hi].tolist()
        return next((i for i in same if not self.dead[i] and self.path(i) == path), -1)

    def vector(self, i: int) -> np.ndarray:
        return np.asarray(self.vectors[i], np.float32)

    def search(self, queries: np.ndarray, k: int, nprobe=None) -> tuple[np.ndarray, np.ndarray]:
        """(scores, ids), (len(queries), min(k, live)), best first, ties by id; exact cosines."""
        queries = np.ascontiguousarray(queries, np.float32)
        k = min(k, self.live)
        if k < 1:  # every file gone: no hit
            return np.zeros((len(queries), 0), np.float32), np.zeros((len(queries), 0), np.int64)
        if self.index is not None:
            return ann.ivf_search(self.index, self.spec, self.vectors, self.dead, queries, k, nprobe)
        return ann.flat_search(self.vectors, self.dead, queries, k)

    def release(self) -> None:
        """Nothing to let go: the vectors are read, not mapped (a pass over all holds none)."""

    def live_ids(self) -> np.ndarray:
        return np.flatnonzero(~self.dead)


def open_cache(out, log=lambda message: None, rebuild: bool = False) -> Cache:
    """OUT's cache, current with its manifest: read as it is, read on, or built (and kept in OUT)."""
    if not out.found():
        raise UsageError(not_an_output(out))
    out.fetch_files((META, ROWS, PATHS, VECTORS, FAISS))  # a store keeps the cache beside its shards
    try:
        cache, changed = _current(out, out.folder, log, rebuild)
    except OSError as e:
        if not isinstance(e, PermissionError) and e.errno not in (30, 13):  # EROFS, EACCES
            raise
        log(f"the search index is not cached in {out} ({e.strerror or e}); it is built again next time")
        folder = Path(tempfile.mkdtemp(prefix="gemma4enc-index-"))
        cache, changed = _current(out, folder, log, True)
        weakref.finalize(cache, shutil.rmtree, folder, True)  # removed with the cache
    if changed:
        out.send_files((ROWS, PATHS, VECTORS, FAISS), last=META)  # the meta last: all old or all new
    return cache


def _current(out: Out, folder: Path, log, rebuild: bool) -> tuple[Cache, bool]:
    with _locked(folder):
        meta = None if rebuild else _meta(folder)
        state = _state(out, folder, meta) if meta else "none"
        if state == "grown":
            assert meta is not None
            _append(out, folder, meta, log)
        elif state == "none":
            _build(out, folder, log)
        cache = _load(folder)
        if _needs_rebuild(cache):
            log(f"rebuilding the search index: {cache.live:,} of {cache.n:,} ids live")
            _compact(cache, folder, out)
            cache = _load(folder)
            state = "rebuilt"
    return cache, state != "fresh"


@contextlib.contextmanager
def _locked(folder: Path):
    """One process updates the cache at a time; a wait past LOCK_WAIT ends in a usage error."""
    with open(folder / LOCK, "a+b", opener=own_opener) as f:
        deadline = time.monotonic() + LOCK_WAIT
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise UsageError(f"{folder / LOCK}: another search has been updating the index for "
                                     f"{LOCK_WAIT:.0f} s; try again when it is done") from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _meta(folder: Path) -> dict | None:
    try:
        meta = json.loads((folder / META).read_text())
        return meta if meta.get("version") == VERSION else None
    except (OSError, ValueError):
        return None


def _digests(manifest: Path, end: int) -> dict:
    with open(manifest, "rb") as f:
        head = f.read(min(end, SPAN))
        f.seek(max(0, end - SPAN))
        tail = f.read(end - max(0, end - SPAN))
    return {"head": hashlib.blake2b(head).hexdigest(), "tail": hashlib.blake2b(tail).hexdigest()}


def _state(out: Out, folder: Path, meta: dict) -> str:
    """fresh (as read), grown (rows appended since) or none (built again)."""
    try:
        st = os.stat(out.path(MANIFEST))
        sizes_ok = (folder / ROWS).stat().st_size == meta["rows_bytes"] and (
            (folder / VECTORS).stat().st_size >= meta["n"] * meta["dim"] * 2)
        if meta["spec"]["kind"] == "ivfpq":
            sizes_ok = sizes_ok and (folder / FAISS).stat().st_size == meta["faiss_bytes"]
    except (OSError, KeyError):
        return "none"
    local = out.in_place  # a store's manifest is a new copy every time: its bytes decide
    if not sizes_ok or st.st_size < meta["end"] or (local and st.st_ino != meta["ino"]):
        return "none"
    if _digests(out.path(MANIFEST), meta["end"]) != meta["digests"]:
        return "none"
    return "fresh" if st.st_size == meta["end"] else "grown"


def _load(folder: Path) -> Cache:
    meta = _meta(folder)
    assert meta is not None, f"{folder / META}: written before the cache is loaded"
    rows = np.load(folder / ROWS, mmap_mode="r")  # mapped, not copied: a query reads a few of 1 M rows
    return Cache(folder, meta, rows)


def _ok(row: dict) -> bool:
    return row.get("status") == Status.OK and bool(row.get("shard")) and isinstance(row.get("index"), int) \
        and row["index"] >= 0


class _Writer:
    """Appends ids: vectors, paths and rows, from the id `n` on (a killed append's tail is cut)."""

    def __init__(self, folder: Path, n: int, dim: int, rows: np.ndarray, fresh: bool):
        mode = "wb" if fresh else "r+b"
        self.vectors = open(folder / VECTORS, mode, opener=own_opener)  # never through a link
        self.paths = open(folder / PATHS, mode, opener=own_opener)
        self.vectors.truncate(n * dim * 2)
        self.vectors.seek(n * dim * 2)
        end = int(rows["stop"][n - 1]) if n else 0
        self.paths.truncate(end)
        self.paths.seek(end)
        self.rows, self.added, self.at = [rows[:n]], 0, end

    def add(self, vectors: np.ndarray, rows: list[dict]) -> None:
        self.vectors.write(unit16(vectors).tobytes())
        block = np.zeros(len(rows), ROW)
        for j, row in enumerate(rows):
            name = row["path"].encode("utf-8", "surrogatepass")
            self.paths.write(name)
            block[j] = (path_hash(row["path"]), _int(row.get("size")), _int(row.get("mtime_ns")), self.at,
                        self.at + len(name), False)
            self.at += len(name)
        self.rows.append(block)
        self.added += len(rows)

    def close(self) -> np.ndarray:
        for f in (self.vectors, self.paths):
            f.flush()
            os.fsync(f.fileno())
            f.close()
        return np.concatenate(self.rows)


def _int(value) -> int:
    return value if isinstance(value, int) and -(1 << 63) <= value < 1 << 63 else -1


def _build(out: Out, folder: Path, log) -> None:
    """Every latest ok row's vector, from the shards, then the index the size calls for."""
    emb = NumpyEmbeddings(out)
    end, ino = emb.ledger.end, emb.ledger.ino
    shards = placed(emb)
    n = sum(len(v) for v in shards.values())
    if not n:
        raise UsageError(f"{out}: no encoded file to search")
    dim = hidden_size(emb, shards)
    log(f"building the search index of {n:,} files")
    writer = _Writer(folder, 0, dim, np.zeros(0, ROW), fresh=True)
    block = np.empty((CHUNK, dim), np.float32)
    rows: list = []
    for rec in records(emb, shards=shards):
        block[len(rows)] = rec.pooled
        rows.append(rec.row)
        if len(rows) == CHUNK:
            writer.add(block, rows)
            rows = []
    if rows:
        writer.add(block[: len(rows)], rows)
    all_rows = writer.close()
    _finish(folder, out, all_rows, dim, end, ino, ann.choose(n, dim))


def _finish(folder: Path, out: Out, rows: np.ndarray, dim: int, end: int, ino: int, spec: dict,
            index=None) -> None:
    """The IVF index trained and filled where the spec calls for one (or `index` as updated), the
    rows, and last the meta: until it is replaced, readers see the cache as it was."""
    n = len(rows)
    faiss_bytes = 0
    if spec["kind"] == "ivfpq":
        if index is None:
            vectors = VectorFile(folder / VECTORS, n, dim)
            live = np.flatnonzero(~rows["dead"])
            want = min(len(live), max(spec["nlist"] * ann.TRAIN_PER_LIST, ann.TRAIN_MIN))
            sample = np.sort(np.random.default_rng(0).choice(live, want, replace=False))
            index = ann.build(spec, dim, vectors[sample].astype(np.float32))
            for lo in range(0, n, 1 << 16):
                index.add(vectors[lo: lo + (1 << 16)].astype(np.float32))
        faiss = ann.faiss_or_none()
        atomic_write(folder / FAISS, lambda tmp: faiss.write_index(index, str(tmp)))
        faiss_bytes = (folder / FAISS).stat().st_size
    else:
        (folder / FAISS).unlink(missing_ok=True)

    def save(tmp):
        with open(tmp, "wb") as f:
            np.save(f, rows)

    atomic_write(folder / ROWS, save)
    meta = {"version": VERSION, "n": n, "dim": dim, "spec": spec, "end": end, "ino": ino,
            "digests": _digests(out.path(MANIFEST), end), "rows_bytes": (folder / ROWS).stat().st_size,
            "faiss_bytes": faiss_bytes}
    atomic_write(folder / META, lambda tmp: tmp.write_text(json.dumps(meta)))


def _append(out: Out, folder: Path, meta: dict, log) -> None:
    """The rows appended to the manifest since: superseded ids dead, ok rows' vectors added."""
    latest: dict[str, dict] = {}
    read = 0  # bytes of whole lines past meta["end"]
    with open(out.path(MANIFEST), "rb", opener=own_opener) as f:
        f.seek(meta["end"])
        for line, size, whole in bounded_lines(f):  # a line past LINE_MAX is no row: never held
            if not whole:
                break  # a torn tail
            read += size
            try:
                row = json.loads(line) if line is not None else None
            except ValueError:
                continue
            if isinstance(row, dict) and isinstance(row.get("path"), str):
                latest.pop(row["path"], None)
                latest[row["path"]] = row  # later rows replace earlier ones, and come later
    cache = _load(folder)
    rows = cache.rows.copy()
    for path in latest:
        i = cache.find(path)
        if i >= 0:
            rows["dead"][i] = True
    new = [r for r in latest.values() if _ok(r)]
    log(f"search index: {len(new):,} files added, {int(rows['dead'].sum() - cache.dead.sum()):,} superseded")
    index = None
    if cache.index is not None:
        index = ann.read(folder / FAISS, mmap=False)
    n, dim = cache.n, cache.dim
    del cache  # its maps closed before the files are appended to
    writer = _Writer(folder, n, dim, rows, fresh=False)
    for vectors, chunk in _new_vectors(out, new, dim):
        writer.add(vectors, chunk)
        if index is not None:
            index.add(unit16(vectors).astype(np.float32))
    rows = writer.close()
    ino = os.stat(out.path(MANIFEST)).st_ino
    _finish(folder, out, rows, dim, meta["end"] + read, ino, meta["spec"], index)


def _new_vectors(out: Out, new: list[dict], dim: int):
    """(vectors, rows) of the appended ok rows, shard by shard, read as the full build reads them."""
    by_shard: dict[str, list[dict]] = {}
    for row in new:
        by_shard.setdefault(row["shard"], []).append(row)
    for name in sorted(by_shard):
        rows = sorted(by_shard[name], key=lambda r: r["index"])
        try:
            shard = Shard(out.shard_path(name))
        except (OSError, ValueError) as e:
            raise UsageError(f"{out.named(name)}: {getattr(e, 'strerror', None) or e}; "
                             f"gemma4enc verify {out} --repair encodes its files again") from None
        try:
            pooled = np.stack([rec.pooled for rec in shard_records(shard, rows, False, False)])
        finally:
            out.drop(name)
        yield pooled.reshape(len(rows), dim), rows


def _needs_rebuild(cache: Cache) -> bool:
    spec = ann.choose(cache.live, cache.dim)
    if cache.dead.sum() > DEAD_SHARE * cache.n:
        return True
    if spec["kind"] != cache.spec["kind"]:
        return spec["kind"] == "ivfpq" or cache.live * 4 < cache.spec.get("trained_n", 0)
    return spec["kind"] == "ivfpq" and cache.live > 4 * cache.spec["trained_n"]


def _compact(cache: Cache, folder: Path, out: Out) -> None:
    """The cache rebuilt from its own live vectors (no shard read): tombstones gone, index chosen anew."""
    live = cache.live_ids()
    meta, dim = cache.meta, cache.dim
    tmp, paths_tmp = folder / temp_name(VECTORS), folder / temp_name(PATHS)  # what repair clears
    rows = np.zeros(len(live), ROW)
    at = 0
    with open(tmp, "xb") as v, open(paths_tmp, "xb") as p:  # new names nobody could plant
        for lo in range(0, len(live), CHUNK):
            ids = live[lo: lo + CHUNK]
            v.write(np.ascontiguousarray(cache.vectors[ids]).tobytes())
            for j, i in enumerate(ids.tolist()):
                name = bytes(cache._paths_map[cache.rows["start"][i]:cache.rows["stop"][i]])
                p.write(name)
                r = cache.rows[i]
                rows[lo + j] = (r["hash"], r["size"], r["mtime"], at, at + len(name), False)
                at += len(name)
    del cache
    (folder / META).unlink()  # the old meta must not describe the new files, even for a moment
    os.replace(tmp, folder / VECTORS)
    os.replace(paths_tmp, folder / PATHS)
    _finish(folder, out, rows, dim, meta["end"], meta["ino"], ann.choose(len(live), dim))
