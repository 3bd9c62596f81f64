"""Nearest files by cosine of the pooled vectors, and groups of near-duplicates (`gemma4enc search`).

The vectors and their index live in OUT's search cache (output/vecstore.py: float16 unit vectors,
exact while small, IVF-PQ re-ranked exactly past that, kept current as OUT grows). `Searcher`
holds it open for many queries; `search()` and `duplicates()` are what the command runs.
A file OUT does not hold, or holds for an older version of it (size or mtime changed), is
encoded with OUT's own settings.json by the in-memory encoder (run/encoder.py): nothing is written.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np

from ..errors import UsageError
from ..output import ondisk
from ..output.opening import reading
from ..output.out import Out
from ..output.npreader import key_of
from ..output.names import SETTINGS
from ..output.vecstore import open_cache
from . import dedup

QUERY_BLOCK = 256  # queries searched at once (their candidates' float32 vectors: ~150 MB at width 1536)


def unit(vectors: np.ndarray) -> np.ndarray:
    """Rows scaled to length 1 (a zero row stays zero), float32."""
    vectors = np.asarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(vectors, axis=-1, keepdims=True)
    return vectors / np.where(norms > 0, norms, 1)


class Searcher:
    """OUT's index, open for many searches (a store OUT's mirror too, until `close()`).

        with Searcher("embeddings") as s:
            s.nearest("cat.jpg", k=5)      # [(path, score), ...], itself first when OUT holds it
            s.nearest_vector(v, k=5)       # any (D,) vector
    """

    def __init__(self, out, device: str = "auto", log=lambda message: None, rebuild: bool = False,
                 nprobe: int | None = None):
        self.out, self.device, self.log, self.nprobe = out, device, log, nprobe  # nprobe: IVF lists searched
        self._stack = contextlib.ExitStack()
        try:
            # an Out is the caller's to close; OUT as named is opened (and closed) here
            self.out = out if isinstance(out, Out) else self._stack.enter_context(reading(out))
            self.cache = open_cache(self.out, log, rebuild)
        except BaseException:
            self._stack.close()
            raise

    def __enter__(self) -> Searcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()

    def __len__(self) -> int:
        return self.cache.live

    def nearest(self, file, k: int = 10) -> list[tuple[str, float]]:
        """The k nearest of one file; KeyError saying why for one that can be neither found nor encoded."""
        report = self.query([os.fspath(file)], k)
        if report["failed"]:
            raise KeyError(f"{file}: {report['failed'][0]['error']}")
        return [(h["path"], h["score"]) for h in report["results"][0]["hits"]]

    def nearest_vector(self, vector, k: int = 10) -> list[tuple[str, float]]:
        scores, ids = self.cache.search(unit(np.atleast_2d(vector)), k, self.nprobe)
        return [(self.cache.path(i), float(s)) for s, i in zip(scores[0], ids[0].tolist()) if i >= 0]

    def query(self, files: list[str], k: int = 10, bar=None) -> dict:
        """results (per file: source, hits) and failed, as the command prints them."""
        if k < 1:
            raise UsageError(f"-k {k}: must be at least 1")
        cache = self.cache
        queries, sources, errors, own = {}, {}, {}, {}
        # a WebDataset tar: its members are the queries, OUT's rows where it has them
        tars = {f: _tar_members(f) for f in files}
        member_tar = {m: key_of(f) for f, members in tars.items() for m in members or []}
        files = [m for f in files for m in tars[f] or [f]]
        new = []
        for f in files:
            path = key_of(f)
            i = cache.find(path)
            tar = member_tar.get(f)
            if i >= 0 and (tar is not None or _unchanged(path, cache.rows[i])):
                sources[f], own[f] = "out", i
                queries[f] = cache.vector(i)  # as the rows are stored: a→b scores as b→a
            elif tar is not None or os.path.exists(path):
                new.append(tar or path)  # a member not in OUT: its tar is encoded, its rows are the members'
                sources[f] = "encoded"
            else:
                errors[f] = "no such file, and not in OUT"
        if new:
            tars = sum(1 for n in set(new) if n in member_tar.values())
            what = f"{len(set(new)) - tars} file(s)" + (f" and {tars} tar(s)" if tars else "")
            self.log(f"encoding {what} {self.out} lacks, with its settings")
        # encoded in memory, nothing written; a query that fails says why in the results
        encoded = encode_files(self.out, sorted(set(new)), self.device, bar) if new else {}
        for f in [f for f, s in sources.items() if s == "encoded"]:
            vector = encoded.get(key_of(f))
            if isinstance(vector, np.ndarray):  # rounded as the stored rows are: scores compare alike
                queries[f] = unit(vector).astype(np.float16).astype(np.float32)
            else:
                errors[f] = vector or "not encoded"
                del sources[f]
        names = [f for f in dict.fromkeys(files) if f in queries]  # in the order asked
        results = []
        for lo in range(0, len(names), QUERY_BLOCK):
            batch = names[lo: lo + QUERY_BLOCK]
            scores, ids = cache.search(np.stack([queries[f] for f in batch]), k, self.nprobe)
            for f, row_s, row_i in zip(batch, scores, ids):
                hits = [(float(s), i) for s, i in zip(row_s, row_i.tolist()) if i >= 0]
                if f in own:  # itself first, even among exact copies of it (equal scores)
                    hits = [(1.0, own[f]), *[(s, i) for s, i in hits if i != own[f]]][: len(hits)]  # its own cosine
                results.append({"file": f, "path": key_of(f), "source": sources[f],
                                "hits": [{"path": cache.path(i), "score": round(s, 6)} for s, i in hits]})
        failed = [{"file": f, "path": key_of(f), "error": e} for f, e in errors.items()]
        return {"out": str(self.out), "index": cache.spec["kind"], "rows": cache.live,
                "results": results, "failed": failed}


def query_files(files: list[str], files_from: str | None = None, null: bool = False) -> list[str]:
    """The files to search for: each FILE, a folder's media files (walked as encode walks it), and
    the lines of --files-from (`-`: stdin; `null`: NUL-separated), in that order, each once."""
    import sys

    from ..media.discover import discover

    listed = list(files or [])
    if files_from is not None:
        try:
            raw = sys.stdin.buffer.read() if files_from == "-" else Path(files_from).read_bytes()
        except OSError as e:
            raise UsageError(f"--files-from {files_from}: {e.strerror or e}") from None
        text = raw.decode("utf-8", "surrogateescape")
        listed += [n for n in text.split("\0") if n] if null else [line for line in text.splitlines() if line.strip()]
    found: list[str] = []
    for f in listed:
        if os.path.isdir(f):
            items, _ = discover([f])
            found += [item.path for item in items]
        else:
            found.append(key_of(f))  # as a folder's members come: absolute (a URL as written)
    return list(dict.fromkeys(found))


def search(out, files: list[str], k: int = 10, device: str = "auto", bar=None,
           log=lambda message: None) -> dict:
    """The k nearest files of each of `files`; a file OUT lacks is encoded with OUT's settings."""
    if k < 1:
        raise UsageError(f"-k {k}: must be at least 1")
    with Searcher(out, device, log) as searcher:
        return searcher.query(files, k, bar)


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


