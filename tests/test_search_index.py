"""search's index against exact search, kept current as OUT grows, and duplicate groups against a
brute-force union-find, on output folders of known vectors (tests/vector_out.py).

Stated bounds: the flat index is exact (the same ids as numpy over the float16 vectors, scores
within 2e-3 of float32 cosines); ivfpq's recall@10 against exact is at least 0.95 on clustered
vectors (it proposes candidates, the float16 vectors rank them); exact duplicate groups equal a
brute-force union-find; partitioned ones find at least 0.95 of exact's pairs and no false one."""

from __future__ import annotations

import numpy as np
import pytest

from gemma4enc.output import ann, vecstore
from gemma4enc.run import dedup
from gemma4enc.run import search as search_module

from .vector_out import append_shard, clustered, path_of

faiss = pytest.importorskip("faiss")

N, DIM = 20_000, 32


@pytest.fixture(scope="module")
def data():
    return clustered(N, DIM, clusters=200, copies=300)


@pytest.fixture
def small_flat(monkeypatch):
    monkeypatch.setattr(ann, "FLAT_BYTES", 0)  # ivfpq from 10 000 vectors on


def exact_top(vectors: np.ndarray, queries: np.ndarray, k: int) -> np.ndarray:
    sims = queries @ vectors.T
    return np.argsort(-sims, axis=1, kind="stable")[:, :k]


def recall(found: np.ndarray, want: np.ndarray) -> float:
    return np.mean([len(set(f) & set(w)) / len(w) for f, w in zip(found.tolist(), want.tolist())])


@pytest.mark.parametrize("kind", ["flat", "ivfpq"])
def test_each_kind_against_exact(tmp_path, data, kind, monkeypatch):
    vectors, _ = data
    if kind == "ivfpq":
        monkeypatch.setattr(ann, "FLAT_BYTES", 0)
    append_shard(tmp_path / "out", vectors[:12_000], range(12_000))
    append_shard(tmp_path / "out", vectors[12_000:], range(12_000, N))
    with search_module.Searcher(tmp_path / "out") as searcher:
        cache = searcher.cache
        assert cache.spec["kind"] == kind and cache.n == N
        assert [cache.find(path_of(i)) for i in (0, 12_345, N - 1)] == [0, 12_345, N - 1]
        queries = vectors[np.random.default_rng(1).choice(N, 200, replace=False)]
        scores, ids = cache.search(queries, 10)
        want = exact_top(vectors, queries, 10)
        got = recall(ids, want)
        stored = np.asarray(cache.vectors, np.float32)
        assert np.allclose(scores, np.take_along_axis(queries @ vectors.T, ids, 1), atol=2e-3)  # exact cosines
        if kind == "flat":
            assert np.array_equal(ids, exact_top(stored, queries, 10)) and got >= 0.99
        else:
            assert got >= 0.95, got
        assert searcher.nearest(path_of(7), k=3)[0] == (path_of(7), pytest.approx(1))


