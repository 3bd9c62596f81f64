"""Nearest files by cosine of the pooled vectors, and groups of near-duplicates (`gemma4enc search`).

The index is every latest ok row's pooled vector (vectors.records), L2-normalised, in float32.
With faiss installed it is an exact inner-product index (IndexFlatIP), saved in OUT and used
again while the manifest is unchanged; without faiss the same matrix is searched with numpy.
Both are exact: the same files, in the same order, with the same scores up to float32 rounding.
A file OUT does not hold, or holds for an older version of it (size or mtime changed), is
encoded with OUT's own settings.json, through encode's own pipeline, into a temporary folder.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np

from ..errors import UsageError
from ..output.files import MANIFEST, atomic_write, not_an_output
from ..output.npreader import NumpyEmbeddings, key_of
from ..output.settings import SEARCH_INDEX, SETTINGS, read_settings
from ..output.vectors import hidden_size, placed, records

INDEX, KEYS = (
    SEARCH_INDEX  # OUT's cached faiss index, and beside it the paths of its rows (--overwrite removes them)
)
BLOCK = 1024  # query rows scored at once for --duplicates (BLOCK × N scores in memory)


def _faiss():
    try:
        import faiss
    except ImportError:
        return None
    return faiss


def unit(vectors: np.ndarray) -> np.ndarray:
    """Rows scaled to length 1 (a zero row stays zero), float32."""
    vectors = np.asarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(vectors, axis=-1, keepdims=True)
    return vectors / np.where(norms > 0, norms, 1)


class Index:
    """OUT's pooled vectors, searchable: `search(queries, k)`, `pairs(threshold)`."""

    def __init__(self, paths: list[str], matrix: np.ndarray | None, faiss_index=None):
        self.paths, self.matrix, self.faiss = paths, matrix, faiss_index
        self.backend = "faiss" if faiss_index is not None else "numpy"

    def __len__(self) -> int:
        return len(self.paths)

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores, row numbers), each (len(queries), min(k, N)), best first; ties by row number."""
        k = min(k, len(self))
        if self.faiss is not None:
            scores, ids = self.faiss.search(np.ascontiguousarray(queries, np.float32), k)
        else:
            sims = queries @ self.matrix.T
            if k < len(self):
                ids = np.argpartition(-sims, k - 1, axis=1)[:, :k]
            else:
                ids = np.tile(np.arange(len(self)), (len(queries), 1))
            scores = np.take_along_axis(sims, ids, 1)
        order = np.lexsort((ids, -scores), axis=1)
        return np.take_along_axis(scores, order, 1), np.take_along_axis(ids, order, 1)

    def pairs(self, threshold: float, vectors) -> list[tuple[int, int]]:
        """(i, j), i < j, of the rows whose cosine is at least `threshold`."""
        found = []
        for lo in range(0, len(self), BLOCK):
            block = vectors(lo, min(lo + BLOCK, len(self)))
            if self.faiss is not None:
                # range_search keeps scores above the radius; the bound is then applied as numpy does
                lims, scores, ids = self.faiss.range_search(block, threshold - 1e-4)
                rows = np.repeat(np.arange(len(block)), np.diff(lims.astype(np.int64)))
                keep = scores >= threshold
                rows, ids = rows[keep] + lo, ids[keep]
            else:
                rows, ids = np.nonzero(block @ self.matrix.T >= threshold)
                rows = rows + lo
            found += [(int(a), int(b)) for a, b in zip(rows.tolist(), ids.tolist()) if a < b]
        return found


def _stamp(out: Path) -> dict:
    """What the manifest was when the index was built: any run, compaction or overwrite changes it."""
    st = os.stat(out / MANIFEST)
    return {
        "manifest_inode": st.st_ino,
        "manifest_size": st.st_size,
        "manifest_mtime_ns": st.st_mtime_ns,
    }


def load_index(
    out: Path, log=lambda message: None, use_faiss: bool = True
) -> tuple[Index, NumpyEmbeddings]:
    """OUT's index: the cached faiss one while the manifest is unchanged, else built (and cached)."""
    out = Path(out)
    if not (out / MANIFEST).exists():
        raise UsageError(not_an_output(out))
    stamp = _stamp(
        out
    )  # before the manifest is read: rows appended meanwhile make the cache stale, never wrong
    emb = NumpyEmbeddings(out)
    faiss = _faiss() if use_faiss else None
    if faiss is not None:
        try:
            keys = json.loads((out / KEYS).read_text())
            if keys.get("stamp") == stamp:
                return Index(keys["paths"], None, faiss.read_index(str(out / INDEX))), emb
        except (OSError, ValueError, RuntimeError, KeyError):
            pass  # none yet, or unreadable: built again
    if faiss is None:
        paths, matrix = _matrix(emb)
        return Index(paths, matrix), emb
    paths, index = _matrix(emb, faiss)
    def write_index(tmp: Path) -> None:
        open(tmp, "wb").close()  # an unwritable OUT is Python's OSError, not faiss's C++ text
        faiss.write_index(index, str(tmp))

    try:
        atomic_write(out / INDEX, write_index)
        atomic_write(
            out / KEYS, lambda tmp: tmp.write_text(json.dumps({"stamp": stamp, "paths": paths}))
        )
    except (OSError, RuntimeError) as e:
        why = getattr(e, "strerror", None) or str(e).strip().splitlines()[-1]
        log(f"the index is not cached in {out} ({why}); it is built again next time")
    return Index(paths, None, index), emb


