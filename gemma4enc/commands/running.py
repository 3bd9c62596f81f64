"""The commands that encode or plan a run: encode, plan, demo. Each turns its flags into Options
(through Options.resume where OUT records settings) and calls the run."""

from __future__ import annotations

import json
import os
import signal
from typing import Annotated, Optional

import typer

from .quick import echo

from ..errors import UsageError
from ..options import Options, format_size, parse_size
from .app import DEFAULT, EPILOG, command, exit_for
from .flags import (
    local_path,
    Backend,
    Batching,
    Compile,
    DecodeTimeout,
    Device,
    Devices,
    Dtype,
    Engine,
    Exclude,
    FilesFrom,
    FlushSeconds,
    Fps,
    Frames,
    Hash,
    Hidden,
    ImageTokens,
    Include,
    Json,
    LogFile,
    MaxFailures,
    MaxFrames,
    MaxPatches,
    MaxPixels,
    MemFraction,
    Model,
    Null,
    Out,
    OutDtype,
    Overwrite,
    Pooled,
    Quiet,
    RayActors,
    RayAddress,
    Resize,
    RetryFailed,
    Revision,
    Roots,
    Seek,
    ShardSize,
    Store,
    TaskFiles,
    VideoTokens,
    Workers,
)
from .log import Bar


@command(epilog=EPILOG)
def encode(
    roots: Roots = None,
    out: Out = "embeddings",
    model: Model = DEFAULT.model,
    revision: Revision = DEFAULT.revision,
    dtype: Dtype = DEFAULT.dtype,
    device: Device = DEFAULT.device,
    devices: Devices = DEFAULT.devices,
    image_tokens: ImageTokens = DEFAULT.image_tokens,
    video_tokens: VideoTokens = DEFAULT.video_tokens,
    resize: Resize = DEFAULT.resize,
    frames: Frames = DEFAULT.sampling.frames,
    fps: Fps = DEFAULT.sampling.fps,
    max_frames: MaxFrames = DEFAULT.sampling.max_frames,
    video_backend: Backend = DEFAULT.video_backend,
    seek: Seek = DEFAULT.seek,
    batching: Batching = DEFAULT.batching,
    memory_fraction: MemFraction = DEFAULT.memory_fraction,
    max_batch_patches: MaxPatches = DEFAULT.max_batch_patches,
    use_compile: Compile = DEFAULT.compile,
    shard_size: ShardSize = format_size(DEFAULT.shard_bytes),
    out_dtype: OutDtype = DEFAULT.out_dtype,
    files_from: FilesFrom = None,
    null: Null = False,
    include: Include = None,
    exclude: Exclude = None,
    hidden: Hidden = False,
    max_image_pixels: MaxPixels = DEFAULT.max_image_pixels,
    pooled: Pooled = DEFAULT.pooled,
    store: Store = DEFAULT.store,
    workers: Workers = DEFAULT.workers,
    decode_timeout: DecodeTimeout = DEFAULT.decode_timeout,
    flush_seconds: FlushSeconds = DEFAULT.flush_seconds,
    content_hash: Hash = DEFAULT.hash,
    retry_failed: RetryFailed = DEFAULT.retry_failed,
    max_failures: MaxFailures = DEFAULT.max_failures,
    overwrite: Overwrite = False,
    engine: Engine = DEFAULT.engine,
    ray_address: RayAddress = DEFAULT.ray_address,
    ray_actors: RayActors = DEFAULT.ray_actors,
    task_files: TaskFiles = DEFAULT.task_files,
    json_out: Json = False,
    quiet: Quiet = False,
    log_file: LogFile = None,
    ctx: typer.Context = None,
):
    """Encode every image and video under ROOTS into safetensors shards in OUT."""
    import time

    from .log import Sink, summary_line

    start = time.perf_counter()
    try:
        say = Sink(quiet, local_path(log_file, "--log-file"))
    except OSError as e:
        raise UsageError(f"--log-file {log_file}: {e.strerror or e}") from None
    if ctx is not None and "log_handler" in ctx.meta:
        ctx.meta["log_handler"].sink = say
    flags = dict(
        model=model,
        revision=revision,
        dtype=dtype,
        device=device,
        devices=devices,
        image_tokens=image_tokens,
        video_tokens=video_tokens,
        resize=resize,
        frames=frames,
        fps=fps,
        max_frames=max_frames,
        video_backend=video_backend,
        seek=seek,
        batching=batching,
        memory_fraction=memory_fraction,
        max_batch_patches=max_batch_patches,
        compile=use_compile,
        shard_bytes=parse_size(shard_size),
        out_dtype=out_dtype,
        max_image_pixels=max_image_pixels or None,
        pooled=pooled,
        store=store,
        workers=workers,
        decode_timeout=decode_timeout or None,
        flush_seconds=flush_seconds,
        hash=content_hash,
        retry_failed=retry_failed,
        max_failures=max_failures,
        engine=engine,
        ray_address=ray_address,
        ray_actors=ray_actors,
        task_files=task_files,
    )
    # cron and schedulers stop us with SIGTERM, a closed terminal or ssh session with SIGHUP
    stops = [signal.SIGTERM, *([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])]
    previous = {sig: signal.signal(sig, _interrupt) for sig in stops}
    try:
        from ..run.encode import encode as run_encode

        report = run_encode(
            roots,
            out,
            flags,
            _given(ctx),
            files_from=files_from,
            null=null,
            include=include,
            exclude=exclude,
            hidden=hidden,
            overwrite=overwrite,
            bar=lambda n: Bar(n, quiet, say),
            log=lambda m: say(f"gemma4enc: {m}"),
        )
        shards = report.pop("shard_sizes")  # what OUT holds at the end of the run (a store: listed)
        say(
            f"gemma4enc: {summary_line(report, len(shards), sum(shards), time.perf_counter() - start)}",
            stamp=True,
        )
    except BaseException as e:  # noqa: BLE001 - the one line Command prints goes to --log-file too
        if not isinstance(e, typer.Exit):
            _, kind, message = exit_for(e, "encode")
            say(f"gemma4enc: {kind}: {message}", screen=False)
        raise
    finally:
        for sig, handler in previous.items():  # the work is saved; a late signal just ends us
            signal.signal(sig, handler)
        say.close()
    if json_out:
        typer.echo(json.dumps(report, indent=2))
    raise typer.Exit(1 if report["failed"] else 0)


