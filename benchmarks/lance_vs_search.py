"""LanceDB beside `gemma4enc search` on the same vectors (issue 50): build time, one query's wall time
and memory in a fresh process, and recall@10 against exact.

    python benchmarks/lance_vs_search.py --n 1000000 --dim 1536 --json bench-out/lance-1m.json

The vectors and the OUT are search_scale.py's (synthetic clusters with near copies, `--store pooled`,
bfloat16). gemma4enc: the first `search OUT Q` builds its cache and index (IVF-PQ past 200 k), then
one cached query, each in a fresh process under /usr/bin/time. LanceDB: `export --to lance` (float16
vectors), then `create_index` (IVF_PQ, cosine, LanceDB's own defaults for partitions and
sub-vectors), then one query in a fresh process (`open_table(...).search(v).limit(10)`, its default
nprobes and no refine). Recall@10 of each against the exact top 10 over the same float16 vectors,
on --sample queries drawn from the rows.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from search_scale import CLI, exact_top10, make_folder, path_of, recall_at_10, timed  # noqa: E402


def lance_worker(step: str, folder: str, extra: str) -> None:
    """One LanceDB step in this process (for /usr/bin/time)."""
    import lancedb

    table = lancedb.connect(folder).open_table("vectors")
    if step == "index":
        sizes = json.loads(extra or "{}")  # num_partitions / num_sub_vectors; LanceDB's defaults where absent
        table.create_index(metric="cosine", vector_column_name="vector", index_type="IVF_PQ", **sizes)
    elif step == "query":
        v = np.array(json.loads(extra), np.float32)
        hits = table.search(v, vector_column_name="vector").metric("cosine").limit(10).to_list()
        print(json.dumps([h["path"] for h in hits]))


def lance_recall(folder: Path, out: Path, sample: int, nprobes: int | None = None, refine: int | None = None) -> dict:
    """LanceDB's top 10 (its defaults, or nprobes and a refine factor) against the exact top 10 over
    gemma4enc's float16 vectors."""
    import lancedb

    from gemma4enc.run.search import Searcher

    table = lancedb.connect(str(folder)).open_table("vectors")
    with Searcher(out) as s:
        cache = s.cache
        ids = np.sort(np.random.default_rng(3).choice(cache.n, sample, replace=False))
        queries = np.asarray(cache.vectors[ids], np.float32)
        exact = [{cache.path(int(i)) for i in row} for row in exact_top10(cache, queries)]
    start = time.perf_counter()
    def top(q):
        search = table.search(q, vector_column_name="vector").metric("cosine").limit(10)
        if nprobes:
            search = search.nprobes(nprobes)
        if refine:
            search = search.refine_factor(refine)
        return {h["path"] for h in search.to_list()}

    got = [top(q) for q in queries]
    took = time.perf_counter() - start
    rec = np.mean([len(a & b) / 10 for a, b in zip(got, exact)])
    return {"recall_at_10": round(float(rec), 4), "queries": sample, "query_s_each": round(took / sample, 4)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=1536)
    parser.add_argument("--clusters", type=int, default=20_000)
    parser.add_argument("--spread", type=float, default=1.0)
    parser.add_argument("--dup-share", type=float, default=0.01)
    parser.add_argument("--sample", type=int, default=200)
    parser.add_argument("--work", type=Path, default=Path("bench-out/lance"))
    parser.add_argument("--reuse", action="store_true", help="keep an OUT made before (and its cache)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--partitions", type=int, help="LanceDB's num_partitions (default: its own)")
    parser.add_argument("--sub-vectors", type=int, help="LanceDB's num_sub_vectors (default: its own)")
    parser.add_argument("--lance-only", action="store_true",
                        help="with --reuse: keep the LanceDB table exported before, build its index and query")
    parser.add_argument("--lance-worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.lance_worker:
        lance_worker(*args.lance_worker)
        return
    report = {"n": args.n, "dim": args.dim, "runs": {}}

    def note(name, value):
        report["runs"][name] = value
        print(json.dumps({name: value}), flush=True)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=2, default=str))

    out = (args.work / f"out-{args.n}-{args.dim}").resolve()
    query = path_of(7)
    if args.lance_only and args.reuse:
        return lance_side(args, out, note, export=False)
    if not (args.reuse and (out / "search-index.json").exists()):
        make_folder(out, args.n, args)
        note("gemma4enc: first search (builds cache + index)", timed([*CLI, "search", str(out), query, "-k", "10", "-q"]))
    note("gemma4enc: one cached query", timed([*CLI, "search", str(out), query, "-k", "10", "-q"]))
    note("gemma4enc: recall@10 vs exact", recall_at_10(out, args.sample))

    lance_side(args, out, note, export=True)


def lance_side(args, out: Path, note, export: bool) -> None:
    """LanceDB's half: export (or the table exported before), its index, one query, recall."""
    folder = (args.work / f"lancedb-{args.n}-{args.dim}").resolve()
    import shutil

    if export:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        note("lance: export --to lance", timed([*CLI, "export", str(out), str(folder / "vectors.lance"), "--to", "lance"]))
    sizes = {k: v for k, v in (("num_partitions", args.partitions), ("num_sub_vectors", args.sub_vectors)) if v}
    note(f"lancedb: create_index IVF_PQ (cosine, {sizes or 'defaults'})",
         timed([sys.executable, __file__, "--lance-worker", "index", str(folder), json.dumps(sizes)]))
    from gemma4enc.run.search import Searcher

    with Searcher(out) as s:
        v = np.asarray(s.cache.vectors[7], np.float32).tolist()
    note("lancedb: one query (fresh process)",
         timed([sys.executable, __file__, "--lance-worker", "query", str(folder), json.dumps(v)]))
    note("lancedb: recall@10 vs exact (defaults)", lance_recall(folder, out, args.sample))
    note("lancedb: recall@10 vs exact (nprobes 50, refine_factor 10)", lance_recall(folder, out, args.sample, 50, 10))


if __name__ == "__main__":
    main()
