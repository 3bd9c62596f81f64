"""One local run: lock and preflight the output folder, load the model, what is left to do, the pipeline.

Also the read-only reports behind `plan` and `inspect`.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from . import __version__
from .discover import Item
from .errors import UsageError, first_lines
from .options import Options
from .outdir import SETTINGS, Lock, describe, prepare_out, still_to_do
from .shards import MANIFEST, OUT_DTYPES, SHARD_RE, ShardWriter, read_manifest

def metadata(options: Options, tower) -> dict[str, str]:
    """Shard header: everything a reader needs to know what the numbers are."""
    ckpt = tower.checkpoint
    return {
        "producer": f"gemma4enc {__version__}",
        "model": options.model,
        "revision": str(ckpt.revision) if ckpt and ckpt.revision else "",
        "dtype": str(tower.dtype).removeprefix("torch."),
        "out_dtype": options.out_dtype,
        "image_soft_tokens": str(options.image_tokens),
        "video_soft_tokens": str(options.video_tokens),
        "sampling": json.dumps(asdict(options.sampling)),
        "hidden_size": str(tower.out_dim),
    }


def devices(options: Options) -> list[str]:
    """--devices (all | a comma list) or the one --device."""
    if not options.devices:
        return [options.device]
    if options.devices == "all":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--devices all: this torch sees no CUDA device; use --device cpu")
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    names = [d.strip() for d in options.devices.split(",") if d.strip()]
    if not names:
        raise UsageError(f"--devices {options.devices!r}: use all or a list like cuda:0,cuda:1")
    return names


def open_tower(options: Options, device: str | None = None):
    """--model, --dtype, --device (or `device`), --batching → (tower, dtype name, batching mode)."""
    from .model import dtype_name, parse_device
    from .plan import resolve_batching
    from .tower import load_tower

    device = device or options.device
    dtype = dtype_name(options.dtype, parse_device(device))
    tower = load_tower(options.model, dtype, device)
    if options.compile:
        tower.compile()
    return tower, dtype, resolve_batching(options.batching, tower.device)


def encode_files(items: list[Item], out: Path, options: Options, bar, log=None, overwrite: bool = False) -> dict:
    """The whole run, under OUT's lock, on the chosen engine; returns the summary that --json prints."""
    out = Path(out)
    log = log or (lambda message: None)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot write to {out}: {e.strerror or e}") from None
    with Lock(out) as lock:
        if lock.previous:
            log(f"took over the lock of an earlier run that is gone ({describe(lock.previous)})")
        for note in prepare_out(out, options, overwrite):
            log(note)
        todo = still_to_do(items, out, options)
        if options.engine == "ray":
            from .engines.ray import encode_on_ray

            summary, where = encode_on_ray(todo, out, options, bar, log, done=len(items) - len(todo))
        else:
            summary, where = _encode_here(todo, out, options, bar, log, done=len(items) - len(todo))
    rows = read_manifest(out)
    failures = [f"{Path(r['path']).name}: {r['status']}" for i in todo if (r := rows.get(i.path)) and r["status"] != "ok"]
    if failures:
        log(f"{len(failures)} file(s) failed: {first_lines(failures)} (see {out / MANIFEST})")
    return {
        "out": str(out), "files": len(items), "done_before": len(items) - len(todo), "encoded": summary.ok,
        "failed": summary.failed, "by_status": summary.by_status, "frames": summary.frames,
        "tokens": summary.tokens, "patches": summary.patches, "seconds": round(summary.seconds, 3),
        "items_per_s": round(summary.files / summary.seconds, 3) if summary.seconds else None,
        "patches_per_s": round(summary.patches / summary.seconds, 1) if summary.seconds else None,
        "engine": options.engine, **where,
    }


def _encode_here(todo: list[Item], out: Path, options: Options, bar, log, done: int):
    """The local engine: this process feeds the tower, its decode workers feed it."""
    from .pipeline import run
    from .plan import budget_patches

    towers = [open_tower(options, device) for device in devices(options)]
    (tower, dtype, mode), towers = towers[0], [t for t, _, _ in towers]
    if len({(t.device.type, t.dtype) for t in towers}) > 1:
        raise UsageError("--devices: give devices of one kind (their outputs must be the same)")
    max_patches = min(budget_patches(t, options, mode) for t in towers) if todo else 0
    names = ", ".join(str(t.device) for t in towers)
    log(f"{done + len(todo)} files, {done} already done; {names}, {dtype}, "
        f"batching {mode}, ≤{max_patches} patches per call")
    writer = ShardWriter(out, options.out_dtype, metadata(options, tower), options.shard_bytes, options.pooled,
                         options.flush_seconds)
    progress = bar(len(todo))
    try:
        summary = run(todo, towers, options, writer, mode, max_patches, progress)
    except KeyboardInterrupt:
        writer.flush()  # keep what is finished
        raise
    finally:
        progress.close()
    where = {"device": names, "dtype": dtype, "batching": mode, "max_batch_patches": max_patches}
    return summary, where | ({"device_patches": summary.device_patches} if len(towers) > 1 else {})


def plan_report(items: list[Item], image_tokens: int, video_tokens: int, frames: int, hidden: int,
                out_dtype: str) -> dict:
    """Dry run from headers only: no pixels decoded, no model loaded."""
    from PIL import Image

    from .patches import POOL, target_size

    kinds, buckets, unreadable = Counter(), Counter(), 0
    tokens = 0
    for item in items:
        kinds[item.kind] += 1
        try:
            if item.kind == "image":
                with Image.open(item.path) as im:
                    size, count = im.size, 1
                budget = image_tokens
            elif item.kind == "video":
                import av

                with av.open(item.path) as c:
                    s = c.streams.video[0]
                    size, count = (s.width, s.height), min(frames, s.frames or frames)
                budget = video_tokens
            else:
                continue
            h, w = target_size(size[1], size[0], budget)
            n = (h // 16) * (w // 16)
        except Exception:  # noqa: BLE001 - a dry run counts what it cannot read, encode will say why
            unreadable += 1
            continue
        buckets[n] += count
        tokens += count * n // (POOL * POOL)
    width = OUT_DTYPES[out_dtype].itemsize
    return {
        "files": len(items), "by_kind": dict(kinds), "unreadable": unreadable, "tower_items": sum(buckets.values()),
        "distinct_patch_counts": len(buckets), "largest_buckets": dict(buckets.most_common(8)),
        "tokens": tokens, "output_bytes": tokens * hidden * width,
    }


def inspect_report(out: Path) -> dict:
    out = Path(out)
    if not (out / MANIFEST).exists():
        raise UsageError(f"{out}: no {MANIFEST}; is this a gemma4enc output folder?")
    rows = read_manifest(out)
    status = Counter(r["status"] for r in rows.values())
    named = {r["shard"] for r in rows.values() if r.get("shard")}
    on_disk = {p.name for p in out.iterdir() if SHARD_RE.match(p.name)}
    failures = [f"{r['path']}: {r['status']}: {r.get('error')}" for r in rows.values() if r["status"] != "ok"]
    return {
        "out": str(out), "files": len(rows), "by_status": dict(status),
        "by_kind": dict(Counter(r["kind"] for r in rows.values())),
        "tokens": sum(r.get("tokens") or 0 for r in rows.values()), "shards": len(on_disk),
        "missing_shards": sorted(named - on_disk), "orphan_shards": sorted(on_disk - named),
        "deleted_inputs": sum(1 for p in rows if not os.path.exists(p)),
        "settings": json.loads((out / SETTINGS).read_text()) if (out / SETTINGS).exists() else None,
        "failures": failures[:20],
    }
