"""Groups of near-duplicate files (`search --duplicates`): pairs at or above a cosine, linked into
groups (union-find), one file of each group kept by a policy, the rest listed to drop.

`exact`: every pair, through tiles of a matrix multiply (TILE × TILE float32 scores at a time), a
threshold, an edge list per tile. Its cost grows with N², so past EXACT_FLOP it is `partitioned`,
as SemDeDup and NeMo Curator do: spherical k-means with K ≈ √N fitted on a sample, one pass that
assigns each vector its two nearest centroids, then exact comparison inside each partition, where
a vector whose second centroid is within `boundary` of its first also visits that partition (a
guest: compared with the members, not with other guests). Every pair it reports is a true one
(scored exactly); what it can miss are pairs split across partitions: its recall against exact
is measured in tests/test_search_index.py and docs/benchmarks.md.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from ..errors import UsageError

TILE = 4096  # rows of each side scored at once (TILE² float32 scores: 64 MB)
EXACT_FLOP = 2e13  # exact all pairs while N²·D stays under this (100 k × 1536 on two cores: minutes)
KMEANS_ITERS = 10
SAMPLE_PER_CENTROID = 40
BOUNDARY = 0.05  # second centroid's cosine within this of the first: also compared there
POLICIES = ("first", "largest", "smallest", "newest", "oldest", "central", "random")


class UnionFind:
    def __init__(self, n: int):
        self.parent = np.arange(n, dtype=np.int64)

    def root(self, i: int) -> int:
        parent = self.parent
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return int(i)

    def union(self, a: np.ndarray, b: np.ndarray) -> None:
        for x, y in zip(a.tolist(), b.tolist()):
            rx, ry = self.root(x), self.root(y)
            if rx != ry:
                self.parent[max(rx, ry)] = min(rx, ry)

    def groups(self) -> list[np.ndarray]:
        """Components of more than one member, each sorted, ordered by their smallest member."""
        roots = self.parent.copy()
        while True:  # every id's root at once, by pointer jumping (a Python loop took ~1 s a million ids)
            up = roots[roots]
            if np.array_equal(up, roots):
                break
            roots = up
        order = np.argsort(roots, kind="stable")
        cuts = np.flatnonzero(np.diff(roots[order])) + 1
        return [g for g in np.split(order, cuts) if len(g) > 1]


def tile_edges(left: np.ndarray, right: np.ndarray | None, threshold: float):
    """(i, j) of left × right (or left × left, i < j) with cosine ≥ threshold, tile by tile."""
    same = right is None
    right = left if same else right
    for lo in range(0, len(left), TILE):
        a = np.asarray(left[lo: lo + TILE], np.float32)
        for co in range(lo if same else 0, len(right), TILE):
            b = a if same and co == lo else np.asarray(right[co: co + TILE], np.float32)
            i, j = np.nonzero(a @ b.T >= threshold)
            if same and co == lo:
                keep = i < j
                i, j = i[keep], j[keep]
            if len(i):
                yield i + lo, j + co


def exact_pairs(vectors, ids: np.ndarray, threshold: float):
    """Every pair of `ids` (rows of `vectors`) at or above the threshold: (a, b) id arrays."""
    for lo in range(0, len(ids), TILE * 4):  # gathered a slab at a time: memory holds two slabs
        slab = np.asarray(vectors[ids[lo: lo + TILE * 4]], np.float32)
        for i, j in tile_edges(slab, None, threshold):
            yield ids[lo + i], ids[lo + j]
        for co in range(lo + TILE * 4, len(ids), TILE * 4):
            other = np.asarray(vectors[ids[co: co + TILE * 4]], np.float32)
            for i, j in tile_edges(slab, other, threshold):
                yield ids[lo + i], ids[co + j]


def kmeans(sample: np.ndarray, k: int, iters: int = KMEANS_ITERS, seed: int = 0) -> np.ndarray:
    """Spherical k-means centroids (k, D), unit rows; an emptied centroid is re-seeded from the sample."""
    rng = np.random.default_rng(seed)
    centroids = sample[rng.choice(len(sample), k, replace=False)].copy()
    for _ in range(iters):
        assign = np.concatenate([np.argmax(sample[lo: lo + TILE] @ centroids.T, 1)
                                 for lo in range(0, len(sample), TILE)])
        order = np.argsort(assign, kind="stable")  # members of each centroid together: one reduceat
        counts = np.bincount(assign, minlength=k)
        sums = np.zeros_like(centroids)
        starts = np.r_[0, np.cumsum(counts)[:-1]]
        full = counts > 0
        sums[full] = np.add.reduceat(sample[order], starts[full], axis=0)
        empty = counts == 0
        sums[empty] = sample[rng.choice(len(sample), int(empty.sum()), replace=False)]
        norms = np.linalg.norm(sums, axis=1, keepdims=True)
        centroids = sums / np.where(norms > 0, norms, 1)
    return centroids.astype(np.float32)


def assign2(vectors, ids: np.ndarray, centroids: np.ndarray, release=lambda: None):
    """Each id's nearest two centroids and their cosines: (first, second, s1, s2)."""
    n = len(ids)
    first, second = np.zeros(n, np.int64), np.zeros(n, np.int64)
    s1, s2 = np.zeros(n, np.float32), np.full(n, -np.inf, np.float32)
    for lo in range(0, n, TILE * 4):
        sims = np.asarray(vectors[ids[lo: lo + TILE * 4]], np.float32) @ centroids.T
        rows, at = np.arange(len(sims)), slice(lo, lo + len(sims))
        # the best, then the best of the rest: two argmax passes (a sort of all K per row cost as
        # much as half the matmul at K ≈ 3,000; docs/benchmarks.md, 2026-12-04)
        first[at] = sims.argmax(1)
        s1[at] = sims[rows, first[at]]
        if sims.shape[1] > 1:
            sims[rows, first[at]] = -np.inf
            second[at] = sims.argmax(1)
            s2[at] = sims[rows, second[at]]
        release()
    return first, second, s1, s2