def _unchanged(path: str, row) -> bool:
    """The file on disk is the one the row encoded (or it is gone, and OUT's vector is all there is)."""
    try:
        st = os.stat(path)
    except OSError:
        return True
    return (st.st_size, st.st_mtime_ns) == (int(row["size"]), int(row["mtime"]))


def encode_files(out: Out, paths: list[str], device: str, bar=None) -> dict:
    """path → pooled vector (float32), or the reason it has none: each encoded as OUT's settings
    say, in memory (run/encoder.py), its vector as it would be read back from OUT."""
    import torch

    from ..model.hub import cache_only
    from ..options import Options
    from ..output.shards import pooled_as_read
    from .encoder import Encoder

    saved = out.settings()
    if saved is None:
        raise UsageError(
            f"{out}: no {SETTINGS}, so its settings are unknown; cannot encode new files like it"
        )
    options, _ = Options.resume(saved, {"device": device, "workers": 0})  # OUT's own settings, every one
    stored = options.pooled or options.store == "pooled"  # the means a shard keeps (vectors.records)
    # the model is the one OUT's settings.json names, and OUT may be someone else's: a hub id is
    # taken from the caches only, never fetched at their word (docs/security.md)
    why = (f"search does not fetch a model that an OUT's {SETTINGS} names ({out}: it may be someone "
           "else's; docs/security.md)")
    found: dict = {}
    with cache_only(why), Encoder(options) as encoder:
        for row, frames in encoder.encode(paths, bar):
            found[row.path] = (pooled_as_read(frames, getattr(torch, options.out_dtype), stored)
                               if frames else f"status {row.status}: {row.error}")
    for path in paths:
        found.setdefault(path, "status not encoded: None")
    return found