def _matrix(emb: NumpyEmbeddings, faiss=None):
    """(paths, the unit vectors): a numpy matrix, or with faiss an IndexFlatIP filled block by block
    (the vectors are held once, in the index)."""
    shards = placed(emb)
    n, dim = sum(len(v) for v in shards.values()), hidden_size(emb, shards)
    if not n:
        raise UsageError(f"{emb.out}: no encoded file to search")
    index = faiss.IndexFlatIP(dim) if faiss is not None else None
    matrix = np.empty((n if index is None else min(n, BLOCK), dim), np.float32)
    paths = []
    for rec in records(emb, shards=shards):
        matrix[len(paths) % len(matrix)] = rec.pooled
        paths.append(rec.row["path"])
        if index is not None and (len(paths) % len(matrix) == 0 or len(paths) == n):
            index.add(unit(matrix[: (len(paths) - 1) % len(matrix) + 1]))
    if index is not None:
        return paths, index
    norms = np.linalg.norm(matrix, axis=1, keepdims=True)
    matrix /= np.where(norms > 0, norms, 1)  # in place: the matrix is the largest thing held
    return paths, matrix


def search(
    out,
    files: list[str],
    k: int = 10,
    device: str = "auto",
    bar=None,
    log=lambda message: None,
    use_faiss: bool = True,
) -> dict:
    """The k nearest files of each of `files`; a file OUT lacks is encoded with OUT's settings."""
    if k < 1:
        raise UsageError(f"-k {k}: must be at least 1")
    for f in files:
        if os.path.isdir(f):
            raise UsageError(
                f"{f}: a folder; search takes files (encode a folder into OUT, then --duplicates)"
            )
    index, emb = load_index(Path(out), log, use_faiss)
    queries, sources, errors = {}, {}, {}
    new = []
    for f in files:
        members = _tar_members(f)
        if members is not None:  # a WebDataset tar: its members are the queries, OUT's rows if it has them
            fresh = [m for m in members if m not in emb]
            new += [key_of(f)] if fresh else []
            sources |= {m: "encoded" if m in fresh else "out" for m in members}
            continue
        path = key_of(f)
        row = emb.rows.get(path) if path in emb else None
        if row is not None and _unchanged(path, row):
            sources[f] = "out"
        elif os.path.exists(path):
            new.append(path)
            sources[f] = "encoded"
        else:
            errors[f] = "no such file, and not in OUT"
    positions = {p: i for i, p in enumerate(index.paths)} if sources else {}
    if new:
        log(f"encoding {len(new)} file(s) {out} lacks, with its settings")
    # its own log stays quiet: its lines (model loaded, worker advice, a temp OUT's manifest) are
    # about a run the user did not start; a query that fails says why in the results
    encoded = encode_files(Path(out), new, device, bar, lambda message: None) if new else {}
    for f, source in sources.items():
        path = key_of(f)
        if source == "out":
            i = positions[path]
            queries[f] = index.matrix[i] if index.matrix is not None else index.faiss.reconstruct(i)
        elif isinstance(encoded.get(path), np.ndarray):
            queries[f] = unit(encoded[path])
        else:
            errors[f] = encoded.get(path, "not encoded")
    results = []
    if queries:
        scores, ids = index.search(np.stack(list(queries.values())), k)
    for n, (f, query) in enumerate(queries.items()):
        hits = [(float(s), i) for s, i in zip(scores[n], ids[n].tolist())]
        if sources[f] == "out":  # itself first, even among exact copies of it (equal scores)
            own = positions[key_of(f)]
            hits = [(float(query @ query), own), *[(s, i) for s, i in hits if i != own]][: len(hits)]
        hits = [{"path": index.paths[i], "score": round(s, 6)} for s, i in hits]
        results.append({"file": f, "path": key_of(f), "source": sources[f], "hits": hits})
    failed = [{"file": f, "path": key_of(f), "error": e} for f, e in errors.items()]
    return {
        "out": str(out),
        "backend": index.backend,
        "rows": len(index),
        "results": results,
        "failed": failed,
    }


