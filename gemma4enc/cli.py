"""The command line: thin wrappers that parse flags into Options and call the stages.

stdout carries data (--json), stderr carries progress and messages.
Exit codes: 0 all ok · 1 some files failed (their rows say why) · 2 usage or preflight error
· 3 --max-failures exceeded · 4 the output folder stopped taking writes · 130 interrupted.
After 1, 3, 4 and 130 the finished files are saved: a re-run resumes.
"""

from __future__ import annotations

import json
import re
import signal
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from .errors import UsageError

EXIT_CODES = ("Exit codes: 0 all ok · 1 some files failed (their rows say why) · 2 usage or preflight error · "
              "3 --max-failures exceeded · 4 the output folder stopped taking writes · 130 interrupted.")
# plain click help: rich markup would eat the brackets of pip install 'gemma4enc[ray]' and print <bool> on flags
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  context_settings={"help_option_names": ["-h", "--help"]}, epilog=EXIT_CODES,
                  help="Encode folders of images and videos with the Gemma 4 vision tower.")


def _version(value: bool) -> None:
    if value:
        from . import __version__

        typer.echo(f"gemma4enc {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: Annotated[bool, typer.Option("--version", is_eager=True, callback=_version,
                                                help="Print the version and exit.")] = False):
    """Encode folders of images and videos with the Gemma 4 vision tower."""

