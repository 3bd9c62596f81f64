"""Does host memory grow with the folder? Peak RSS of a real `gemma4enc encode` over N and 10 × N files.

    .venv/bin/python benchmarks/rss.py [--items 500] [--workers W] [--json bench-out/rss.json]   (make bench-rss)

Small generated photos and clips (hard links, so 5,000 files cost no disk), the tiny random
checkpoint of `demo`, CPU; each run is a fresh process whose peak RSS the kernel reports (wait4).
Finished files wait in memory for their shard, which is written by size or every --flush-seconds;
that buffer is bounded by those two, not by the folder, and both runs flush every 10 s so that
both reach it (at the default 60 s a 500-file run ends before its first shard).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def rss(counts=(500, 5000), workers=None, log=print) -> dict:
    from PIL import Image

    from gemma4enc.dev.demo import barcode_frame, build, write_video
    from gemma4enc.media.workers import default_workers

    workers = default_workers() if workers is None else workers
    report = {"workers": workers, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="gemma4enc-rss-") as tmp:
        tmp = Path(tmp)
        build(tmp / "ckpt", seed=0)
        seeds = tmp / "seeds"
        seeds.mkdir()
        for i, (w, h) in enumerate([(160, 120), (120, 160), (200, 100), (96, 96), (240, 135)]):
            Image.fromarray(barcode_frame(i, w, h)).save(seeds / f"p{i}.jpg")
        write_video(seeds / "clip.mp4", frames=16, size=(96, 64))
        seed_files = sorted(seeds.iterdir())
        for n in counts:
            report["runs"][n] = one_run(tmp, n, seed_files, workers)
            r = report["runs"][n]
            log(f"{n:>6} files: {r['seconds']:7.1f} s, {n / r['seconds']:6.1f} files/s, "
                f"peak RSS {r['peak_rss_bytes'] / 2**20:7.1f} MB")
    small, large = (report["runs"][n]["peak_rss_bytes"] for n in (min(counts), max(counts)))
    report["ratio"] = large / small
    log(f"peak RSS {max(counts)} files / {min(counts)} files: {report['ratio']:.2f} (target ≤ 1.2)")
    return report


def one_run(tmp: Path, n: int, seed_files: list[Path], workers: int) -> dict:
    media = tmp / f"media{n}"
    for i in range(n):  # 1 in 6 a clip (4 frames sampled), the rest photos
        sub = media / f"{i // 1000:03d}"
        sub.mkdir(parents=True, exist_ok=True)
        seed = seed_files[i % len(seed_files)]
        os.link(seed, sub / f"{i:06d}{seed.suffix}")
    cmd = [sys.executable, "-m", "gemma4enc", "encode", str(media), "-o", str(tmp / f"out{n}"),
           "--model", str(tmp / "ckpt"), "--device", "cpu", "--dtype", "float32", "--frames", "4",
           "--workers", str(workers), "--flush-seconds", "10", "--json", "-q"]
    start = time.perf_counter()
    with open(tmp / "out.json", "wb") as out, open(tmp / "err.txt", "wb") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)  # not proc.wait(): wait4 also gives the peak RSS
        proc.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - start
    summary = json.loads((tmp / "out.json").read_text() or "{}")
    if proc.returncode != 0 or summary.get("encoded") != n:
        raise RuntimeError(f"encode of {n} files failed ({proc.returncode}): {(tmp / 'err.txt').read_text()[-500:]}")
    # KiB; the largest process of the run's tree that was waited for
    return {"files": n, "seconds": seconds, "peak_rss_bytes": usage.ru_maxrss * 1024}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=int, default=500, help="the small folder's files; the large has 10 ×")
    parser.add_argument("--workers", type=int, help="decode workers (default: encode's)")
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args(argv)
    report = rss((args.items, 10 * args.items), args.workers)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
