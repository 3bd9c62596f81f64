"""The read-only commands: `plan` (a dry run from headers), `inspect` (an output folder in
numbers) and `verify` (every shard read and checked against its rows). None of them writes.

verify's problems (exit 1): a named shard missing or unreadable, a header or tensor that disagrees
with the format or the rows (counts, offsets, dtype, width), non-finite values, an ok row
without a shard. Warnings (exit 0): what an interrupted run leaves and the next run clears —
shards no row names, temp files, a torn last manifest line.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from ..errors import UsageError
from ..media import webdataset
from ..media.kinds import Item
from ..media.sources import exists
from ..options import DEFAULT_FRAMES, OUT_DTYPES, Options, Sampling
from ..output.names import MANIFEST, not_an_output
from ..output.out import Out
from ..rows import Status

CHUNK_ROWS = 1 << 16  # tokens are checked this many rows at a time: memory stays small for 1 GB shards
OFFSETS = ("item_offsets", "frame_offsets", "item_frames")


def plan_report(items: list[Item], options: Options, hidden: int) -> dict:
    """Dry run from headers only: no pixels decoded, no model loaded. With --fps a video's frame
    count is estimated from its duration."""
    from PIL import Image

    from ..media.patches import POOL, target_size

    kinds, buckets, unreadable = Counter(), Counter(), 0
    tokens = 0
    for item in items:
        kinds[item.kind] += 1
        source = item.path
        try:
            # a URL's or a tar member's: a file object
            source = webdataset.open_source(item.path, item.root, item.rel)
            if item.kind == "image":
                with Image.open(source) as im:
                    size, count = im.size, 1
                budget = options.image_tokens
            elif item.kind == "video":
                import av

                with av.open(source) as c:
                    s = c.streams.video[0]
                    container_s = c.duration / 1_000_000 if c.duration else 0.0  # AV_TIME_BASE: µs
                    size, count = (s.width, s.height), _video_frames(options.sampling, s, container_s)
                budget = options.video_tokens
            else:
                continue
            h, w = target_size(size[1], size[0], budget)
            n = (h // 16) * (w // 16)
        except Exception:  # noqa: BLE001 - a dry run counts what it cannot read, encode will say why
            unreadable += 1
            continue
        finally:
            if source is not item.path:
                source.close()
        buckets[n] += count
        tokens += count * n // (POOL * POOL)
    width = OUT_DTYPES[options.out_dtype][1]  # no torch for a dry run
    return {
        "files": len(items),
        "by_kind": dict(kinds),
        "unreadable": unreadable,
        "tower_items": sum(buckets.values()),
        "distinct_patch_counts": len(buckets),
        "largest_buckets": dict(buckets.most_common(8)),
        "tokens": tokens,
        "output_bytes": tokens * hidden * width,
    }


def _video_frames(sampling: Sampling, stream, container_s: float = 0.0) -> int:
    """Frames `sampling` takes from a video stream, from its header: --frames, or --fps over its
    duration. Where the stream states no frame count or duration (WebM, Matroska), the
    container's duration and the stream's rate stand for them."""
    seconds = float(stream.duration * stream.time_base) if stream.duration and stream.time_base else container_s
    rate = float(stream.average_rate or 0)
    total = stream.frames or (round(seconds * rate) if seconds and rate else 0)
    if sampling.fps is None:
        return min(sampling.frames or DEFAULT_FRAMES, total or sampling.frames or DEFAULT_FRAMES)
    if stream.average_rate:
        seconds -= 1 / float(
            stream.average_rate
        )  # sampling runs to the last frame's start, not the stream's end
    count = min(sampling.max_frames, int(max(seconds, 0.0) * sampling.fps + 1e-6) + 1)
    return min(count, total) if total else count


def _output_folder(out) -> Out:
    if not out.found():
        raise UsageError(not_an_output(out.url))
    return out


def inspect_report(out: Out) -> dict:
    """One pass over the manifest into the compact ledger; whole rows are read for failures only."""
    out = _output_folder(out)
    ledger = out.ledger()
    status, kinds, tokens, deleted, failed = Counter(), Counter(), 0, 0, []
    for path, e in ledger.entries():
        status[e.status] += 1
        kinds[e.kind] += 1
        tokens += e.tokens
        deleted += not exists(path)
        if e.status not in (Status.OK, Status.MOVED) and len(failed) < 20:
            failed.append(e.offset)
    named = ledger.shards()
    on_disk = out.shard_names()
    failures = [f"{r['path']}: {r['status']}: {r.get('error')}" for r in ledger.rows_at(failed)]
    return {
        "out": out.url,
        "running": out.holder(),
        "files": len(ledger),
        "by_status": dict(status),
        "by_kind": dict(kinds),
        "tokens": tokens,
        "shards": len(on_disk),
        "missing_shards": sorted(named - on_disk),
        "orphan_shards": sorted(on_disk - named),
        "deleted_inputs": deleted,
        "settings": out.settings(),
        "failures": failures,
        "superseded_rows": ledger.superseded,
    }


def verify(out: Out) -> dict:
    out = _output_folder(out)
    problems: list[str] = []
    warnings: list[str] = []
    ledger = out.ledger()  # one pass; each shard's rows are read back by offset when it is checked
    torn = ledger.unreadable + (ledger.path.stat().st_size > ledger.end)
    if torn:
        warnings.append(
            f"{MANIFEST}: {torn} unreadable line(s) (a killed run's; their files are encoded again)"
        )
    by_shard, unplaced = ledger.ok_by_shard()  # shard → offsets of the rows that point into it (numpy)
    problems += [f"{path}: status ok but no shard/index" for path in unplaced]
    on_disk = out.shard_names()
    missing = sorted(set(by_shard) - on_disk)
    orphans = sorted(on_disk - set(by_shard))
    problems += [f"{name}: named by {len(by_shard[name])} row(s) but missing" for name in missing]
    if orphans:
        warnings.append(
            f"{len(orphans)} shard(s) no row names (the next encode removes them): {orphans[:5]}"
        )
    temps = out.temp_files()
    if temps:
        warnings.append(f"{len(temps)} temp file(s) of an interrupted write: {temps[:5]}")
    settings = out.settings() or {}
    tokens = 0
    bad = set(missing)
    for name in sorted(set(by_shard) & on_disk):
        with out.shard(name) as path:
            found, n = check_shard(
                path, list(ledger.rows_at(by_shard[name].tolist(), rising=False)), settings
            )
        problems += [f"{name}: {p}" for p in found]
        tokens += n
        bad |= {name} if found else set()
    return {
        "out": out.url,
        "ok": not problems,
        "files": len(ledger),
        "encoded": sum(len(v) for v in by_shard.values()),
        "shards": len(on_disk),
        "tokens_checked": tokens,
        "missing_shards": missing,
        "orphan_shards": orphans,
        "bad_shards": sorted(bad),
        "problems": problems,
        "warnings": warnings,
    }


def check_shard(path: Path, rows: list[dict], settings: dict) -> tuple[list[str], int]:
    """(problems, tokens read) for one shard and the rows that point into it."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return _check_open(f, rows, settings)
    except Exception as e:  # noqa: BLE001 - a header safetensors cannot parse is the finding
        return [f"unreadable: {type(e).__name__}: {str(e)[:200]}"], 0


