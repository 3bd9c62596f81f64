"""export and search over a big output folder: wall, CPU and peak RSS of the real CLI (issue 25).

    python benchmarks/export.py --n 1000000 --json bench-out/export.json
    python benchmarks/export.py --n 100000 --to parquet --to webdataset

It writes, under --work, an output folder of N files as a finished `gemma4enc encode` would
leave it (settings.json, shards of PER_SHARD files, manifest.jsonl), one soft token per file of
width --dim in bfloat16, random values, and every 10th file encoded twice (its first row
superseded) so that export must skip stale rows. No media: export and search read only OUT.
Then it times `gemma4enc export` per format and `gemma4enc search` (a first search builds the
index, a second uses the cached one; with --duplicates also `search --duplicates`) in fresh
processes under /usr/bin/time.
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


def make_folder(out: Path, n: int, dim: int) -> None:
    import torch
    from safetensors.torch import save_file

    from gemma4enc.output.files import MANIFEST, line_of

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    settings = {"model": "/bench/ckpt", "dtype": "float32", "image_tokens": 70, "video_tokens": 70, "resize": "fast",
                "sampling": {"frames": 32, "fps": None, "max_frames": 32}, "seek": "exact", "out_dtype": "bfloat16",
                "pooled": True, "revision": None}
    (out / "settings.json").write_text(json.dumps(settings, indent=2))
    rng = np.random.default_rng(0)
    ids = list(range(n)) + list(range(0, n, 10))  # every 10th file again: its first row is superseded
    with open(out / MANIFEST, "wb") as manifest:
        for number, lo in enumerate(range(0, len(ids), PER_SHARD)):
            chunk = ids[lo: lo + PER_SHARD]
            name = f"shard-{number:06d}.safetensors"
            values = torch.from_numpy(rng.standard_normal((len(chunk), dim), dtype=np.float32)).to(torch.bfloat16)
            k = torch.arange(len(chunk) + 1)
            save_file({"tokens": values, "item_offsets": k, "frame_offsets": k.clone(), "item_frames": k.clone(),
                       "pooled": values.clone()}, str(out / name),
                      metadata={"format_version": "1", "out_dtype": "bfloat16", "hidden_size": str(dim)})
            manifest.write(b"".join(line_of({
                "path": f"/bench/media/d{i // 1000:05d}/p{i:07d}.jpg", "root": "/bench/media",
                "rel": f"d{i // 1000:05d}/p{i:07d}.jpg", "kind": "image", "size": 1000 + i, "mtime_ns": i,
                "status": "ok", "error": None, "shard": name, "index": j, "tokens": 1, "frames": 1,
                "frame_tokens": [1], "width": 64, "height": 48}) for j, i in enumerate(chunk)))


def timed(args: list[str]) -> dict:
    """Wall, user + sys CPU and peak RSS of one command (GNU time)."""
    start = time.perf_counter()
    result = subprocess.run(["/usr/bin/time", "-v", *args], capture_output=True, text=True)
    wall = time.perf_counter() - start
    if result.returncode:
        raise SystemExit(f"{' '.join(args)}: exit {result.returncode}\n{result.stderr[-2000:]}")
    field = lambda key: next(line.split(":")[-1].strip() for line in result.stderr.splitlines() if key in line)  # noqa: E731
    cpu = float(field("User time (seconds)")) + float(field("System time (seconds)"))
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "peak_rss_mb": int(field("Maximum resident")) // 1024}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=1536, help="stored width (E2B's is 1536)")
    parser.add_argument("--to", action="append", help="formats (default: clip)")
    parser.add_argument("--work", type=Path, default=Path("bench-out/export"))
    parser.add_argument("--duplicates", action="store_true", help="also time search --duplicates (every pair: N²)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    out = (args.work / f"out-{args.n}").resolve()
    start = time.perf_counter()
    make_folder(out, args.n, args.dim)
    report = {"n": args.n, "dim": args.dim, "made_s": round(time.perf_counter() - start, 1), "runs": {}}
    print(json.dumps(report), flush=True)
    for to in args.to or ["clip"]:
        dest = args.work / f"{to}-{args.n}"
        shutil.rmtree(dest, ignore_errors=True)
        report["runs"][f"export --to {to}"] = timed([*CLI, "export", str(out), str(dest), "--to", to])
        print(json.dumps(report["runs"]), flush=True)
        shutil.rmtree(dest, ignore_errors=True)
    query = "/bench/media/d00000/p0000007.jpg"  # in OUT (the file is gone: OUT's vector is all there is)
    report["runs"]["search (builds the index)"] = timed([*CLI, "search", str(out), query, "-k", "5", "-q"])
    report["runs"]["search (cached index)"] = timed([*CLI, "search", str(out), query, "-k", "5", "-q"])
    if args.duplicates:
        report["runs"]["search --duplicates"] = timed([*CLI, "search", str(out), "--duplicates", "-q"])
    print(json.dumps(report["runs"]), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
