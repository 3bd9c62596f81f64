"""`gemma4enc bench --e2e [DIR]`: can this machine's cores decode real media as fast as its tower encodes it?

Real-size media (generated once and cached, `benchmedia`), or a sample of the user's DIR, per
kind: a decode worker's CPU time per image or sampled frame (decode to patches, what `encode`'s
workers do), its peak RSS, and how many such cores keep the tower fed at the tower rate measured
here (or given with --tower-rate). Then the whole set through decode workers → tower → shards:
decode-only, encode-only, end-to-end and their overlap. A progress line every few seconds.

This module is imported by decode workers (its `timed_prepare`): no torch at module level.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from pathlib import Path

from ..errors import UsageError
from ..media.prepare import Decoded, prepare
from . import benchmedia

PROGRESS_S = 5.0
MIN_IMAGES = 8  # images decoded per kind (files repeat): enough CPU time to measure


def timed_prepare(item, options) -> tuple[Decoded, float, int]:
    """A worker's job on one file, with the worker's CPU seconds for it and its peak RSS so far."""
    start = time.process_time()
    decoded = prepare(item, options)
    return decoded, time.process_time() - start, peak_rss()


def peak_rss() -> int:
    """This process's RSS high-water mark in bytes (VmHWM), 0 where /proc has none."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@contextlib.contextmanager
def ticking(label: str, log, every: float = PROGRESS_S):
    """Log `label: N s` every few seconds while the block runs, so a long stage is never silent."""
    done = threading.Event()
    start = time.monotonic()

    def tick():
        while not done.wait(every):
            log(f"  {label}: {time.monotonic() - start:.0f} s")

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def items_of(files: list[str]):
    import os

    from ..media.kinds import SNIFF_BYTES, Item, sniff

    out = []
    for path in files:
        with open(path, "rb") as f:
            kind = sniff(f.read(SNIFF_BYTES)) or "unknown"
        st = os.stat(path)
        out.append(Item(path, kind, st.st_size, st.st_mtime_ns))
    return out


def decode_kind(kind: str, files: list[str], options, log) -> dict | None:
    """One worker process decodes this kind's files: CPU per image / sampled frame, peak RSS, patches.

    None when none of them decodes."""
    from ..media.workers import DecodePool

    items = items_of(files)
    if not benchmedia.is_video(kind):
        items = (items * MIN_IMAGES)[: max(MIN_IMAGES, len(items))]
    pool = DecodePool(options, workers=1, timeout=options.decode_timeout, fn=timed_prepare)
    cpu, frames, patches, peak, done, last = 0.0, 0, 0, 0, 0, time.monotonic()
    failed: set[str] = set()
    for result in pool.map(items):
        decoded, seconds, rss = (
            (result, 0.0, 0) if isinstance(result, Decoded) else result
        )  # bare: worker died
        if decoded.status != "ok":  # a user's folder may hold a bad file: it is left out, said once
            if decoded.item.path not in failed:
                log(f"  {kind}: left out {decoded.item.path}: {decoded.status}: {decoded.error}")
            failed.add(decoded.item.path)
            continue
        cpu, peak, done = cpu + seconds, max(peak, rss), done + 1
        frames, patches = frames + len(decoded.patches), patches + sum(p.n for p in decoded.patches)
        if time.monotonic() - last > PROGRESS_S:
            last = time.monotonic()
            log(f"  {kind}: {done}/{len(items)} files, {1e3 * cpu / done:.0f} ms CPU per file")
    if not frames:
        return None
    cpu = max(cpu, 1e-9)
    return {
        "files": len(files) - len(failed),
        "left_out": sorted(failed),
        "decoded": done,
        "frames": frames,
        "patches": patches,
        "cpu_s": cpu,
        "per_core": frames / cpu,
        "unit": "sampled frames/s/core" if benchmedia.is_video(kind) else "images/s/core",
        "ms_cpu_per_frame": 1e3 * cpu / frames,
        "patches_per_core_s": patches / cpu,
        "peak_rss_per_worker_bytes": peak,
    }


