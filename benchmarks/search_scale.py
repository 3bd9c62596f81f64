"""search and duplicate groups at the tool's scale (issue 37): wall, CPU and peak RSS of the real
CLI in fresh processes, and recall against exact.

    python benchmarks/search_scale.py --n 1000000 --dim 1536 --json bench-out/search-1m.json
    python benchmarks/search_scale.py --n 20000 --dim 256 --dups-n 10000     # a quick look

The vectors are synthetic, not Gemma 4's: --clusters centres (standard normal), each vector its
centre plus noise of --spread (cosine within a cluster ~ 1/(1+spread²)), and --dup-share of them
near copies (cosine ~0.995) of another. They are written as an output folder encoded with
`--store pooled` would leave (bfloat16 pooled vectors, no tokens; settings.json, manifest), so
what is timed is `gemma4enc search` reading OUT as it reads any. Steps, each under /usr/bin/time:
  1. `search OUT Q -k 10`: builds the cache and index (first run), then the same query cached,
     then --queries queries in one call (--files-from);
  2. recall@10 of the index against exact search over the same float16 vectors, --sample queries;
  3. `search --duplicates` over all N (auto: partitioned past the exact size);
  4. on the first --dups-n files (a folder of their own): exact and partitioned duplicate groups,
     and the partitioned run's pair recall against exact's pairs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

PER_SHARD = 50_000
CLI = [sys.executable, "-m", "gemma4enc"]
SETTINGS = {"model": "/bench/ckpt", "dtype": "float32", "image_tokens": 70, "video_tokens": 70, "resize": "fast",
            "sampling": {"frames": 32, "fps": None, "max_frames": 32}, "seek": "exact", "out_dtype": "bfloat16",
            "pooled": True, "store": "pooled", "revision": None}


def path_of(i: int) -> str:
    return f"/bench/media/d{i // 1000:05d}/p{i:07d}.jpg"


def vectors_for(lo: int, hi: int, dim: int, clusters: int, spread: float, dup_share: float) -> np.ndarray:
    """Rows lo..hi of the synthetic set, the same whatever the chunking (seeded per row block)."""
    centres = np.random.default_rng(1).standard_normal((clusters, dim), dtype=np.float32)
    out = np.empty((hi - lo, dim), np.float32)
    for b in range(lo // 1000, (hi - 1) // 1000 + 1):
        rng = np.random.default_rng([7, b])
        rows = centres[rng.integers(0, clusters, 1000)] + spread * rng.standard_normal((1000, dim), np.float32)
        copy = rng.random(1000) < dup_share  # a near copy of the row before it in the block
        for j in np.flatnonzero(copy[1:]) + 1:
            rows[j] = rows[j - 1] + 0.1 * np.linalg.norm(rows[j - 1]) / np.sqrt(dim) * rng.standard_normal(dim)
        a, z = max(lo, b * 1000), min(hi, b * 1000 + 1000)
        out[a - lo: z - lo] = rows[a - b * 1000: z - b * 1000]
    return out


def make_folder(out: Path, n: int, args) -> None:
    import torch
    from safetensors.torch import save_file

    from gemma4enc.output.files import MANIFEST, line_of

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    (out / "settings.json").write_text(json.dumps(SETTINGS, indent=2))
    with open(out / MANIFEST, "wb") as manifest:
        for number, lo in enumerate(range(0, n, PER_SHARD)):
            hi = min(n, lo + PER_SHARD)
            name = f"shard-{number:06d}.safetensors"
            values = vectors_for(lo, hi, args.dim, args.clusters, args.spread, args.dup_share)
            k = torch.arange(hi - lo + 1)
            save_file({"pooled": torch.from_numpy(values).to(torch.bfloat16), "item_offsets": k,
                       "frame_offsets": k.clone(), "item_frames": k.clone()}, str(out / name),
                      metadata={"format_version": "1", "out_dtype": "bfloat16", "hidden_size": str(args.dim)})
            manifest.write(b"".join(line_of({
                "path": path_of(i), "kind": "image", "size": 1000 + i, "mtime_ns": i, "status": "ok",
                "error": None, "shard": name, "index": i - lo, "tokens": 1, "frames": 1, "frame_tokens": [1],
                "width": 64, "height": 48}) for i in range(lo, hi)))


def timed(args: list[str], stdin: str | None = None) -> dict:
    """Wall, user + sys CPU and peak RSS of one command (GNU time)."""
    start = time.perf_counter()
    result = subprocess.run(["/usr/bin/time", "-v", *args], capture_output=True, text=True, input=stdin)
    wall = time.perf_counter() - start
    if result.returncode:
        raise SystemExit(f"{' '.join(args)}: exit {result.returncode}\n{result.stderr[-2000:]}")
    field = lambda key: next(line.split(":")[-1].strip() for line in result.stderr.splitlines() if key in line)  # noqa: E731
    cpu = float(field("User time (seconds)")) + float(field("System time (seconds)"))
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "peak_rss_mb": int(field("Maximum resident")) // 1024}


def exact_top10(cache, queries: np.ndarray) -> np.ndarray:
    """(len(queries), 10) ids of each query's exact top 10 over the cache's float16 vectors, in blocks."""
    best = np.full((len(queries), 0), -np.inf, np.float32)
    best_i = np.zeros((len(queries), 0), np.int64)
    for lo in range(0, cache.n, 1 << 16):
        sims = queries @ np.asarray(cache.vectors[lo: lo + (1 << 16)], np.float32).T
        both = np.hstack([best, sims])
        both_i = np.hstack([best_i, np.broadcast_to(np.arange(lo, lo + sims.shape[1]), sims.shape)])
        top = np.argpartition(-both, 9, axis=1)[:, :10]
        best, best_i = np.take_along_axis(both, top, 1), np.take_along_axis(both_i, top, 1)
        cache.release()
    return best_i


def recall_at_10(out: Path, sample: int) -> dict:
    """The index's top 10 against exact top 10 over the cache's own float16 vectors."""
    from gemma4enc.run.search import Searcher

    with Searcher(out) as s:
        cache = s.cache
        ids = np.sort(np.random.default_rng(3).choice(cache.n, sample, replace=False))
        queries = np.asarray(cache.vectors[ids], np.float32)
        start = time.perf_counter()
        _, got = cache.search(queries, 10)
        took = time.perf_counter() - start
        best_i = exact_top10(cache, queries)
        rec = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(got.tolist(), best_i.tolist())])
        return {"recall_at_10": round(float(rec), 4), "queries": sample, "index": cache.spec,
                "batch_search_s": round(took, 3)}


def pairs_worker(out: str, method: str, threshold: float, dest: str) -> None:
    """One duplicate-pair pass in this process (for /usr/bin/time): the pairs to an .npy."""
    from gemma4enc.run import dedup
    from gemma4enc.run.search import Searcher

    with Searcher(out) as s:
        found = []
        groups, _ = dedup.find_groups(s.cache, threshold, method, pairs_out=found)
        a = np.concatenate([x for x, _ in found] or [np.zeros(0, np.int64)])
        b = np.concatenate([y for _, y in found] or [np.zeros(0, np.int64)])
        np.save(dest, np.stack([np.minimum(a, b), np.maximum(a, b)], 1))
        print(json.dumps({"groups": len(groups), "pairs": len(a)}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=1536, help="stored width (E2B's is 1536)")
    parser.add_argument("--clusters", type=int, default=20_000)
    parser.add_argument("--spread", type=float, default=1.0)
    parser.add_argument("--dup-share", type=float, default=0.01)
    parser.add_argument("--threshold", type=float, default=0.95)
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--sample", type=int, default=200)
    parser.add_argument("--dups-n", type=int, default=100_000)
    parser.add_argument("--skip-full-dups", action="store_true")
    parser.add_argument("--only-subset", action="store_true", help="only step 4 (the --dups-n folder)")
    parser.add_argument("--only-query", action="store_true", help="only steps 1 and 2 (no duplicates)")
    parser.add_argument("--reuse", action="store_true",
                        help="use the folder (and its cache) a previous run left under --work as it is")
    parser.add_argument("--work", type=Path, default=Path("bench-out/search"))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--pairs-worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.pairs_worker:
        out, method, threshold, dest = args.pairs_worker
        pairs_worker(out, method, float(threshold), dest)
        return
    report = {"n": args.n, "dim": args.dim, "synthetic": vars(args) | {"json": None, "work": None}, "runs": {}}
    runs = report["runs"]

    def note(name, value):
        runs[name] = value
        print(json.dumps({name: value}), flush=True)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=2, default=str))

    if not args.only_subset:
        whole(args, note)
    if not args.only_query:
        subset(args, note)


def whole(args, note) -> None:
    out = (args.work / f"out-{args.n}-{args.dim}").resolve()
    query = path_of(7)  # in OUT (the file is gone: OUT's vector is all there is)
    if not (args.reuse and (out / "search-index.json").exists()):
        start = time.perf_counter()
        make_folder(out, args.n, args)
        note("made", {"wall_s": round(time.perf_counter() - start, 1)})
        note("search, first (builds cache + index)", timed([*CLI, "search", str(out), query, "-k", "10", "-q"]))
    note("search, cached, 1 query", timed([*CLI, "search", str(out), query, "-k", "10", "-q"]))
    listing = "\n".join(path_of(i) for i in range(0, args.n, max(1, args.n // args.queries))[: args.queries])
    note(f"search, cached, {args.queries} queries (--files-from -)",
         timed([*CLI, "search", str(out), "--files-from", "-", "-k", "10", "-q", "--json"], stdin=listing))
    note("recall@10 vs exact", recall_at_10(out, args.sample))
    if not (args.skip_full_dups or args.only_query):
        note(f"duplicates, all {args.n:,} (auto)", timed([*CLI, "search", str(out), "--duplicates", "--threshold",
                                                          str(args.threshold), "--drop-list", "/dev/null", "-q"]))


def subset(args, note) -> None:
    small = (args.work / f"out-{args.dups_n}-{args.dim}").resolve()
    make_folder(small, args.dups_n, args)
    timed([*CLI, "search", str(small), path_of(7), "-q"])  # its cache built (not timed below)
    found = {}
    for method in ("partitioned", "exact"):
        dest = args.work / f"pairs-{method}.npy"
        note(f"duplicates, {args.dups_n:,}, {method}",
             timed([sys.executable, __file__, "--pairs-worker", str(small), method, str(args.threshold), str(dest)]))
        found[method] = {tuple(p) for p in np.load(dest).tolist()}
    exact, part = found["exact"], found["partitioned"]
    note(f"pair recall, {args.dups_n:,}", {"exact_pairs": len(exact), "partitioned_pairs": len(part),
                                           "recall": round(len(part & exact) / max(1, len(exact)), 4),
                                           "false": len(part - exact)})


if __name__ == "__main__":
    main()
