"""Decode to patches on real-size media, per core: what a decode worker does, and how many feed a tower.

    python benchmarks/decode.py [DIR] [--json bench-out/decode.json]      (or: make bench-decode DIR=...)

Without DIR it measures the real-size set of `gemma4enc bench --e2e` (gemma4enc/benchmedia.py:
12 MP and 24 MP JPEGs, some under EXIF orientation 6, a 12 MP HEIC, 2560×1440 PNG screenshots,
10 s 480p and 60 s 1080p H.264, 10 s 1080p HEVC and VP9), made once and cached (--cache, default
~/.cache/gemma4enc/bench-media). With DIR: a sample of that folder's files, grouped by format.

Each (kind, method) runs in a fresh process doing exactly a worker's job (`media/prepare.py`'s `prepare`:
decode + patchify), so its CPU time (time.process_time) is the cost per core and its peak RSS
(VmHWM) the memory of one worker. Methods run in rotating order, round after round,
and each is reported by its median round, so the ratios are side by side under the same load.
Images: --resize fast, --resize exact, and transformers' Gemma4ImageProcessorPil (Pillow open +
EXIF turn + processor call, what a transformers user writes); PSNR of fast against exact patch
pixels. Videos: each --video-backend as `encode` would run it. Progress goes to stderr every
few seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gemma4enc.dev import benchmedia  # noqa: E402

IMAGE_METHODS = ("fast", "exact", "transformers")
VIDEO_METHODS = ("auto", "pyav") + (("decord",) if __import__("importlib.util").util.find_spec("decord") else ())
PROGRESS_S = 3.0
IDENTICAL_DB = 100.0  # PSNR reported for identical pixels (JSON has no infinity)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---- one measurement, in its own process ------------------------------------------------------


def child(spec: dict) -> dict:
    """Run one method over the files `repeats` times; CPU seconds per file, RSS after imports."""
    from gemma4enc.media.kinds import SNIFF_BYTES, Item, sniff
    from gemma4enc.media.prepare import prepare
    from gemma4enc.options import Options, Sampling

    method, files, label = spec["method"], spec["files"], spec["label"]
    if method == "transformers":
        from PIL import Image, ImageOps
        from transformers.models.gemma4.image_processing_pil_gemma4 import (
            Gemma4ImageProcessorPil,
        )

        from gemma4enc.media.image import register_heif

        register_heif()  # HEIC opens in Pillow as it does for gemma4enc (pillow-heif's opener)
        processor = Gemma4ImageProcessorPil(max_soft_tokens=spec["budget"])

        def one(path):
            with Image.open(path) as image:
                upright = ImageOps.exif_transpose(image).convert("RGB")  # as transformers' load_image does
            out = processor(images=[upright], return_tensors="np")
            return int(out["num_soft_tokens_per_image"][0]) * 9, 1
    else:
        backend = method if method in ("decord", "pyav") else "auto"
        options = Options(image_tokens=spec["budget"], video_tokens=spec["video_tokens"],
                          resize=method if method in ("fast", "exact") else "fast", video_backend=backend,
                          sampling=Sampling(frames=spec["frames"]))

        def one(path):
            with open(path, "rb") as f:
                kind = sniff(f.read(SNIFF_BYTES)) or "unknown"
            st = os.stat(path)
            d = prepare(Item(path, kind, st.st_size, st.st_mtime_ns), options)
            if d.status != "ok":
                raise SystemExit(f"{path}: {d.status}: {d.error}")
            return sum(p.n for p in d.patches), len(d.patches)

    from gemma4enc.dev.e2e import (
        peak_rss,  # VmHWM, not ru_maxrss: Linux carries that across exec from the parent
    )

    base_rss = peak_rss()  # the modules a worker holds
    one(files[0])  # warm-up: first-call costs (codec tables, lazy imports) are not per-file costs
    cpu, frames, patches, done, last = 0.0, 0, 0, 0, time.monotonic()
    total = len(files) * spec["repeats"]
    for _ in range(spec["repeats"]):
        for path in files:
            start = time.process_time()
            n, f = one(path)
            cpu += time.process_time() - start
            patches, frames, done = patches + n, frames + f, done + 1
            if time.monotonic() - last > PROGRESS_S:
                last = time.monotonic()
                log(f"  {label} {method}: {done}/{total} files, {1e3 * cpu / done:.0f} ms CPU per file")
    return {"files": done, "frames": frames, "patches": patches, "cpu_s": cpu, "rss_after_imports": base_rss,
            "peak_rss": peak_rss()}


def measure(spec: dict) -> dict:
    """`child(spec)` in a fresh interpreter (its progress on our stderr); its result."""
    cmd = [sys.executable, __file__, "--child", json.dumps(spec)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{spec['label']} {spec['method']} failed (exit {proc.returncode})")
    return json.loads(proc.stdout)


def psnr_fast_vs_exact(files: list[str], budget: int) -> list[float]:
    from gemma4enc.media.decode import decode_image
    from gemma4enc.media.patches import patchify

    scores = []
    for path in files:
        exact = patchify(decode_image(path, None).images[0], budget).pixels.astype(np.float64)
        fast = patchify(decode_image(path, None, fit=budget).images[0], budget).pixels.astype(np.float64)
        mse = float(np.mean((exact - fast) ** 2)) if exact.shape == fast.shape else float("nan")
        scores.append(IDENTICAL_DB if mse == 0 else min(IDENTICAL_DB, 10 * np.log10(255.0**2 / mse)))
    return scores


def profile(files: list[str], budget: int, resize: str, top: int = 6) -> dict[str, float]:
    """Where a worker's time goes on these files: ms of CPU per file in the costliest functions."""
    import cProfile
    import pstats

    from gemma4enc.media.kinds import Item
    from gemma4enc.media.prepare import prepare
    from gemma4enc.options import Options

    options = Options(image_tokens=budget, resize=resize)
    items = [Item(f, "image", os.path.getsize(f), 0) for f in files]
    prepare(items[0], options)  # warm-up
    prof = cProfile.Profile(time.process_time)
    prof.runcall(lambda: [prepare(item, options) for item in items])
    stats = pstats.Stats(prof).stats  # (file, line, function) -> (calls, primitive, tottime, cumtime, callers)
    ranked = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return {f"{Path(k[0]).name}:{k[2]}": round(1e3 * v[2] / len(items), 1) for k, v in ranked}