def e2e(
    size="e2b",
    layers=None,
    device="auto",
    dtype="auto",
    count=24,
    workers=None,
    repeats=3,
    folder=None,
    tower_rate=None,
    image_tokens=280,
    frames=32,
    log=print,
) -> dict:
    """The report of `bench --e2e`: per kind decode rates and cores to feed, then the overlap on the whole set.

    folder: a user's folder (`count` files per kind and extension sampled), else the generated set.
    tower_rate: photos/s at `image_tokens` the tower takes (e.g. an H200's), instead of measuring it here.
    frames: sampled per video (uniformly, as Gemma4VideoProcessor), each at 70 tokens.
    """
    from ..media.workers import default_workers
    from ..model.batching import resolve_batching
    from ..model.load import dtype_name, parse_device, parse_dtype
    from ..options import Options, Sampling
    from .bench import default_patches, random_tower, tower_layers

    start = time.monotonic()
    if folder:
        groups, generation_s = benchmedia.sampled(Path(folder), count), 0.0
    else:
        groups, generation_s = benchmedia.generated(log=log)
        if generation_s:
            log(f"generated the benchmark media in {generation_s:.0f} s of CPU (cached for next time)")
    if not groups:
        raise UsageError(f"{folder}: no images or videos to measure")
    dev = parse_device(device)
    dt = parse_dtype(dtype_name(dtype, dev))
    workers = default_workers() if workers is None else workers
    options = Options(
        workers=workers, decode_timeout=600, image_tokens=image_tokens, sampling=Sampling(frames=frames)
    )
    kinds = {}
    for kind, files in groups.items():
        log(f"decoding {kind}: {len(files)} file(s), one worker")
        if (entry := decode_kind(kind, files, options, log)) is not None:
            kinds[kind] = entry
    if not kinds:
        raise UsageError(f"{folder}: none of the sampled files decodes")
    tower = random_tower(size, layers, dev, dt)
    mode, max_patches = resolve_batching("auto", dev, tower.attention), default_patches(dev)
    all_files = [
        f
        for kind, files in groups.items()
        if kind in kinds
        for f in files
        if f not in kinds[kind]["left_out"]
    ]
    overlap = _overlap(
        tower, mode, max_patches, items_of(all_files), options, workers, repeats, dev, log
    )
    if tower_rate:
        tower_patches, tower_source = tower_rate * image_tokens * 9, f"given: {tower_rate:g} photos/s"
    else:
        tower_patches, tower_source = (
            overlap["measured_tower_patches_per_s"],
            f"measured here ({dev}, {dt})",
        )
    for entry in kinds.values():
        entry["cores_to_feed"] = tower_patches / entry["patches_per_core_s"]
    report = {
        "size": size,
        "layers": tower_layers(tower),
        "device": str(dev),
        "dtype": str(dt),
        "source": str(folder) if folder else str(benchmedia.cache_dir()),
        "generation_cpu_s": generation_s,
        "workers": workers,
        "batching": mode,
        "image_tokens": image_tokens,
        "tower_patches_per_s": tower_patches,
        "tower_rate_source": tower_source,
        "kinds": kinds,
        **overlap,
        "wall_s": time.monotonic() - start,
    }
    log(table(report))
    return report


def _overlap(tower, mode, max_patches, items, options, workers, repeats, dev, log) -> dict:
    """decode-only, encode-only, end-to-end on every file, interleaved; overlap = e2e / the slower stage."""
    import itertools
    import tempfile

    import torch

    from ..media.workers import DecodePool
    from ..model.batching import Unit
    from ..output.shards import ShardWriter
    from ..output.opening import open_out
    from ..run.pipeline import Encoder, run
    from .bench import interleaved

    decoded: list = []
    with tempfile.TemporaryDirectory(prefix="gemma4enc-e2e-") as tmp:

        def decode_only():
            decoded[:] = list(DecodePool(options, workers, options.decode_timeout).map(items))

        def encode_only():
            units = [Unit(i, f, p) for i, d in enumerate(decoded) for f, p in enumerate(d.patches)]
            Encoder(tower, mode, max_patches).run(units)

        outs = itertools.count()

        def end_to_end():
            writer = ShardWriter(open_out(Path(tmp) / f"out{next(outs)}"), "bfloat16", {}, 1 << 30)
            run(items, [tower], options, writer, mode, max_patches)

        stages = {"decode-only": decode_only, "encode-only": encode_only, "end-to-end": end_to_end}
        methods = {}
        for name, fn in stages.items():

            def timed(name=name, fn=fn):
                with ticking(name, log):
                    fn()

            methods[name] = timed
        log(
            f"the whole set ({len(items)} files) through {workers} decode worker(s) and the tower, "
            f"{repeats} interleaved round(s)"
        )
        with ticking("warm-up decode", log):
            decode_only()  # warm-up, and the patches encode-only needs
        times, peaks = interleaved(
            methods, repeats, dev, torch.device("cpu")
        )  # host memory is the question
    rate = {m: len(items) / statistics.median(t) for m, t in times.items()}
    patches = sum(p.n for d in decoded for p in d.patches)
    return {
        "files": len(items),
        "repeats": repeats,
        "items_per_s": rate,
        "host_peak_rss_growth_bytes": peaks,
        "overlap": rate["end-to-end"] / min(rate["decode-only"], rate["encode-only"]),
        "end_to_end_vs_encode_only": rate["end-to-end"] / rate["encode-only"],
        "measured_tower_patches_per_s": patches / statistics.median(times["encode-only"]),
    }


def table(report: dict) -> str:
    lines = [
        f"\ndecode to patches, one worker per kind; cores to feed a tower taking "
        f"{report['tower_patches_per_s']:,.0f} patches/s ({report['tower_rate_source']})",
        f"{'kind':<18} {'files':>5} {'per core':>9} {'unit':<22} {'ms CPU each':>11} {'peak RSS MB':>11} "
        f"{'cores to feed':>13}",
    ]
    for kind, e in report["kinds"].items():
        lines.append(
            f"{kind:<18} {e['files']:>5} {e['per_core']:>9.2f} {e['unit']:<22} {e['ms_cpu_per_frame']:>11.1f} "
            f"{e['peak_rss_per_worker_bytes'] / 2**20:>11.0f} {e['cores_to_feed']:>13.2f}"
        )
    rate = report["items_per_s"]
    lines.append(
        f"\nend to end: {report['files']} files, {report['workers']} decode workers, {report['device']}, "
        f"{report['dtype']}, batching {report['batching']}"
    )
    for m, r in rate.items():
        lines.append(
            f"{m:<12} {r:>8.2f} items/s   host RSS growth {report['host_peak_rss_growth_bytes'][m] / 2**20:>7.1f} MB"
        )
    lines.append(
        f"overlap (end-to-end / min(decode-only, encode-only)): {report['overlap']:.2f}; "
        f"end-to-end / encode-only: {report['end_to_end_vs_encode_only']:.2f}"
    )
    return "\n".join(lines)