def _check_open(f, rows: list[dict], settings: dict) -> tuple[list[str], int]:
    import torch

    meta = f.metadata() or {}
    keys = set(f.keys())
    # --store pooled: no tokens; the frame means are what is checked, a row per frame
    name = "frame_pooled" if meta.get("store") == "pooled" else "tokens"
    need = {name, *OFFSETS} | ({"pooled"} if name == "frame_pooled" else set())
    if not need <= keys:
        return [f"tensors {sorted(need - keys)} are missing"], 0
    problems = []
    out_dtype = meta.get("out_dtype") or settings.get("out_dtype")
    t = f.get_slice(name)
    dtype = str(t.get_dtype()).lower()
    want = OUT_DTYPES[out_dtype][0].lower() if out_dtype in OUT_DTYPES else None
    if want and dtype != want:
        problems.append(f"{name} are {dtype}, the header says {out_dtype}")
    shape = t.get_shape()
    if len(shape) != 2:
        return problems + [f"{name} have shape {shape}, want [T, D]"], 0
    total, width = shape
    if meta.get("hidden_size") and int(meta["hidden_size"]) != width:
        problems.append(f"{name} are {width} wide, the header says hidden_size {meta['hidden_size']}")
    off = {k: f.get_tensor(k) for k in OFFSETS}
    for k, v in off.items():
        if (
            v.dtype != torch.int64
            or v.ndim != 1
            or len(v) < 1
            or v[0] != 0
            or bool((v[1:] < v[:-1]).any())
        ):
            return problems + [f"{k} is not a non-decreasing int64 vector from 0"], 0
    items, frames = off["item_offsets"], off["frame_offsets"]
    n = len(items) - 1
    rows_of = frames[-1] if name == "tokens" else len(frames) - 1
    if items[-1] != frames[-1] or rows_of != total:
        problems.append(f"offsets end at {items[-1]}/{frames[-1]}, {name} have {total} rows")
    if len(off["item_frames"]) != n + 1 or off["item_frames"][-1] != len(frames) - 1:
        return problems + ["item_frames does not cover frame_offsets"], 0
    if not torch.equal(frames[off["item_frames"]], items):
        problems.append("item_offsets disagree with frame_offsets[item_frames]")
    if "pooled" in keys and list(f.get_slice("pooled").get_shape()) != [n, width]:
        problems.append(f"pooled has shape {f.get_slice('pooled').get_shape()}, want [{n}, {width}]")
    seen: dict[int, tuple] = {}  # index -> (tokens, frames) of its first row
    for row in rows:
        i = row["index"]
        twin = (row.get("tokens"), row.get("frames"))
        if isinstance(i, int) and seen.get(i) == twin:
            continue  # the same file under a second name (an alias adopted its row): checked once
        if not isinstance(i, int) or not 0 <= i < n or i in seen:
            problems.append(f"{row['path']}: index {i} is out of range or used twice")
            continue
        seen[i] = twin
        a, b = off["item_frames"][i].item(), off["item_frames"][i + 1].item()
        sizes = (frames[a + 1 : b + 1] - frames[a:b]).tolist()
        if (
            (items[i + 1] - items[i]).item() != row.get("tokens")
            or b - a != row.get("frames")
            or ("frame_tokens" in row and sizes != row["frame_tokens"])
        ):
            problems.append(
                f"{row['path']}: the row says {row.get('tokens')} tokens in {row.get('frames')} "
                f"frames, the shard holds {(items[i + 1] - items[i]).item()} in {b - a}"
            )
    for lo in range(0, total, CHUNK_ROWS):
        chunk = t[lo : min(total, lo + CHUNK_ROWS)]
        if not bool(torch.isfinite(chunk).all()):
            bad = (~torch.isfinite(chunk).all(1)).nonzero()[0].item() + lo
            problems.append(f"non-finite values in {name}, first at row {bad}")
            break
    return problems, total