def test_ivfpq_is_read_on_as_out_grows(tmp_path, data, small_flat, monkeypatch):
    vectors, _ = data
    out = tmp_path / "out"
    append_shard(out, vectors[:15_000], range(15_000))
    with search_module.Searcher(out) as searcher:
        assert searcher.cache.spec["kind"] == "ivfpq" and searcher.cache.index.ntotal == 15_000
    append_shard(out, vectors[15_000:], range(15_000, N))  # new files
    redone = np.arange(0, 2_000)
    append_shard(out, vectors[redone][::-1], redone)  # 2 000 files encoded again: their vectors now differ
    append_shard(out, vectors[:0], [])  # an empty run
    monkeypatch.setattr(vecstore, "_build", lambda *a: pytest.fail("read every shard again"))
    with search_module.Searcher(out) as searcher:
        cache = searcher.cache
        assert (cache.n, cache.live, cache.index.ntotal) == (N + 2_000, N, N + 2_000)
        now = vectors.copy()
        now[redone] = vectors[redone][::-1]
        queries = now[np.random.default_rng(2).choice(N, 200, replace=False)]
        _, ids = cache.search(queries, 10)
        paths = np.array([[cache.path(i) for i in row] for row in ids.tolist()])
        want = np.array([[path_of(i) for i in row] for row in exact_top(now, queries, 10).tolist()])
        assert recall(paths, want) >= 0.95
        assert not cache.dead[ids].any()
    failed = np.arange(2_000, 6_000)  # their latest rows failed: 6 000 of 22 000 ids dead, past a quarter
    append_shard(out, vectors[:0], failed, status="error")
    monkeypatch.undo()
    with search_module.Searcher(out) as searcher:  # rebuilt from its own vectors, no tombstone left
        cache = searcher.cache
        assert cache.n == cache.live == N - 4_000 and cache.find(path_of(3_000)) == -1
        i = cache.find(path_of(1_999))
        assert np.allclose(cache.vector(i), vectors[0], atol=2e-3)  # the re-encoded vector


def brute_groups(vectors: np.ndarray, threshold: float) -> list[list[int]]:
    sims = vectors @ vectors.T
    parent = list(range(len(vectors)))

    def root(i):
        while parent[i] != i:
            i = parent[i]
        return i

    for a, b in zip(*np.nonzero(np.triu(sims >= threshold, 1))):
        ra, rb = root(int(a)), root(int(b))
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    groups: dict[int, list[int]] = {}
    for i in range(len(vectors)):
        groups.setdefault(root(i), []).append(i)
    return sorted(g for g in groups.values() if len(g) > 1)


class _Vectors:
    """What find_groups needs of a cache: float16 unit vectors, every id live."""

    def __init__(self, vectors):
        self.vectors = vectors.astype(np.float16)
        self.n, self.dim = vectors.shape
        self.dead = np.zeros(self.n, bool)

    def live_ids(self):
        return np.arange(self.n)


def test_groups_against_brute_force(data, monkeypatch):
    vectors, planted = data
    v = vectors[:4_000]
    for threshold in (0.95, 0.8):
        want = brute_groups(np.asarray(v.astype(np.float16), np.float32), threshold)
        monkeypatch.setattr(dedup, "TILE", 700)  # tiles that do not divide the rows
        got, method = dedup.find_groups(_Vectors(v), threshold, "exact")
        assert method == "exact" and sorted(g.tolist() for g in got) == want


def test_partitioned_pairs_recall(data):
    vectors, planted = data
    cache = _Vectors(vectors)
    exact, part = [], []
    dedup.find_groups(cache, 0.9, "exact", pairs_out=exact)
    dedup.find_groups(cache, 0.9, "partitioned", k=100, pairs_out=part)
    pairs = lambda found: {(min(a, b), max(a, b)) for x, y in found for a, b in zip(x.tolist(), y.tolist())}  # noqa: E731
    want, got = pairs(exact), pairs(part)
    assert got <= want and len(want) >= len(planted)  # every pair it reports is a true one
    assert len(got) / len(want) >= 0.95, (len(got), len(want))
    none = []
    dedup.find_groups(cache, 0.9, "partitioned", k=100, boundary=-1, pairs_out=none)
    alone = pairs(none)
    assert alone <= got  # the boundary guests only add pairs


