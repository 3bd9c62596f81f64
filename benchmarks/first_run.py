"""A first run over N new files: the driver's peak RSS before and while the first rows land (issue 26).

    python benchmarks/first_run.py --n 1000000 --baseline /tmp/g4base --json bench-out/first_run.json

Makes N hard links to a few small photos under --work (streamed, as benchmarks/ledger.py does:
the generator holds no list of them), then runs the real CLI into a new output folder, once
per code tree (this one, and --baseline: a checkout of gemma4enc whose package is put first on
PYTHONPATH), samples the main process's /proc status every 0.2 s, and stops the run with SIGINT
once --rows rows are in its manifest. Reported per tree: peak RSS of the driver (VmHWM), seconds
until the first row, rows at the stop. No run has to finish: what grows with N is discovery's
hold on the files to do, which a run has reached by its first rows.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ledger import CLI, FLAGS, PER_DIR, checkpoint, sources  # noqa: E402


def make_media(work: Path, n: int) -> Path:
    media = (work / f"new-{n}").resolve()
    if (media / "done").exists():
        return media
    shutil.rmtree(media, ignore_errors=True)
    srcs = sources(work, n)
    for i in range(n):
        folder = media / f"d{i // PER_DIR:05d}"
        if i % PER_DIR == 0:
            folder.mkdir(parents=True)
        src = srcs[i % len(srcs)]
        os.link(src, folder / f"p{i:07d}{src.suffix}")
    (media / "done").write_text("")  # not media: skipped by the walk, marks the folder complete
    return media


def status_kb(pid: int, key: str) -> int:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def rows(out: Path) -> int:
    try:
        with open(out / "manifest.jsonl", "rb") as f:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    except OSError:
        return 0


def first_run(media: Path, out: Path, ckpt: Path, tree: Path | None, want_rows: int, limit: float) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = f"{tree}{os.pathsep}{env.get('PYTHONPATH', '')}"
    out, ckpt = out.resolve(), ckpt.resolve()
    cmd = [*CLI, "encode", str(media), "-o", str(out), "--model", str(ckpt), *FLAGS, "--workers", "1",
           "--flush-seconds", "1"]
    start, first, peak = time.perf_counter(), None, 0
    # cwd: not a checkout, since `python -m` puts the current folder before PYTHONPATH
    proc = subprocess.Popen(cmd, env=env, cwd="/", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    load = os.getloadavg()[0]
    while proc.poll() is None and time.perf_counter() - start < limit:
        peak = max(peak, status_kb(proc.pid, "VmHWM"))
        n = rows(out)
        if n and first is None:
            first = time.perf_counter() - start
        if n >= want_rows:
            break
        time.sleep(0.2)
    peak = max(peak, status_kb(proc.pid, "VmHWM"))
    stopped = time.perf_counter() - start
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return {"tree": str(tree) if tree else "this", "peak_rss_mb": round(peak / 1024), "first_row_s":
            round(first, 1) if first else None, "stopped_at_s": round(stopped, 1), "rows_at_stop": rows(out),
            "load_1min": [round(load, 2), round(os.getloadavg()[0], 2)],
            "first_row": first_row(out), "log": [line for line in err.splitlines() if line.startswith("gemma4enc")][:2]}


def first_row(out: Path) -> str | None:
    """The first file encoded: the whole folder's first in one sorted list, the first chunk's when streamed."""
    try:
        with open(out / "manifest.jsonl") as f:
            return json.loads(f.readline())["rel"]
    except (OSError, ValueError, KeyError):
        return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, action="append", help="new files (repeatable); default 100000")
    p.add_argument("--work", type=Path, default=Path("bench-work"))
    p.add_argument("--baseline", type=Path, help="a gemma4enc checkout to compare with (its package first on PYTHONPATH)")
    p.add_argument("--rows", type=int, default=200, help="rows in the manifest before the run is stopped")
    p.add_argument("--limit", type=float, default=1800, help="seconds a run may take to get there")
    p.add_argument("--keep", action="store_true", help="keep the media folders")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    ckpt = checkpoint(args.work)
    results = []
    for n in args.n or [100_000]:
        t = time.perf_counter()
        media = make_media(args.work, n)
        print(f"N={n}: links made in {time.perf_counter() - t:.0f} s", flush=True)
        for tree in [None, *([args.baseline] if args.baseline else [])]:
            r = {"n": n, **first_run(media, args.work / f"first-out-{n}", ckpt, tree, args.rows, args.limit)}
            print(json.dumps(r), flush=True)
            results.append(r)
        if not args.keep:
            shutil.rmtree(media, ignore_errors=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