def _tar_members(f: str) -> list[str] | None:
    """A local WebDataset tar's media members as OUT keys them (TAR/MEMBER); None for any other file."""
    from ..media import webdataset

    if not webdataset.is_tar(f) or not os.path.isfile(f):
        return None
    tar = key_of(f)
    try:
        handle, found, _ = webdataset.members(tar)
    except Exception:  # noqa: BLE001 - not a tar after all: encoded as a file, and its row says why
        return None
    handle.close()
    return [f"{tar}/{name}" for name in found]


def _unchanged(path: str, row: dict) -> bool:
    """The file on disk is the one the row encoded (or it is gone, and OUT's vector is all there is)."""
    try:
        st = os.stat(path)
    except OSError:
        return True
    return (st.st_size, st.st_mtime_ns) == (row.get("size"), row.get("mtime_ns"))


def encode_files(out: Path, paths: list[str], device: str, bar, log) -> dict:
    """path → pooled vector (float32), or the reason it has none: each encoded as OUT's settings say."""
    from ..media.discover import discover
    from ..options import Options
    from .encode import encode_files as run

    saved = read_settings(out)
    if saved is None:
        raise UsageError(
            f"{out}: no {SETTINGS}, so its settings are unknown; cannot encode new files like it"
        )
    options, _ = Options.resume(saved, {"device": device, "workers": 0})  # OUT's own settings, every one
    items, _ = discover(paths)
    with tempfile.TemporaryDirectory(prefix=f"gemma4enc-search-{os.getpid()}-") as tmp:
        run(items, Path(tmp) / "out", options, bar=bar or _NoBar, log=log)
        emb = NumpyEmbeddings(Path(tmp) / "out")
        found = {rec.row["path"]: rec.pooled for rec in records(emb)}
        for path in paths:
            if path not in found:
                row = emb.rows.get(path) or {}
                found[path] = f"status {row.get('status', 'not encoded')}: {row.get('error')}"
    return found


class _NoBar:
    def __init__(self, total: int):
        pass

    def advance(self, files: int, patches: int) -> None:
        pass

    def close(self) -> None:
        pass


def duplicates(out, threshold: float = 0.98, log=lambda message: None, use_faiss: bool = True) -> dict:
    """Groups of files whose pooled vectors are within `threshold` cosine of another in the group
    (linked: a near b and b near c puts a, b, c together), each in OUT's order."""
    if not -1 <= threshold <= 1:
        raise UsageError(f"--threshold {threshold}: a cosine, in [-1, 1]")
    index, _ = load_index(Path(out), log, use_faiss)
    if index.matrix is not None:
        vectors = lambda lo, hi: index.matrix[lo:hi]  # noqa: E731
    else:
        vectors = lambda lo, hi: index.faiss.reconstruct_n(lo, hi - lo)  # noqa: E731
    parent = list(range(len(index)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for a, b in index.pairs(threshold, vectors):
        ra, rb = root(a), root(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    groups: dict[int, list[int]] = {}
    for i in range(len(index)):
        groups.setdefault(root(i), []).append(i)
    found = [[index.paths[i] for i in members] for members in groups.values() if len(members) > 1]
    return {
        "out": str(out),
        "backend": index.backend,
        "rows": len(index),
        "threshold": threshold,
        "groups": found,
    }