def test_the_nearest_two_centroids_and_deep_groups():
    """assign2's best two (by a partial sort) are a full sort's; groups() follows chains of any depth."""
    rng = np.random.default_rng(5)
    vectors, centroids = rng.standard_normal((3_000, 24), np.float32), rng.standard_normal((37, 24), np.float32)
    first, second, s1, s2 = dedup.assign2(vectors, np.arange(3_000), centroids)
    sims = vectors @ centroids.T
    order = np.argsort(-sims, axis=1)
    assert np.array_equal(first, order[:, 0]) and np.array_equal(second, order[:, 1])
    assert np.allclose(s1, sims[np.arange(3_000), order[:, 0]]) and np.all(s1 >= s2)
    uf = dedup.UnionFind(10)
    uf.parent[:] = [0, 0, 1, 2, 3, 5, 6, 6, 7, 9]  # 0←1←2←3←4 and 6←7←8 as unions can leave them
    assert [g.tolist() for g in uf.groups()] == [[0, 1, 2, 3, 4], [6, 7, 8]]


def test_the_cache_lives_beside_the_shards_on_a_store(tmp_path, data, monkeypatch):
    """On an s3:// OUT (moto on loopback) the cache is uploaded once built, fetched and used as it
    is by the next search, and read on when a run adds a manifest part."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    from .helpers import loopback_s3

    vectors, _ = data
    local = tmp_path / "local"
    append_shard(local, vectors[:3_000], range(3_000))
    with loopback_s3("index-bucket") as (fs, _):
        fs.put(f"{local}/", "index-bucket/out/", recursive=True)
        url = "s3://index-bucket/out"
        with search_module.Searcher(url) as searcher:
            assert searcher.cache.n == 3_000
        fs.invalidate_cache()
        held = {p.rsplit("/", 1)[1] for p in fs.find("index-bucket/out")}
        assert {vecstore.META, vecstore.VECTORS, vecstore.ROWS, vecstore.PATHS} <= held
        monkeypatch.setattr(vecstore, "_build", lambda *a: pytest.fail("built again"))
        with search_module.Searcher(url) as searcher:
            assert searcher.nearest(path_of(5), k=1)[0][0] == path_of(5)
        more = tmp_path / "more"
        append_shard(more, vectors[3_000:3_500], range(3_000, 3_500))  # what a run adds: a shard, a part
        fs.put(str(more / "shard-000000.safetensors"), "index-bucket/out/shard-000001.safetensors")
        part = (more / "manifest.jsonl").read_bytes().replace(b"shard-000000", b"shard-000001")
        fs.pipe("index-bucket/out/manifest.parts/000000000000-test.jsonl", part)
        with search_module.Searcher(url) as searcher:
            assert searcher.cache.n == 3_500 and searcher.nearest(path_of(3_400), k=1)[0][0] == path_of(3_400)
        monkeypatch.setattr(vecstore, "_append", lambda *a: pytest.fail("read on again"))
        with search_module.Searcher(url) as searcher:  # the store's cache was updated too
            assert searcher.cache.n == 3_500


def test_a_folder_that_cannot_be_written_gets_the_cache_elsewhere(tmp_path, data, monkeypatch):
    vectors, _ = data
    out = tmp_path / "out"
    append_shard(out, vectors[:500], range(500))
    real = vecstore._locked

    def locked(folder):  # the tests run as root, whom no permission stops: the refusal is made here
        if folder == out:
            raise PermissionError(13, "Permission denied")
        return real(folder)

    monkeypatch.setattr(vecstore, "_locked", locked)
    said = []
    with search_module.Searcher(out, log=said.append) as searcher:
        assert searcher.cache.folder != out and searcher.cache.live == 500
        assert searcher.nearest(path_of(3), k=1)[0][0] == path_of(3)
    assert not (out / vecstore.META).exists() and "not cached" in said[0]


def test_every_file_gone(tmp_path, data):
    vectors, _ = data
    out = tmp_path / "out"
    append_shard(out, vectors[:200], range(200))
    search_module.Searcher(out).close()
    append_shard(out, vectors[:0], range(200), status="error")  # every latest row failed
    with search_module.Searcher(out) as searcher:
        assert searcher.cache.live == 0 and searcher.nearest_vector(vectors[0], k=3) == []
        found, _ = dedup.find_groups(searcher.cache, 0.5)
        assert found == []


@pytest.mark.slow
def test_partitions_on_ray_find_what_local_finds(data, monkeypatch):
    """A private Ray on loopback compares the partitions: the very pairs the local pass finds."""
    pytest.importorskip("ray")
    from gemma4enc.run.ray.cluster import connect

    vectors, _ = data
    cache = _Vectors(vectors[:6_000])
    local, remote = [], []
    dedup.find_groups(cache, 0.9, "partitioned", k=40, pairs_out=local)
    monkeypatch.setattr(dedup, "RAY_BATCH", 500)  # many tasks, more than run at once
    with connect(None) as ray:
        dedup.find_groups(cache, 0.9, "partitioned", k=40, pairs_out=remote, ray=ray)
    pairs = lambda found: {(min(a, b), max(a, b)) for x, y in found for a, b in zip(x.tolist(), y.tolist())}  # noqa: E731
    assert pairs(remote) == pairs(local) and len(pairs(local)) > 0


HEAVY = ("torch", "transformers", "safetensors", "pydantic", "PIL", "av", "ray", "pyarrow", "boto3", "fsspec",
         "gemma4enc.commands.running", "gemma4enc.commands.tools", "gemma4enc.model")


def test_a_cached_query_imports_only_what_it_needs(tmp_path, data, small_flat):
    """A cached search from the console script (quick.py's path) imports none of encode's heavy parts
    nor Typer's parsing, and prints what the Typer command prints."""
    import json
    import subprocess
    import sys

    from gemma4enc.commands.cli import app

    from .helpers import RUN

    vectors, _ = data
    out = tmp_path / "out"
    append_shard(out, vectors[:12_000], range(12_000))
    search_module.Searcher(out).close()  # the ivfpq cache built here, read by the child
    argv = ["search", str(out), path_of(7), path_of(9), "-k", "3", "--json", "-q"]
    code = (f"import atexit, json, sys\nsys.argv = ['gemma4enc', *{argv!r}]\n"  # the exit handlers run, then
            f"atexit.register(lambda: sys.stderr.write(json.dumps([m for m in {HEAVY!r} if m in sys.modules])))\n"
            "from gemma4enc.commands.cli import console\nconsole()\n")  # console's os._exit (faiss is in)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and json.loads(done.stderr.splitlines()[-1]) == [], done.stderr
    report = json.loads(done.stdout)
    assert report["index"] == "ivfpq" and [h["path"] for h in report["results"][0]["hits"]][0] == path_of(7)
    typed = RUN.invoke(app, argv)
    assert typed.exit_code == 0 and json.loads(typed.stdout) == report


@pytest.mark.parametrize("argv, taken", [
    (["search", "OUT", "a.jpg"], {"k": 10, "files": ["a.jpg"]}),
    (["search", "-q", "OUT", "--top", "3", "a.jpg", "--json", "--", "-b.jpg"], {"k": 3, "files": ["a.jpg", "-b.jpg"]}),
    (["search", "OUT", "--files-from", "-", "-k", "-1"], {"k": -1, "files_from": "-", "files": []}),
    (["search", "OUT"], None),  # nothing to search for: Typer's usage error
    (["search", "OUT", "a.jpg", "--duplicates"], None),
    (["search", "OUT", "a.jpg", "--top=3"], None),
    (["search", "OUT", "a.jpg", "-k", "3", "-k", "4"], None),
    (["search", "OUT", "a.jpg", "-k", "5_0"], None),
    (["search", "OUT", "a.jpg", "-k"], None),
    (["search", "OUT", "a.jpg", "--help"], None),
    (["inspect", "OUT"], None),
])
def test_the_quick_path_takes_only_plain_searches(argv, taken):
    from gemma4enc.commands.quick import plain_search

    got = plain_search(argv)
    assert (got is None) == (taken is None)
    if taken is not None:
        assert got["out"] == "OUT" and {key: got[key] for key in taken} == taken