# ---- the report -----------------------------------------------------------------------------


def run(groups: dict[str, list[str]], args) -> dict:
    report = {"budget": args.max_soft_tokens, "video_tokens": args.video_soft_tokens, "frames": args.frames,
              "rounds": args.rounds, "tower_rate": args.tower_rate, "tower_frame_rate": args.tower_frame_rate,
              "cpu": cpu_model(), "kinds": {}}
    for kind, files in groups.items():
        is_video = benchmedia.is_video(kind)
        methods = VIDEO_METHODS if is_video else IMAGE_METHODS
        repeats = 1 if is_video else max(1, args.min_files // len(files))
        rounds: dict[str, list[dict]] = {m: [] for m in methods}
        for r in range(args.rounds):
            for m in methods[r % len(methods):] + methods[: r % len(methods)]:
                spec = {"method": m, "files": files, "repeats": repeats, "budget": args.max_soft_tokens,
                        "video_tokens": args.video_soft_tokens, "frames": args.frames, "label": f"{kind} round {r + 1}/{args.rounds}"}
                rounds[m].append(measure(spec))
        rows = {}
        for m, results in rounds.items():
            unit = "frames" if is_video else "files"
            per_core = statistics.median(res[unit] / res["cpu_s"] for res in results)
            rows[m] = {"per_core": per_core, "ms_cpu_per_file": statistics.median(
                1e3 * res["cpu_s"] / res["files"] for res in results),
                "peak_rss_mb": max(res["peak_rss"] for res in results) / 2**20,
                "rss_after_imports_mb": max(res["rss_after_imports"] for res in results) / 2**20,
                "cores_to_feed": (args.tower_frame_rate if is_video else args.tower_rate) / per_core}
        entry = {"files": len(files), "methods": rows, "unit": "sampled frames/s/core" if is_video else "images/s/core"}
        if not is_video:
            scores = psnr_fast_vs_exact(files, args.max_soft_tokens)
            entry["psnr_db"] = {"mean": float(np.mean(scores)), "worst": float(np.min(scores)), "each": scores}
            entry["fast_vs_exact"] = rows["fast"]["per_core"] / rows["exact"]["per_core"]
            entry["fast_vs_transformers"] = rows["fast"]["per_core"] / rows["transformers"]["per_core"]
            entry["profile_ms_per_file"] = {m: profile(files, args.max_soft_tokens, m) for m in ("fast", "exact")}
        report["kinds"][kind] = entry
        log(table(kind, entry))
    return report


def table(kind: str, entry: dict) -> str:
    lines = [f"\n{kind}: {entry['files']} files, {entry['unit']}",
             f"{'method':<13} {'per core':>9} {'ms CPU/file':>12} {'peak RSS MB':>12} {'(imports)':>10} {'cores to feed':>14}"]
    for m, r in entry["methods"].items():
        lines.append(f"{m:<13} {r['per_core']:>9.2f} {r['ms_cpu_per_file']:>12.1f} {r['peak_rss_mb']:>12.0f} "
                     f"{r['rss_after_imports_mb']:>10.0f} {r['cores_to_feed']:>14.1f}")
    if "psnr_db" in entry:
        lines.append(f"fast vs exact {entry['fast_vs_exact']:.2f}x, vs transformers {entry['fast_vs_transformers']:.2f}x;"
                     f" PSNR fast vs exact: mean {entry['psnr_db']['mean']:.1f} dB, worst {entry['psnr_db']['worst']:.1f} dB")
        for m, top in entry["profile_ms_per_file"].items():
            lines.append(f"  {m} profile, ms CPU/file: " + ", ".join(f"{k} {v}" for k, v in top.items()))
    return "\n".join(lines)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("dir", nargs="?", help="measure a sample of this folder instead of the generated set")
    p.add_argument("--cache", help="where the generated media are cached (default ~/.cache/gemma4enc/bench-media)")
    p.add_argument("--kinds", nargs="*", help="only these generated kinds (default: all)")
    p.add_argument("--sample", type=int, default=6, help="DIR: files per format")
    p.add_argument("--max-soft-tokens", type=int, default=280)
    p.add_argument("--video-soft-tokens", type=int, default=70)
    p.add_argument("--frames", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3, help="rounds of every method, rotating order; medians")
    p.add_argument("--min-files", type=int, default=8, help="images decoded per process and round (files repeat)")
    p.add_argument("--tower-rate", type=float, default=370.0, help="photos/s the tower takes (H200, E2B, 280 tokens)")
    p.add_argument("--tower-frame-rate", type=float, default=1900.0, help="video frames/s the tower takes (70 tokens)")
    p.add_argument("--json", help="also write the report here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    if args.cache:
        os.environ["GEMMA4ENC_BENCH_MEDIA"] = args.cache
    groups = benchmedia.sampled(Path(args.dir), args.sample) if args.dir else benchmedia.generated(args.kinds, log)[0]
    start = time.monotonic()
    report = run(groups, args)
    report["source"] = args.dir or str(benchmedia.cache_dir())
    report["wall_s"] = time.monotonic() - start
    report["load_average"] = os.getloadavg()
    log(f"\n{report['cpu']}; load average {report['load_average'][0]:.1f}; {report['wall_s']:.0f} s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
