"""--engine local: this process feeds the tower(s), its decode workers feed it."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..errors import UsageError
from ..media.kinds import Item
from ..media.workers import DecodePool
from .context import Run

if TYPE_CHECKING:
    from .pipeline import Summary


def encode(todo: list[Item], run: Run) -> Summary:
    """Encode `todo` with one tower per device; rows land in OUT's manifest as shards are written."""
    options = run.options
    # they start while the model loads (or earlier, while torch imports: see run.early_pool)
    workers = options.workers if options.workers is None or not isinstance(todo, list) else min(
        options.workers, max(1, len(todo)))  # a process per file at most (a streamed todo: as asked)
    pool = run.pool or DecodePool(options, workers, options.decode_timeout).start()
    try:
        return _encode_with(pool, todo, run)
    finally:
        pool.close()


def _encode_with(pool: DecodePool, todo: list[Item], run: Run) -> Summary:
    # torch comes in here, once the workers are on their way (importing it takes seconds)
    from ..model.batching import budget_patches
    from ..model.load import devices, open_tower
    from ..output.shards import ShardWriter, shard_metadata
    from .pipeline import run as pipeline
    from .pipeline import where_time_went

    options = run.options
    start = time.perf_counter()
    opened = [open_tower(options, device) for device in devices(options)]
    (tower, dtype, mode), towers = opened[0], [t for t, _, _ in opened]
    if len({(t.device.type, t.dtype) for t in towers}) > 1:
        raise UsageError("--devices: give devices of one kind (their outputs must be the same)")
    run.ready()
    max_patches = min(budget_patches(t, options, mode) for t in towers) if todo else 0
    names = ", ".join(str(t.device) for t in towers)
    run.log(
        f"{run.done + len(todo)} files, {run.done} already done; {names}, {dtype}, "
        f"batching {mode}, ≤{max_patches} patches per call; model loaded in {time.perf_counter() - start:.1f} s"
    )
    writer = ShardWriter(
        run.out,  # OUT at a URL: each shard uploaded, then its rows sent as a manifest part
        options.out_dtype,
        shard_metadata(options, tower),
        options.shard_bytes,
        options.pooled,
        options.flush_seconds,
    )
    progress = run.bar(len(todo))
    try:
        summary = pipeline(todo, towers, options, writer, mode, max_patches, progress, pool=pool)
    except KeyboardInterrupt:
        writer.flush()  # keep what is finished
        raise
    finally:
        progress.close()
    writer.close()  # all is on disk (the pipeline flushed); its thread ends now, not at exit
    facts, verdict = where_time_went(summary, pool.workers)
    if verdict:
        run.log(verdict)
    summary.where = {
        "device": names,
        "dtype": dtype,
        "batching": mode,
        "max_batch_patches": max_patches,
        **facts,
    }
    if len(towers) > 1:
        summary.where["device_patches"] = summary.device_patches
    return summary