def partitioned_pairs(vectors, ids: np.ndarray, threshold: float, k: int | None = None,
                      boundary: float = BOUNDARY, release=lambda: None, log=lambda m: None, ray=None):
    """Pairs found inside k-means partitions (and for boundary guests, in their second one)."""
    n = len(ids)
    k = k or max(1, min(n // 2, round(math.sqrt(n))))
    rng = np.random.default_rng(0)
    sample = np.sort(rng.choice(n, min(n, k * SAMPLE_PER_CENTROID), replace=False))
    centroids = kmeans(np.asarray(vectors[ids[sample]], np.float32), k)
    log(f"duplicates: {k} partitions fitted on {len(sample):,} vectors")
    first, second, s1, s2 = assign2(vectors, ids, centroids, release)
    guest = (s1 - s2 <= boundary) & np.isfinite(s2)
    order = np.argsort(first, kind="stable")
    cuts = np.flatnonzero(np.diff(first[order])) + 1
    g_order = np.flatnonzero(guest)[np.argsort(second[guest], kind="stable")]
    g_parts = second[g_order]
    log(f"duplicates: {int(guest.sum()):,} vectors near a boundary also compared in their second partition")
    parts = []
    for members in np.split(order, cuts):
        p = first[members[0]]
        a, b = np.searchsorted(g_parts, [p, p + 1])
        parts.append((ids[np.sort(members)], ids[np.sort(g_order[a:b])]))
    if ray is not None:
        yield from _on_ray(ray, vectors, parts, threshold, release, log)
        return
    for members, guests in parts:
        yield from partition_pairs(vectors, members, guests, threshold)
        release()


def partition_pairs(vectors, members: np.ndarray, guests: np.ndarray, threshold: float):
    """One partition's pairs: members with each other, guests with the members."""
    yield from exact_pairs(vectors, members, threshold)
    if len(guests):
        x = np.asarray(vectors[members], np.float32)
        for lo in range(0, len(guests), TILE):
            y = np.asarray(vectors[guests[lo: lo + TILE]], np.float32)
            for i, j in tile_edges(y, x, threshold):
                yield guests[lo + i], members[j]


RAY_BATCH = 8192  # vectors a Ray task is sent (members and guests of whole partitions): 25 MB at 1536
RAY_TASK_S = 1800  # a task still running after this is reported, not waited for


def _ray_task(batch, threshold: float):
    """On a Ray worker: the pairs of a batch of partitions, each given as (ids, rows) of members and guests."""
    found = []
    for (members, m_rows), (guests, g_rows) in batch:
        rows, ids = np.concatenate([m_rows, g_rows]), np.concatenate([members, guests])
        local = np.arange(len(rows))
        for a, b in partition_pairs(rows, local[: len(members)], local[len(members):], threshold):
            found.append((ids[a], ids[b]))
    return found


def _on_ray(ray, vectors, parts, threshold: float, release, log):
    """The partitions compared as Ray tasks (the vectors sent with them: no shared disk needed), at
    most twice the cluster's CPUs in flight, each bounded by RAY_TASK_S."""
    task = ray.remote(num_cpus=1, max_retries=2)(_ray_task)
    limit = max(2, 2 * int(ray.cluster_resources().get("CPU", 1)))
    pending, batch, size = [], [], 0

    def send():
        pending.append(task.remote([((m, np.asarray(vectors[m])), (g, np.asarray(vectors[g]))) for m, g in batch],
                                   threshold))
        release()

    def drain(until: int):
        while len(pending) > until:
            done, _ = ray.wait(pending, num_returns=1, timeout=RAY_TASK_S)
            if not done:
                raise UsageError(f"a Ray task comparing partitions ran past {RAY_TASK_S} s; stopped")
            pending.remove(done[0])
            yield from ray.get(done[0])

    for members, guests in parts:
        batch.append((members, guests))
        size += len(members) + len(guests)
        if size >= RAY_BATCH:
            send()
            batch, size = [], 0
            yield from drain(limit)
    if batch:
        send()
    log(f"duplicates: partitions compared on Ray ({limit} tasks at a time)")
    yield from drain(0)


def find_groups(cache, threshold: float, method: str = "auto", k: int | None = None,
                boundary: float = BOUNDARY, log=lambda m: None, pairs_out: list | None = None, ray=None,
                usable=None):
    """(groups as arrays of ids, the method used). `pairs_out`: a list the (a, b) arrays go to;
    `ray`: the connected ray module, to compare the partitions on its cluster; `usable(ids)`: a
    mask of the ids that may be members (rows that still describe their file, output/ondisk.py),
    asked once for every id in a pair: a pair with another id is no link, so a stale row never
    joins two files that are not near each other."""
    ids = cache.live_ids()
    if method == "auto":
        method = "exact" if len(ids) ** 2 * cache.dim <= EXACT_FLOP else "partitioned"
    release = getattr(cache, "release", lambda: None)
    if method == "exact":
        found = exact_pairs(cache.vectors, ids, threshold)
    elif method == "partitioned":
        found = partitioned_pairs(cache.vectors, ids, threshold, k, boundary, release, log, ray)
    else:
        raise UsageError(f"--method {method}: use auto, exact or partitioned")
    uf = UnionFind(cache.n)
    if usable is not None:
        found = _usable_pairs(list(found), usable)
    for a, b in found:
        uf.union(a, b)
        if pairs_out is not None:
            pairs_out.append((a, b))
    return uf.groups(), method


def _usable_pairs(pairs: list, usable) -> list:
    """The pairs both of whose ids `usable` allows (one question for all the ids at once)."""
    if not pairs:
        return []
    ids = np.unique(np.concatenate([np.concatenate([a, b]) for a, b in pairs]))
    ok = np.zeros(int(ids.max()) + 1, bool)
    ok[ids[np.asarray(usable(ids), bool)]] = True
    return [(a[ok[a] & ok[b]], b[ok[a] & ok[b]]) for a, b in pairs]


def keep_one(cache, group: np.ndarray, policy: str, rng) -> int:
    """The id kept of a group: first in OUT, largest/smallest file, newest/oldest mtime, the one
    most like the rest (central), or one at random (seeded: the same run keeps the same)."""
    rows = cache.rows[group]
    if policy == "first":
        return int(group.min())
    if policy in ("largest", "smallest", "newest", "oldest"):
        field = "size" if policy in ("largest", "smallest") else "mtime"
        values = rows[field] if policy in ("smallest", "oldest") else -rows[field]
        return int(group[np.lexsort((group, values))[0]])
    if policy == "central":
        x = np.asarray(cache.vectors[group], np.float32)
        return int(group[np.argmax(x @ x.sum(0))])  # the summed cosines to the group, without the N² matrix
    if policy == "random":
        return int(rng.choice(group))
    raise UsageError(f"--keep {policy}: use one of {', '.join(POLICIES)}")


def write_groups(path: Path, groups: list[dict]) -> None:
    """Groups as JSONL (one group a line) or Parquet (by the name's suffix); another suffix, or a
    place that cannot be written, is one line (exit 2)."""
    path = Path(path)
    if path.suffix not in (".parquet", ".jsonl", ".json", "") and str(path) != "/dev/stdout":
        raise UsageError(f"--groups {path}: name a .jsonl or a .parquet file (not {path.suffix})")
    try:
        _write_groups(path, groups)
    except OSError as e:
        raise UsageError(f"--groups {path}: {e.strerror or e}") from None


def _write_groups(path: Path, groups: list[dict]) -> None:
    if path.suffix == ".parquet":
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            raise UsageError(f"{path}: Parquet needs pyarrow (pip install 'gemma4enc[export]'); "
                             "or name a .jsonl file") from None
        from ..output.formats import text_of

        texts = lambda paths: [text_of(p) for p in paths]  # noqa: E731 - names that are not UTF-8, escaped
        table = pa.table({"group": [g["group"] for g in groups], "keep": texts([g["keep"] for g in groups]),
                          "drop": [texts(g["drop"]) for g in groups], "size": [g["size"] for g in groups],
                          "members": [texts(g["members"]) for g in groups]})
        pq.write_table(table, path)
        return
    with open(path, "w", encoding="utf-8", errors="surrogateescape") as f:
        for g in groups:
            f.write(json.dumps(g) + "\n")
