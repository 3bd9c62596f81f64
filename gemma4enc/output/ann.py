"""Which index search keeps over the cached vectors, chosen from N, the width and a memory bound,
and searching it: exact while small, a compressed IVF index past that, re-ranked exactly.

`flat`: the float16 vectors themselves (vecstore.py), scanned block by block with numpy; exact up
to float16 rounding. It is what a small OUT gets, and what every OUT gets without faiss.
`ivfpq`: faiss IVF{nlist},PQ{m} on inner product, memory-mapped (IO_FLAG_MMAP), searched in
`nprobe` lists for `refine`·k candidates that are then scored exactly on the float16 vectors: the
index only proposes, the vectors decide (the order and scores of the hits are exact cosines).
The choice follows autofaiss's rule of thumb (nlist ~ sqrt(N), PQ codes that fit the bound);
the recall it gives is measured in tests/test_search_index.py and docs/benchmarks.md.
"""

from __future__ import annotations

import math

import numpy as np

FLAT_BYTES = 256 << 20  # float16 vectors scanned whole per query batch up to this size
MEMORY = 1 << 30  # what an ivfpq index (codes + ids) may take
MIN_CODE = 16  # bytes a vector at the least, whatever the bound (fewer: the candidates miss too much)
BLOCK = 1 << 15  # rows scored at once by the flat scan
REFINE = 10  # candidates per wanted hit that the IVF index proposes for exact re-ranking
# and at least this many whatever k: PQ's codes cannot order near-ties, and a file's neighbours
# in a dense region are many near-ties (at 10 M, 100 candidates held half the true top 10;
# docs/benchmarks.md, 2026-12-04)
CANDIDATES = 1000
RERANK_QUERIES = 16  # queries whose candidates are read and scored together
TRAIN_PER_LIST = 40  # training vectors per IVF list (faiss warns under 39)
TRAIN_MIN = 10_000  # and at least this many: PQ's 256 centroids a sub-vector want 39 each


def faiss_or_none():
    try:
        import faiss
    except ImportError:
        return None
    return faiss


def choose(n: int, dim: int, memory: int | None = None, flat_bytes: int | None = None) -> dict:
    """The index for n vectors of width dim: {"kind": "flat"} or an ivfpq spec."""
    memory = MEMORY if memory is None else memory
    if n * dim * 2 <= (FLAT_BYTES if flat_bytes is None else flat_bytes) or faiss_or_none() is None or n < 10_000:
        return {"kind": "flat"}
    nlist = 1 << max(4, min(16, round(math.log2(math.sqrt(n)))))  # 1 M → 1024, 100 M → 16384
    nlist = min(nlist, n // TRAIN_PER_LIST)
    widths = [m for m in (64, 48, 32, 24, 16, 12, 8, 4, 2, 1) if dim % m == 0 and dim // m >= 4]
    floor = [m for m in widths if m >= MIN_CODE] or widths[:1] or [1]
    m = next((m for m in widths if n * (m + 8) <= memory and m >= floor[-1]), floor[-1])
    return {"kind": "ivfpq", "nlist": nlist, "m": m, "trained_n": n}


def nprobe_for(nlist: int) -> int:
    """Lists searched per query: a quarter (recall@10 0.96 at 1 M, nlist 1024; a sixteenth gave 0.86)."""
    return max(8, nlist // 4)


def build(spec: dict, dim: int, sample: np.ndarray):
    """An untrained-then-trained ivfpq index (float32 unit sample rows); `flat` needs none."""
    faiss = faiss_or_none()
    index = faiss.index_factory(dim, f"IVF{spec['nlist']},PQ{spec['m']}", faiss.METRIC_INNER_PRODUCT)
    index.do_polysemous_training = False  # on by default, and 50× the training time; its codes are never used here
    index.train(np.ascontiguousarray(sample, np.float32))
    return index


def read(path, mmap: bool = True):
    faiss = faiss_or_none()
    flags = faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY if mmap else 0
    return faiss.read_index(str(path), flags)


def top_k(scores: np.ndarray, ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's k best (score desc, then id asc), from candidate scores and ids of the same shape."""
    k = min(k, scores.shape[1])
    if k < scores.shape[1]:
        part = np.argpartition(-scores, k - 1, axis=1)[:, :k]
        scores, ids = np.take_along_axis(scores, part, 1), np.take_along_axis(ids, part, 1)
    order = np.lexsort((ids, -scores), axis=1)
    return np.take_along_axis(scores, order, 1), np.take_along_axis(ids, order, 1)


def flat_search(vectors, dead: np.ndarray, queries: np.ndarray, k: int):
    """Exact: (scores, ids) of each query's k best live rows of `vectors` ((N, D) float16)."""
    best_s = np.full((len(queries), 0), -np.inf, np.float32)
    best_i = np.zeros((len(queries), 0), np.int64)
    for lo in range(0, len(vectors), BLOCK):
        hi = min(lo + BLOCK, len(vectors))
        sims = queries @ np.asarray(vectors[lo:hi], np.float32).T
        sims[:, dead[lo:hi]] = -np.inf
        ids = np.broadcast_to(np.arange(lo, hi), sims.shape)
        best_s, best_i = top_k(np.hstack([best_s, sims]), np.hstack([best_i, ids]), k)
    return _drop_dead(best_s, best_i)


def _drop_dead(scores, ids):
    ids = np.where(np.isfinite(scores), ids, -1)
    return scores, ids


def ivf_search(index, spec: dict, vectors, dead: np.ndarray, queries: np.ndarray, k: int, nprobe=None):
    """Candidates from the IVF index (dead rows excluded by a bitmap), re-ranked exactly on `vectors`."""
    faiss = faiss_or_none()
    params = faiss.SearchParametersIVF()
    params.nprobe = int(nprobe or nprobe_for(spec["nlist"]))
    keep = None
    if dead.any():
        keep = np.packbits(~dead, bitorder="little")  # bit i of byte i >> 3: id i is live
        params.sel = faiss.IDSelectorBitmap(len(dead), faiss.swig_ptr(keep))
    wanted = min(max(k * REFINE, CANDIDATES), index.ntotal)
    _, cand = index.search(np.ascontiguousarray(queries, np.float32), wanted, params=params)
    del keep
    scores = np.full(cand.shape, -np.inf, np.float32)
    found = cand >= 0
    for lo in range(0, len(queries), RERANK_QUERIES):  # a few queries' candidates read at a time:
        at = slice(lo, lo + RERANK_QUERIES)  # all of a long list's, read at once, took GBs at 10 M
        hit = found[at]
        uniq, inverse = np.unique(cand[at][hit], return_inverse=True)
        exact = np.asarray(vectors[uniq], np.float32) if len(uniq) else np.zeros((0, queries.shape[1]), np.float32)
        rows = np.nonzero(hit)[0]
        block = scores[at]
        block[hit] = (queries[at] @ exact.T)[rows, inverse]  # these queries against their union: one matmul
    return _drop_dead(*top_k(scores, np.where(found, cand, -1), k))