class _NoBar:
    def __init__(self, total: int):
        pass

    def advance(self, files: int, patches: int) -> None:
        pass

    def close(self) -> None:
        pass


def duplicates(out, threshold: float = 0.98, log=lambda message: None, method: str = "auto",
               keep: str = "first", partitions: int | None = None, boundary: float = dedup.BOUNDARY,
               engine: str = "local", ray_address: str | None = None) -> dict:
    """Groups of files whose pooled vectors are within `threshold` cosine of another in the group
    (linked: a near b and b near c puts a, b, c together), each with the file `keep` keeps first
    and the rest to drop."""
    if not -1 <= threshold <= 1:
        raise UsageError(f"--threshold {threshold}: a cosine, in [-1, 1]")
    if engine not in ("local", "ray"):
        raise UsageError(f"--engine {engine}: use local or ray")
    if keep not in dedup.POLICIES:
        raise UsageError(f"--keep {keep}: use one of {', '.join(dedup.POLICIES)}")
    with Searcher(out, log=log) as searcher:
        cache = searcher.cache
        if method == "auto":
            method = "exact" if cache.live ** 2 * cache.dim <= dedup.EXACT_FLOP else "partitioned"
        if engine == "ray" and method == "partitioned":
            from .ray.cluster import connect

            on_ray = connect(ray_address)
        else:
            if engine == "ray":
                log("duplicates: exact comparison runs here; Ray compares partitions (--method partitioned)")
            on_ray = contextlib.nullcontext(None)
        states: dict[int, str] = {}

        def usable(ids: np.ndarray) -> np.ndarray:  # rows that describe their file now (output/ondisk.py)
            rows = cache.rows[ids]
            states.update(ondisk.judge({
                int(i): ondisk.Seen(cache.path(int(i)), int(r["size"]), int(r["mtime"])) for i, r in zip(ids, rows)
            }))
            return np.array([states[int(i)] in (ondisk.LIVE, ondisk.ELSEWHERE) for i in ids], bool)

        with on_ray as ray:
            found, used = dedup.find_groups(cache, threshold, method, partitions, boundary, log, ray=ray,
                                            usable=usable)
        note = ondisk.stale_note(states.values())
        if note:
            log(f"duplicates: {note}")
        rng = np.random.default_rng(0)
        groups, seen = [], {}  # seen: path -> [size, mtime_ns] its row recorded, for the live members
        for number, members in enumerate(found):
            kept = dedup.keep_one(cache, members, keep, rng)
            groups.append({"group": number, "size": len(members), "keep": cache.path(kept),
                           "drop": [cache.path(i) for i in members.tolist() if i != kept],
                           "members": [cache.path(i) for i in members.tolist()]})
            for i in members.tolist():  # what a drop list or a move checks again (run/drop.py)
                if states.get(i) == ondisk.LIVE:
                    r = cache.rows[i]
                    seen[cache.path(i)] = [int(r["size"]), int(r["mtime"])]
        stale = [{"path": cache.path(i), "state": s} for i, s in sorted(states.items())
                 if s not in (ondisk.LIVE, ondisk.ELSEWHERE)]
        elsewhere = sum(s == ondisk.ELSEWHERE for s in states.values())
        return {"out": str(out), "index": cache.spec["kind"], "rows": cache.live, "threshold": threshold,
                "method": used, "keep": keep, "groups": groups, "stale": stale, "not_checked": elsewhere,
                "seen": seen}