def _given(ctx) -> set[str]:
    """The parameters the user gave (on the command line or by environment), by name."""
    if ctx is None:  # called from demo: the user gave nothing
        return set()
    # by name: typer may carry a click of its own, whose ParameterSource is another enum
    return {
        name
        for name in ctx.params
        if getattr(ctx.get_parameter_source(name), "name", "DEFAULT") not in ("DEFAULT", "DEFAULT_MAP")
    }


def _interrupt(signum, frame):
    raise KeyboardInterrupt


@command()
def plan(
    roots: Roots = None,
    image_tokens: ImageTokens = DEFAULT.image_tokens,
    video_tokens: VideoTokens = DEFAULT.video_tokens,
    frames: Frames = DEFAULT.sampling.frames,
    fps: Fps = DEFAULT.sampling.fps,
    max_frames: MaxFrames = DEFAULT.sampling.max_frames,
    files_from: FilesFrom = None,
    null: Null = False,
    include: Include = None,
    exclude: Exclude = None,
    hidden: Hidden = False,
    model: Annotated[
        Optional[str],
        typer.Option(
            help="Read the stored width from this checkpoint (folder or hub id in the HF cache) instead of --hidden-size."
        ),
    ] = None,
    revision: Annotated[
        Optional[str],
        typer.Option(help="With --model a hub id: its branch, tag or commit (default: main)."),
    ] = None,
    hidden_size: Annotated[
        int, typer.Option(help="Width of the stored tokens (the language model's hidden size).")
    ] = 1536,
    out_dtype: OutDtype = DEFAULT.out_dtype,
    out: Annotated[
        Optional[str],
        typer.Option(
            "--out",
            "-o",
            metavar="OUT",
            help="Plan only what encode -o OUT has still to do, with the settings OUT records.",
        ),
    ] = None,
    json_out: Json = False,
    ctx: typer.Context = None,
):
    """Dry run: what encode would do (counts, patch-count buckets, tokens, output size)."""

    from ..media.discover import discover
    from ..output.names import SETTINGS
    from ..output.opening import reading
    from ..output.todo import Unchanged

    # -o OUT: planned with the settings OUT records, against its manifest (read whole, here)
    saved = ledger = None
    shown = SETTINGS
    if out:
        with reading(out, need=False) as o:
            saved, shown = o.settings(), o.named(SETTINGS)
            ledger = o.ledger() if o.found() else None
    flags = dict(
        image_tokens=image_tokens,
        video_tokens=video_tokens,
        frames=frames,
        fps=fps,
        max_frames=max_frames,
        out_dtype=out_dtype,
    )
    options, notes = Options.resume(saved, flags, _given(ctx), where=shown)
    for note in notes:
        echo(f"gemma4enc: {note}", err=True)
    recorded_model = model is None and saved and "model" in saved and "hidden_size" not in _given(ctx)
    if recorded_model:
        model, revision = saved["model"], saved.get("revision")  # the width OUT's model projects to
    found = []
    for root in roots or []:  # a dry run warns about a missing root and plans the rest
        if (
            os.path.lexists(root) or "://" in root or "{" in root
        ):  # URLs and brace patterns: discover checks them
            found.append(root)
        else:
            echo(f"gemma4enc: warning: {root}: no such file or folder", err=True)
    unchanged = Unchanged(ledger, Options()) if ledger is not None else None  # as a run without --hash decides
    items, skipped = discover(
        found,
        files_from,
        include or [],
        exclude or [],
        hidden,
        null,
        str(out) if out else None,
        known=unchanged.known if ledger else None,
    )
    todo = _not_done(items, ledger) if ledger else items
    if model:
        from ..model.checkpoint import read_config

        try:
            hidden_size = read_config(
                model, revision
            ).text_config.hidden_size  # what embed_vision projects to
        except UsageError as e:
            if not recorded_model:
                raise
            echo(f"gemma4enc: warning: {e}; planned with --hidden-size {hidden_size}", err=True)
    from .report import plan_report

    report = plan_report(todo, options, hidden_size)
    if ledger:
        report["done_before"] = len(items) + len(unchanged) - len(todo)
    report["skipped_not_media"] = skipped
    if json_out:
        typer.echo(json.dumps(report, indent=2))
    else:
        from .log import report_lines

        echo("\n".join(report_lines(report)))  # names escaped on a terminal


def _not_done(items, ledger) -> list:
    """The files encode -o OUT would do (by size and mtime, as a run without --hash decides)."""
    from ..output.repair import LOST

    return [
        i
        for i in items
        if (e := ledger.get(i.path)) is None
        or (e.size, e.mtime_ns) != (i.size, i.mtime_ns)
        or e.status == LOST
    ]


@command()
def demo(
    folder: Annotated[
        str, typer.Argument(help="Where to put the demo checkpoint, media and output.")
    ] = "demo",
):
    """Run the real pipeline on generated media with a tiny random checkpoint (no hub needed)."""
    from ..dev.demo import make_demo

    folder = local_path(folder, "demo's FOLDER")

    ckpt, media = make_demo(folder)
    echo(f"checkpoint: {ckpt}\nmedia: {media}", err=True)
    encode(
        roots=[str(media)],
        out=folder / "embeddings",
        model=str(ckpt),
        dtype="float32",
        device="cpu",
        frames=8,
        out_dtype="float32",
        json_out=True,
    )
