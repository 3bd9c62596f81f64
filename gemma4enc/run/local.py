"""--engine local: this process feeds the tower(s), its decode workers feed it."""

from __future__ import annotations

from typing import TYPE_CHECKING

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
    """The in-memory encoder (run/encoder.py) with a shard writer as its sink."""
    # torch comes in here, once the workers are on their way (importing it takes seconds)
    from ..output.shards import ShardWriter, shard_metadata
    from .encoder import Encoder, open_towers
    from .pipeline import where_time_went

    options = run.options
    towers = open_towers(options, work=bool(todo))
    run.ready()
    run.log(
        f"{run.done + len(todo)} files, {run.done} already done; {towers.names}, {towers.dtype}, "
        f"batching {towers.mode}, ≤{towers.max_patches} patches per call; model loaded in {towers.seconds:.1f} s"
    )
    writer = ShardWriter(
        run.out,  # OUT at a URL: each shard uploaded, then its rows sent as a manifest part
        options.out_dtype,
        shard_metadata(options, towers.towers[0]),
        options.shard_bytes,
        options.pooled,
        options.flush_seconds,
    )
    progress = run.bar(len(todo))
    try:
        summary = Encoder(options, towers).run(todo, writer, progress, pool=pool)
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
        "device": towers.names,
        "dtype": towers.dtype,
        "batching": towers.mode,
        "max_batch_patches": towers.max_patches,
        **facts,
    }
    if len(towers.towers) > 1:
        summary.where["device_patches"] = summary.device_patches
    return summary