Roots = Annotated[list[str], typer.Argument(help="Folders or files to encode (walked recursively).")]
Out = Annotated[Path, typer.Option("--out", "-o", help="Output folder for shards and manifest.")]
Model = Annotated[str, typer.Option(help="Checkpoint folder (HF layout) or hub id in the HF cache.")]
Dtype = Annotated[str, typer.Option(help="Tower dtype: auto (bfloat16 on CUDA and on CPUs with AMX, else float32), float32, bfloat16, float16.")]
Device = Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N or mps.")]
ImageTokens = Annotated[int, typer.Option("--max-soft-tokens", help="Soft tokens per image: 70, 140, 280, 560 or 1120.")]
VideoTokens = Annotated[int, typer.Option("--video-soft-tokens", help="Soft tokens per video frame: 70 … 1120.")]
Frames = Annotated[int, typer.Option("--frames", help="Frames sampled uniformly per video (ignored with --fps).")]
Fps = Annotated[Optional[float], typer.Option("--fps", help="Sample this many frames per second instead.")]
MaxFrames = Annotated[int, typer.Option("--max-frames", help="Cap on frames per video with --fps.")]
Resize = Annotated[str, typer.Option("--resize", help="Images: fast (decode at the smallest scale that holds the target size, then the processor's bicubic; same patch grid, ≥ 45 dB PSNR of exact) or exact (the pixels of transformers' Gemma4ImageProcessorPil).")]
Backend = Annotated[str, typer.Option("--video-backend", help="auto (decord where frame-accurate, else PyAV), decord or pyav.")]
Batching = Annotated[str, typer.Option(help="auto, serial (one item per call), bucket (same patch count) or pack (any size).")]
MemFraction = Annotated[float, typer.Option("--memory-fraction", help="Share of free accelerator memory a batch may use.")]
MaxPatches = Annotated[Optional[int], typer.Option("--max-batch-patches", help="Patches per tower call (overrides the memory model).")]
Compile = Annotated[bool, typer.Option("--compile", help="torch.compile the encoder's layers for serial and bucket calls (~10 s; 1.3–1.5× on a CPU with AMX).")]
ShardSize = Annotated[str, typer.Option("--shard-size", help="Target shard size, e.g. 1GB, 256MB.")]
OutDtype = Annotated[str, typer.Option("--out-dtype", help="Stored token dtype: bfloat16, float16 or float32.")]
FilesFrom = Annotated[Optional[str], typer.Option("--files-from", help="Read paths to encode from this file, one per line ('-' = stdin).")]
Null = Annotated[bool, typer.Option("--null", "-0", help="--files-from names end in NUL bytes, as find -print0 writes them (a name may hold a newline).")]
Include = Annotated[Optional[list[str]], typer.Option("--include", help="Only paths matching this glob (repeatable).")]
Exclude = Annotated[Optional[list[str]], typer.Option("--exclude", help="Skip paths matching this glob (repeatable).")]
Hidden = Annotated[bool, typer.Option("--hidden", help="Also walk hidden files and folders.")]
MaxPixels = Annotated[int, typer.Option("--max-image-pixels", help="Refuse images with more pixels (decompression bombs); 0 = no limit.")]
Pooled = Annotated[bool, typer.Option("--pooled/--no-pooled", help="Also store each file's mean token.")]
Workers = Annotated[Optional[int], typer.Option("--workers", help="Decode worker processes (default: CPU count - 1; 0 = decode in this process, no timeout).")]
DecodeTimeout = Annotated[float, typer.Option("--decode-timeout", help="Seconds one file may take to decode before it is recorded as timeout; 0 = no limit.")]
FlushSeconds = Annotated[float, typer.Option("--flush-seconds", help="Write a shard at least this often, so a kill loses little.")]
Hash = Annotated[bool, typer.Option("--hash", help="Also compare files by content (sha256), not only size and mtime.")]
RetryFailed = Annotated[bool, typer.Option("--retry-failed", help="Try again the files whose last row is a failure.")]
MaxFailures = Annotated[Optional[int], typer.Option("--max-failures", help="Abort with exit code 3 once more files than this fail.")]
Overwrite = Annotated[bool, typer.Option("--overwrite", help="Replace what OUT holds (its shards, manifest, settings) instead of resuming.")]
Devices = Annotated[Optional[str], typer.Option("--devices", help="Several devices, one tower each: all (every CUDA device) or a list like cuda:0,cuda:1.")]
Engine = Annotated[str, typer.Option("--engine", help="local (this machine) or ray (a Ray Data actor pool; pip install 'gemma4enc[ray]').")]
RayAddress = Annotated[Optional[str], typer.Option("--ray-address", help="With --engine ray: auto or HOST:PORT of a running cluster (default: a private local Ray on loopback).")]
RayActors = Annotated[Optional[int], typer.Option("--ray-actors", help="With --engine ray: actors (default: one per GPU of the cluster, else one per CPU).")]
TaskFiles = Annotated[int, typer.Option("--task-files", help="With --engine ray: files per task, the unit handed to an actor and retried.")]
OutFolder = Annotated[Path, typer.Argument(help="An output folder of gemma4enc encode.")]
Json = Annotated[bool, typer.Option("--json", help="Print a JSON summary on stdout.")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress or messages on stderr.")]
LogFile = Annotated[Optional[Path], typer.Option("--log-file", help="Also append every message and progress line, timestamped, to this file.")]

UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
         "GIB": 2**30}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([\d.]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in UNITS:
        raise UsageError(f"--shard-size {text!r}: use a size like 1GB or 256MB")
    return max(1, int(float(m.group(1)) * UNITS[m.group(2).upper()]))


def fail(message: str) -> None:
    typer.echo(f"gemma4enc: error: {message}", err=True)
    raise typer.Exit(2)


def _options(**kw):
    from .decode import Sampling
    from .options import Options
    from .patches import SOFT_TOKEN_BUDGETS

    for flag, value in (("--max-soft-tokens", kw["image_tokens"]), ("--video-soft-tokens", kw["video_tokens"])):
        if value not in SOFT_TOKEN_BUDGETS:
            raise UsageError(f"{flag} {value}: use one of {', '.join(map(str, SOFT_TOKEN_BUDGETS))}")
    if kw["resize"] not in ("fast", "exact"):
        raise UsageError(f"--resize {kw['resize']!r}: use fast or exact")
    if kw["video_backend"] not in ("auto", "decord", "pyav"):
        raise UsageError(f"--video-backend {kw['video_backend']!r}: use auto, decord or pyav")
    if kw["out_dtype"] not in ("bfloat16", "float16", "float32"):
        raise UsageError(f"--out-dtype {kw['out_dtype']!r}: use bfloat16, float16 or float32")
    if kw["frames"] < 1 or kw["max_frames"] < 1 or (kw["fps"] is not None and kw["fps"] <= 0):
        raise UsageError("--frames, --max-frames and --fps must be positive")
    if not 0 < kw["memory_fraction"] <= 1:
        raise UsageError("--memory-fraction must be in (0, 1]")
    if kw["engine"] not in ("local", "ray"):
        raise UsageError(f"--engine {kw['engine']!r}: use local or ray")
    if kw["engine"] != "ray" and (kw["ray_address"] or kw["ray_actors"]):
        raise UsageError("--ray-address and --ray-actors need --engine ray")
    if kw["engine"] == "ray" and kw["devices"]:
        raise UsageError("--devices is for the local engine; with --engine ray each actor has a GPU of its own")
    if kw["task_files"] < 1 or (kw["ray_actors"] is not None and kw["ray_actors"] < 1):
        raise UsageError("--task-files and --ray-actors must be at least 1")
    if (kw["workers"] or 0) < 0 or kw["decode_timeout"] < 0 or kw["flush_seconds"] < 0 or (kw["max_failures"] or 0) < 0:
        raise UsageError("--workers, --decode-timeout, --flush-seconds and --max-failures cannot be negative")
    kw["decode_timeout"] = kw["decode_timeout"] or None
    # only the setting that has an effect is recorded: --frames without --fps, --max-frames with it
    fps, max_frames = kw.pop("fps"), kw.pop("max_frames")
    sampling = Sampling(frames=None if fps else kw["frames"], fps=fps, max_frames=max_frames if fps else Sampling().max_frames)
    kw.pop("frames")
    kw["shard_bytes"] = parse_size(kw.pop("shard_size"))
    kw["max_image_pixels"] = kw["max_image_pixels"] or None
    return Options(sampling=sampling, **kw)


class Bar:
    """Progress on stderr: a rich bar on a terminal, elsewhere a timestamped line every few seconds
    with elapsed time and ETA (those lines also go to --log-file)."""

    def __init__(self, total: int, quiet: bool, say=None):
        import time

        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.time, self.start, self.last = time, time.perf_counter(), 0.0
        self.total, self.files, self.patches, self.quiet = total, 0, 0, quiet
        self.say = say
        console = Console(stderr=True)
        self.bar = None
        if not quiet and console.is_terminal:
            self.bar = Progress(TextColumn("encoding"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[rate]}"), TimeRemainingColumn(), console=console)
            self.task = self.bar.add_task("encode", total=total, rate="")
            self.bar.start()

    def advance(self, files: int, patches: int) -> None:
        self.files += files
        self.patches += patches
        elapsed = max(self.time.perf_counter() - self.start, 1e-9)
        rate = f"{self.files / elapsed:.1f} items/s {self.patches / elapsed:,.0f} patches/s"
        if self.bar:
            self.bar.update(self.task, advance=files, rate=rate)
        if (self.say or not self.quiet) and (elapsed - self.last >= 5 or self.files == self.total):
            from .log import duration

            self.last = elapsed
            eta = duration((self.total - self.files) * elapsed / self.files) if self.files else "?"
            line = (f"gemma4enc: {self.files:,}/{self.total:,} files ({100 * self.files / max(self.total, 1):.0f}%), "
                    f"{rate}, elapsed {duration(elapsed)}, ETA {eta}")
            if self.say:
                self.say(line, stamp=True, screen=self.bar is None)  # the bar shows it on a terminal
            elif not self.bar:
                print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar:
            self.bar.stop()


@app.command(epilog=EXIT_CODES)
def encode(
    roots: Roots = None,
    out: Out = Path("embeddings"),
    model: Model = "google/gemma-4-E2B-it",
    dtype: Dtype = "auto",
    device: Device = "auto",
    devices: Devices = None,
    image_tokens: ImageTokens = 280,
    video_tokens: VideoTokens = 70,
    resize: Resize = "fast",
    frames: Frames = 32,
    fps: Fps = None,
    max_frames: MaxFrames = 32,
    video_backend: Backend = "auto",
    batching: Batching = "auto",
    memory_fraction: MemFraction = 0.7,
    max_batch_patches: MaxPatches = None,
    use_compile: Compile = False,
    shard_size: ShardSize = "1GB",
    out_dtype: OutDtype = "bfloat16",
    files_from: FilesFrom = None,
    null: Null = False,
    include: Include = None,
    exclude: Exclude = None,
    hidden: Hidden = False,
    max_image_pixels: MaxPixels = 89_478_485,
    pooled: Pooled = True,
    workers: Workers = None,
    decode_timeout: DecodeTimeout = 120.0,
    flush_seconds: FlushSeconds = 60.0,
    content_hash: Hash = False,
    retry_failed: RetryFailed = False,
    max_failures: MaxFailures = None,
    overwrite: Overwrite = False,
    engine: Engine = "local",
    ray_address: RayAddress = None,
    ray_actors: RayActors = None,
    task_files: TaskFiles = 64,
    json_out: Json = False,
    quiet: Quiet = False,
    log_file: LogFile = None,
    ctx: typer.Context = None,
):
    """Encode every image and video under ROOTS into safetensors shards in OUT."""
    from .discover import discover
    from .errors import OutputError, TooManyFailures
    from .ledger import Ledger
    from .preflight import no_effect, remembered
    from .run import encode_files

    import time

    from .log import Sink, summary_line

    start = time.perf_counter()
    given = _given(ctx)
    try:
        say = Sink(quiet, log_file)
    except OSError as e:
        fail(f"--log-file {log_file}: {e.strerror or e}")
    recorded = dict(model=model, dtype=dtype, image_tokens=image_tokens, video_tokens=video_tokens, frames=frames,
                    fps=fps, max_frames=max_frames, out_dtype=out_dtype, pooled=pooled, resize=resize)
    saved = {} if overwrite else remembered(out, given)  # a re-run may omit the flags
    differ = ", ".join(f"{k} {v}" for k, v in saved.items() if recorded[k] != v)
    if differ:
        say(f"gemma4enc: as {out / 'settings.json'} records: {differ}")
    recorded |= saved
    for note in no_effect(recorded, given):
        say(f"gemma4enc: warning: {note}")
    previous = signal.signal(signal.SIGTERM, _interrupt)  # cron and schedulers stop us with SIGTERM
    try:
        options = _options(**recorded, device=device, devices=devices, video_backend=video_backend,
                           batching=batching, memory_fraction=memory_fraction,
                           max_batch_patches=max_batch_patches, compile=use_compile, shard_size=shard_size,
                           max_image_pixels=max_image_pixels, workers=workers,
                           decode_timeout=decode_timeout, flush_seconds=flush_seconds, hash=content_hash,
                           retry_failed=retry_failed, max_failures=max_failures, engine=engine,
                           ray_address=ray_address, ray_actors=ray_actors, task_files=task_files)
        if not roots and not files_from:
            raise UsageError("nothing to encode: give folders or files, or --files-from")
        ledger = Ledger(out) if overwrite else Ledger.load(out)  # read once: discovery skips known files
        items, skipped = discover(roots or [], files_from, include or [], exclude or [], hidden, null, str(out),
                                  known=ledger.known_kind)
        report = encode_files(items, out, options, bar=lambda n: Bar(n, quiet, say),
                              log=lambda m: say(f"gemma4enc: {m}"), overwrite=overwrite, ledger=ledger)
        shards = [p.stat().st_size for p in Path(out).glob("shard-*.safetensors")]
        say(f"gemma4enc: {summary_line(report, len(shards), sum(shards), time.perf_counter() - start)}", stamp=True)
    except UsageError as e:
        say(f"gemma4enc: error: {e}", error=True)
        raise typer.Exit(2)
    except TooManyFailures as e:
        say(f"gemma4enc: aborted: {e}; finished files are saved (see {out / 'manifest.jsonl'})", error=True)
        raise typer.Exit(3)
    except OutputError as e:
        say(f"gemma4enc: error: {e}", error=True)
        raise typer.Exit(4)
    except KeyboardInterrupt:
        say("gemma4enc: interrupted; finished files are saved, re-run to resume", error=True)
        raise typer.Exit(130)
    finally:
        signal.signal(signal.SIGTERM, previous)  # the work is saved; a late SIGTERM just ends us
        say.close()
    report["skipped_not_media"] = skipped
    if json_out:
        typer.echo(json.dumps(report, indent=2))
    raise typer.Exit(1 if report["failed"] else 0)


def _given(ctx):
    """name → whether the user gave that parameter (on the command line or by environment)."""
    if ctx is None:  # called from demo: the user gave nothing
        return lambda name: False
    # by name: typer may carry a click of its own, whose ParameterSource is another enum
    return lambda name: getattr(ctx.get_parameter_source(name), "name", "DEFAULT") not in ("DEFAULT", "DEFAULT_MAP")


def _interrupt(signum, frame):
    raise KeyboardInterrupt


@app.command()
def plan(
    roots: Roots = None,
    image_tokens: ImageTokens = 280,
    video_tokens: VideoTokens = 70,
    frames: Frames = 32,
    fps: Fps = None,
    max_frames: MaxFrames = 32,
    files_from: FilesFrom = None,
    null: Null = False,
    include: Include = None,
    exclude: Exclude = None,
    hidden: Hidden = False,
    model: Annotated[Optional[str], typer.Option(help="Read the stored width from this checkpoint (folder or hub id in the HF cache) instead of --hidden-size.")] = None,
    hidden_size: Annotated[int, typer.Option(help="Width of the stored tokens (the language model's hidden size).")] = 1536,
    out_dtype: OutDtype = "bfloat16",
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Plan only what encode -o OUT has still to do (files done there are not opened).")] = None,
    json_out: Json = False,
):
    """Dry run: what encode would do (counts, patch-count buckets, tokens, output size)."""
    import os

    from .decode import Sampling
    from .discover import discover
    from .ledger import Ledger
    from .report import plan_report

    for root in roots or []:
        if not os.path.exists(root):
            typer.echo(f"gemma4enc: warning: {root}: no such file or folder", err=True)
    try:
        if frames < 1 or max_frames < 1 or (fps is not None and fps <= 0):
            raise UsageError("--frames, --max-frames and --fps must be positive")
        if model:
            from .model import find_checkpoint

            hidden_size = find_checkpoint(model).config.text_config.hidden_size  # what embed_vision projects to
        sampling = Sampling(frames=None if fps else frames, fps=fps, max_frames=max_frames)
        ledger = Ledger.load(out) if out else None
        items, skipped = discover(roots or [], files_from, include or [], exclude or [], hidden, null,
                                  str(out) if out else None, known=ledger.known_kind if ledger else None)
        todo = _not_done(items, out, ledger) if ledger else items
        report = plan_report(todo, image_tokens, video_tokens, sampling, hidden_size, out_dtype)
    except UsageError as e:
        fail(str(e))
    if ledger:
        report["done_before"] = len(items) - len(todo)
    report["skipped_not_media"] = skipped
    if json_out:
        typer.echo(json.dumps(report, indent=2))
    else:
        from .log import report_lines

        typer.echo("\n".join(report_lines(report)))


def _not_done(items, out: Path, ledger) -> list:
    """The files encode -o OUT would do (by size and mtime, as a run without --hash decides)."""
    from .outdir import LOST

    return [i for i in items if (e := ledger.get(i.path)) is None or (e.size, e.mtime_ns) != (i.size, i.mtime_ns)
            or e.status == LOST]


def _read(report_of, out: Path) -> dict:
    try:
        return report_of(out)
    except UsageError as e:
        fail(str(e))


@app.command()
def inspect(out: OutFolder, json_out: Json = False):
    """Summarise an output folder: files by status, shards, tokens, failures."""
    from .report import inspect_report

    report = _read(inspect_report, out)
    if json_out:
        typer.echo(json.dumps(report, indent=2))
    else:
        from .log import report_lines

        typer.echo("\n".join(report_lines(report)))


@app.command()
def verify(out: OutFolder, repair: Annotated[bool, typer.Option("--repair", help="Encode again the files of shards that are missing or fail a check (with the settings OUT records).")] = False,
           json_out: Json = False):
    """Check every shard against the manifest: counts, offsets, dtype, finite values; orphans, missing."""
    from .report import verify as check

    report = _read(check, out)
    if repair and report["bad_shards"]:
        repaired = _repair(out, report["bad_shards"])
        report = _read(check, out) | {"repaired": repaired}
    if json_out:
        typer.echo(json.dumps(report, indent=2))
    else:
        typer.echo(f"{report['out']}: {report['files']} files, {report['encoded']} encoded in {report['shards']} "
                   f"shards, {report['tokens_checked']:,} tokens checked")
        for line in report["problems"]:
            typer.echo(f"problem: {line}")
        for line in report["warnings"]:
            typer.echo(f"warning: {line}")
        typer.echo("ok" if report["ok"] else f"{len(report['problems'])} problem(s)")
    raise typer.Exit(0 if report["ok"] else 1)


def _repair(out: Path, shards: list[str]) -> int:
    """Supersede the rows into these shards, then encode their files again; returns how many."""
    import os
    import subprocess

    from .ledger import Ledger
    from .outdir import LOST, Lock, mark_lost

    with Lock(out):
        ledger = Ledger.load(out)
        mark_lost(out, set(shards), ledger)
        paths = [p for p, e in ledger.entries() if e.status == LOST]
    listing = b"".join(os.fsencode(p) + b"\0" for p in paths)
    subprocess.run([sys.executable, "-m", "gemma4enc", "encode", "--files-from", "-", "-0", "-o", str(out), "-q"],
                   input=listing, check=False)  # its rows say how each file went; the second verify tells
    return len(paths)


@app.command()
def compact(out: OutFolder, prune: Annotated[bool, typer.Option("--prune", help="Also drop the rows and tokens of inputs that no longer exist.")] = False,
            json_out: Json = False):
    """Rewrite the manifest with one row per file (the latest), under OUT's lock."""
    from .ledger import Ledger
    from .outdir import Lock, compact as rewrite, repair

    def run(folder: Path) -> dict:
        if not (folder / "manifest.jsonl").exists():
            raise UsageError(f"{folder}: no manifest.jsonl; is this a gemma4enc output folder?")
        with Lock(folder):
            ledger = Ledger(folder)  # read once, by repair; compact reads on from there
            notes = repair(folder, ledger)
            return rewrite(folder, ledger, prune=prune) | {"notes": notes}

    report = _read(run, out)
    if json_out:
        typer.echo(json.dumps(report, indent=2))
    else:
        typer.echo(f"{report['out']}: {report['rows_before']} rows → {report['rows_after']}; pruned "
                   f"{report['pruned']} file(s), {report['pruned_tokens']:,} tokens, {report['shards_rewritten']} "
                   "shard(s) rewritten")


@app.command()
def bench(
    size: Annotated[str, typer.Option(help="Released tower size to imitate: e2b or 26b (random weights).")] = "e2b",
    layers: Annotated[Optional[int], typer.Option(help="Use only N encoder layers (to fit a CPU's time).")] = None,
    workload: Annotated[Optional[list[str]], typer.Option(help="photos, video or mixed (repeatable).")] = None,
    items: Annotated[int, typer.Option(help="Items per workload (video: clips of 32 frames).")] = 24,
    repeats: Annotated[int, typer.Option(help="Interleaved rounds; medians are reported.")] = 3,
    device: Device = "auto",
    dtype: Dtype = "auto",
    max_batch_patches: MaxPatches = None,
    use_compile: Annotated[bool, typer.Option("--compile", help="Add `compiled`: serial through the torch.compile'd layers (compile time reported apart).")] = False,
    e2e: Annotated[bool, typer.Option("--e2e", help="Instead: a generated folder through decode workers, tower and shards; decode-only, encode-only, end-to-end and their overlap.")] = False,
    rss: Annotated[bool, typer.Option("--rss", help="Instead: peak RSS of encode over folders of ITEMS and 10 × ITEMS generated files (does memory grow with the folder?).")] = False,
    workers: Workers = None,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Also write the report as JSON here.")] = None,
):
    """Benchmark hf-padded, serial, bucket and pack side by side (items/s, patches/s, memory, MFU)."""
    from .bench import bench as run_bench
    from .bench import e2e as run_e2e
    from .bench import rss as run_rss

    try:
        if rss:
            report = run_rss((items, 10 * items), workers, log=lambda s: typer.echo(s))
        elif e2e:
            report = run_e2e(size, layers, device, dtype, items, workers, repeats, log=lambda s: typer.echo(s))
        else:
            report = run_bench(size, layers, device, dtype, tuple(workload or ["photos"]), items, repeats,
                               max_batch_patches, use_compile, log=lambda s: typer.echo(s))
    except UsageError as e:
        fail(str(e))
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2))


@app.command()
def demo(folder: Annotated[Path, typer.Argument(help="Where to put the demo checkpoint, media and output.")] = Path("demo")):
    """Run the real pipeline on generated media with a tiny random checkpoint (no hub needed)."""
    from .demo import make_demo

    ckpt, media = make_demo(folder)
    typer.echo(f"checkpoint: {ckpt}\nmedia: {media}", err=True)
    encode(roots=[str(media)], out=folder / "embeddings", model=str(ckpt), dtype="float32", device="cpu", devices=None,
           image_tokens=280, video_tokens=70, frames=8, fps=None, max_frames=32, video_backend="auto",
           batching="auto", memory_fraction=0.7, max_batch_patches=None, shard_size="1GB", out_dtype="float32",
           files_from=None, null=False, include=None, exclude=None, hidden=False, max_image_pixels=89_478_485, pooled=True,
           workers=None, decode_timeout=120.0, flush_seconds=60.0, content_hash=False, retry_failed=False, max_failures=None,
           overwrite=False, engine="local", ray_address=None, ray_actors=None, task_files=64, json_out=True,
           quiet=False)


def main() -> None:
    app()
