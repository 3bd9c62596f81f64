"""The command line: thin wrappers that parse flags into Options and call the stages.

stdout carries data (--json), stderr carries progress and messages. Every command runs
through `Command.invoke`, the one place where an error becomes its exit code (EXIT_CODES,
the README's exit-code table): one line on stderr, and with --json an {"error", "exit_code"} object.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from functools import partial
from pathlib import Path
from typing import Annotated, Optional

import typer
from typer.core import TyperCommand

from ..errors import OutputError, TooManyFailures, UsageError
from ..options import Options, Sampling, format_size, parse_size

DEFAULT = Options()  # every default below is read from here: one place for each

EPILOG = ("Exit codes: 0 all ok · 1 some files failed (their rows say why) · 2 usage or preflight error · "
              "3 --max-failures exceeded · 4 the output folder stopped taking writes · 130 interrupted.")
# plain click help: rich markup would eat the brackets of pip install 'gemma4enc[ray]' and print <bool> on flags
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  context_settings={"help_option_names": ["-h", "--help"]}, epilog=EPILOG,
                  help="Encode folders of images and videos with the Gemma 4 vision tower.")


def _version(value: bool) -> None:
    if value:
        from .. import __version__

        typer.echo(f"gemma4enc {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: Annotated[bool, typer.Option("--version", is_eager=True, callback=_version,
                                                help="Print the version and exit.")] = False):
    """Encode folders of images and videos with the Gemma 4 vision tower."""

Roots = Annotated[list[str], typer.Argument(help="Folders or files to encode (walked recursively); also URLs (s3://…, any fsspec protocol) and WebDataset .tar shards (brace patterns: shard-{00000..00099}.tar). See docs/remote.md.")]
Out = Annotated[Path, typer.Option("--out", "-o", help="Output folder for shards and manifest.")]
Model = Annotated[str, typer.Option(help="Checkpoint folder (HF layout) or hub id (only its vision tensors are fetched, into a cache: see fetch).")]
Revision = Annotated[Optional[str], typer.Option(help="A hub id's branch, tag or commit (default: main). A re-run into OUT keeps the commit it recorded unless given.")]
Dtype = Annotated[str, typer.Option(help="Tower dtype: auto (bfloat16 on CUDA and on CPUs with AMX, else float32), float32, bfloat16, float16.")]
Device = Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N or mps.")]
ImageTokens = Annotated[int, typer.Option("--max-soft-tokens", help="Soft tokens per image: 70, 140, 280, 560 or 1120.")]
VideoTokens = Annotated[int, typer.Option("--video-soft-tokens", help="Soft tokens per video frame: 70 … 1120.")]
Frames = Annotated[int, typer.Option("--frames", help="Frames sampled uniformly per video (ignored with --fps).")]
Fps = Annotated[Optional[float], typer.Option("--fps", help="Sample this many frames per second instead.")]
MaxFrames = Annotated[int, typer.Option("--max-frames", help="Cap on frames per video with --fps.")]
Resize = Annotated[str, typer.Option("--resize", help="fast (images decoded at the smallest scale that holds the target size, 1080p+ video frames box-reduced, then the processor's bicubic; same patch grid, ≥ 45 dB PSNR of exact) or exact (the pixels of transformers' Gemma4ImageProcessorPil).")]
Backend = Annotated[str, typer.Option("--video-backend", help="auto (PyAV; decord where PyAV cannot read a file), decord or pyav.")]
Seek = Annotated[str, typer.Option("--seek", help="exact (each sampled frame as asked) or keyframe (each moved to the nearest keyframe, decoding only keyframes; frame_indices say which).")]
Batching = Annotated[str, typer.Option(help="auto, serial (one item per call), bucket (same patch count) or pack (any size).")]
MemFraction = Annotated[float, typer.Option("--memory-fraction", help="Share of free accelerator memory a batch may use.")]
MaxPatches = Annotated[Optional[int], typer.Option("--max-batch-patches", help="Patches per tower call (overrides the memory model).")]
Compile = Annotated[bool, typer.Option("--compile", help="torch.compile the encoder's layers for serial and bucket calls (compiling takes seconds; faster on a CPU with AMX, see docs/benchmarks.md).")]
ShardSize = Annotated[str, typer.Option("--shard-size", help="Target shard size: bytes, or with a unit: 256MB, 1.5G (K, M, G = 10³, 10⁶, 10⁹), 1GiB (2³⁰).")]
OutDtype = Annotated[str, typer.Option("--out-dtype", help="Stored token dtype: bfloat16, float16 or float32.")]
FilesFrom = Annotated[Optional[str], typer.Option("--files-from", help="Read paths to encode from this file, one per line ('-' = stdin); lines may be URLs or .tar shards.")]
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

# exit codes; 1 and 0 are the commands' own verdicts (some files failed / all is well)
EXIT_CODES = {UsageError: 2, TooManyFailures: 3, OutputError: 4, KeyboardInterrupt: 130}
EXIT_BUG = 70  # an exception we did not foresee (sysexits' EX_SOFTWARE): a bug to report
DEBUG = "GEMMA4ENC_DEBUG"  # =1: print the traceback of such an exception too


def exit_for(error: BaseException, command: str) -> tuple[int, str, str]:
    """An exception that ends a command → (exit code, what kind of end, the one line that says why)."""
    code = next((c for kind, c in EXIT_CODES.items() if isinstance(error, kind)), EXIT_BUG)
    if code == 130:
        return code, "interrupted", "finished files are saved, re-run to resume" if command == "encode" else ""
    if code == EXIT_BUG:
        first = (str(error).splitlines() or [""])[0]
        return code, "internal error", f"{type(error).__name__}: {first} (a bug; {DEBUG}=1 shows the traceback)"
    return code, "aborted" if code == 3 else "error", str(error)


class Command(TyperCommand):
    """A command whose every way out is an exit code, one line on stderr, and a JSON object on
    stdout with --json: click's own usage errors (bad flag syntax) and ours alike."""

    def make_context(self, info_name, args, parent=None, **extra):
        wants_json = "--json" in args and any(p.name == "json_out" for p in self.params)
        try:
            ctx = super().make_context(info_name, list(args), parent, **extra)
        except typer.TyperException as e:  # click's usage errors, as typer vendors them
            _json_error(wants_json, e.format_message(), e.exit_code)
            raise
        ctx.meta["json_errors"] = wants_json
        return ctx

    def invoke(self, ctx):
        from .log import Sink, forwarded

        wants_json = ctx.meta.get("json_errors", False)
        try:
            with forwarded(Sink(ctx.params.get("quiet", False))) as handler:
                ctx.meta["log_handler"] = handler  # encode points it at its own Sink (--log-file)
                return super().invoke(ctx)
        except (typer.Exit, typer.Abort, SystemExit):
            raise  # a verdict the command gave itself (0, or 1: some files failed)
        except typer.TyperException as e:  # a flag's value that typer could not convert
            _json_error(wants_json, e.format_message(), e.exit_code)
            raise
        except BaseException as e:  # noqa: BLE001 - every other way out gets its code and its line
            code, kind, message = exit_for(e, ctx.info_name)
            if code == EXIT_BUG and os.environ.get(DEBUG) == "1":
                traceback.print_exc()
            typer.echo(f"gemma4enc: {kind}" + (f": {message}" if message else ""), err=True)
            _json_error(wants_json, f"{kind}: {message}" if code in (70, 130) else message, code)
            raise typer.Exit(code) from None


def _json_error(wanted: bool, message: str, code: int) -> None:
    if wanted:
        typer.echo(json.dumps({"error": message, "exit_code": code}))


command = partial(app.command, cls=Command)


def _sampling(frames: int, fps: float | None, max_frames: int) -> Sampling:
    """--frames, or --fps capped by --max-frames."""
    # only the setting that has an effect is recorded: --frames without --fps, --max-frames with it
    return Sampling(frames=None if fps else frames, fps=fps, max_frames=max_frames if fps else DEFAULT.sampling.max_frames)


class Bar:
    """Progress on stderr: a rich bar on a terminal, elsewhere a timestamped line every few seconds
    with elapsed time and ETA (those lines also go to --log-file)."""

    def __init__(self, total: int, quiet: bool, say=None):
        import time

        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

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

    def grow(self, files: int) -> None:
        """More files to do, found while the run went on (a streamed discovery)."""
        self.total += files
        if self.bar:
            self.bar.update(self.task, total=self.total)

    def close(self) -> None:
        if self.bar:
            self.bar.stop()


@command(epilog=EPILOG)
def encode(
    roots: Roots = None,
    out: Out = Path("embeddings"),
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

    from ..media.discover import discover_chunks
    from ..output.ledger import Ledger
    from ..output.todo import Unchanged
    from ..run.preflight import no_effect, remembered
    from .log import Sink, summary_line

    start = time.perf_counter()
    given = _given(ctx)
    try:
        say = Sink(quiet, log_file)
    except OSError as e:
        raise UsageError(f"--log-file {log_file}: {e.strerror or e}") from None
    if ctx is not None and "log_handler" in ctx.meta:
        ctx.meta["log_handler"].sink = say
    recorded = dict(model=model, revision=revision, dtype=dtype, image_tokens=image_tokens, video_tokens=video_tokens, frames=frames,
                    fps=fps, max_frames=max_frames, out_dtype=out_dtype, pooled=pooled, resize=resize, seek=seek)
    saved = {} if overwrite else remembered(out, given)  # a re-run may omit the flags
    differ = ", ".join(f"{k} {v}" for k, v in saved.items() if recorded[k] != v)
    if differ:
        say(f"gemma4enc: as {out / 'settings.json'} records: {differ}")
    recorded |= saved
    for note in no_effect(recorded, given):
        say(f"gemma4enc: warning: {note}")
    previous = signal.signal(signal.SIGTERM, _interrupt)  # cron and schedulers stop us with SIGTERM
    try:
        r = recorded
        options = Options(
            model=r["model"], revision=r["revision"], dtype=r["dtype"], device=device, devices=devices, image_tokens=r["image_tokens"],
            video_tokens=r["video_tokens"], resize=r["resize"], seek=r["seek"], sampling=_sampling(r["frames"], r["fps"], r["max_frames"]),
            video_backend=video_backend, batching=batching, memory_fraction=memory_fraction,
            max_batch_patches=max_batch_patches, compile=use_compile, shard_bytes=parse_size(shard_size),
            out_dtype=r["out_dtype"], max_image_pixels=max_image_pixels or None, pooled=r["pooled"], workers=workers,
            decode_timeout=decode_timeout or None, flush_seconds=flush_seconds, hash=content_hash,
            retry_failed=retry_failed, max_failures=max_failures, engine=engine, ray_address=ray_address,
            ray_actors=ray_actors, task_files=task_files,
        )
        if not roots and not files_from:
            raise UsageError("nothing to encode: give folders or files, or --files-from")
        ledger = Ledger(out) if overwrite else Ledger.load(out)  # read once: discovery skips known files
        unchanged = Unchanged(ledger, options)  # files with nothing to do: counted, not kept
        counts = {}  # skipped as not media, counted as discovery goes on
        chunks = discover_chunks(roots or [], files_from, include or [], exclude or [], hidden, null, str(out),
                                 known=unchanged.known, counts=counts)
        items = next(chunks)  # the rest is found as the engine reaches it, under OUT's lock
        from ..run.encode import (
            encode_files,  # torch and the rest: only once the flags are known to be good
        )

        report = encode_files(items, out, options, bar=lambda n: Bar(n, quiet, say),
                              log=lambda m: say(f"gemma4enc: {m}"), overwrite=overwrite, ledger=ledger,
                              unchanged=unchanged, more=None if counts.get("last") else chunks)
        skipped = counts["skipped"]
        shards = [p.stat().st_size for p in Path(out).glob("shard-*.safetensors")]
        say(f"gemma4enc: {summary_line(report, len(shards), sum(shards), time.perf_counter() - start)}", stamp=True)
    except BaseException as e:  # noqa: BLE001 - the one line Command prints goes to --log-file too
        if not isinstance(e, typer.Exit):
            _, kind, message = exit_for(e, "encode")
            say(f"gemma4enc: {kind}: {message}", screen=False)
        raise
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
    model: Annotated[Optional[str], typer.Option(help="Read the stored width from this checkpoint (folder or hub id in the HF cache) instead of --hidden-size.")] = None,
    revision: Annotated[Optional[str], typer.Option(help="With --model a hub id: its branch, tag or commit (default: main).")] = None,
    hidden_size: Annotated[int, typer.Option(help="Width of the stored tokens (the language model's hidden size).")] = 1536,
    out_dtype: OutDtype = DEFAULT.out_dtype,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Plan only what encode -o OUT has still to do (files done there are not opened).")] = None,
    json_out: Json = False,
):
    """Dry run: what encode would do (counts, patch-count buckets, tokens, output size)."""
    import os

    from ..media.discover import discover
    from ..output.ledger import Ledger
    from ..output.todo import Unchanged

    options = Options(image_tokens=image_tokens, video_tokens=video_tokens,
                      sampling=_sampling(frames, fps, max_frames), out_dtype=out_dtype)
    found = []
    for root in roots or []:  # a dry run warns about a missing root and plans the rest
        if os.path.lexists(root) or "://" in root or "{" in root:  # URLs and brace patterns: discover checks them
            found.append(root)
        else:
            typer.echo(f"gemma4enc: warning: {root}: no such file or folder", err=True)
    ledger = Ledger.load(out) if out else None
    unchanged = Unchanged(ledger, Options()) if ledger else None  # as a run without --hash decides
    items, skipped = discover(found, files_from, include or [], exclude or [], hidden, null,
                              str(out) if out else None, known=unchanged.known if ledger else None)
    todo = _not_done(items, ledger) if ledger else items
    if model:
        from ..model.checkpoint import read_config

        hidden_size = read_config(model, revision).text_config.hidden_size  # what embed_vision projects to
    from .report import plan_report

    report = plan_report(todo, options, hidden_size)
    if ledger:
        report["done_before"] = len(items) + len(unchanged) - len(todo)
    report["skipped_not_media"] = skipped
    if json_out:
        typer.echo(json.dumps(report, indent=2))
    else:
        from .log import report_lines

        typer.echo("\n".join(report_lines(report)))


def _not_done(items, ledger) -> list:
    """The files encode -o OUT would do (by size and mtime, as a run without --hash decides)."""
    from ..output.repair import LOST

    return [i for i in items if (e := ledger.get(i.path)) is None or (e.size, e.mtime_ns) != (i.size, i.mtime_ns)
            or e.status == LOST]


@command()
def inspect(out: OutFolder, json_out: Json = False):
    """Summarise an output folder: files by status, shards, tokens, failures."""
    from .report import inspect_report

    report = inspect_report(out)
    if json_out:
        typer.echo(json.dumps(report, indent=2))
    else:
        from .log import report_lines

        typer.echo("\n".join(report_lines(report)))


@command()
def verify(out: OutFolder, repair: Annotated[bool, typer.Option("--repair", help="Encode again the files of shards that are missing or fail a check (with the settings OUT records).")] = False,
           json_out: Json = False):
    """Check every shard against the manifest: counts, offsets, dtype, finite values; orphans, missing."""
    from .report import verify as check

    report = check(out)
    if repair and report["bad_shards"]:
        repaired = _repair(out, report["bad_shards"])
        report = check(out) | {"repaired": repaired}
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

    from ..output.ledger import Ledger
    from ..output.lock import Lock
    from ..output.repair import LOST, mark_lost

    with Lock(out):
        ledger = Ledger.load(out)
        mark_lost(out, set(shards), ledger)
        paths = [p for p, e in ledger.entries() if e.status == LOST]
    listing = b"".join(os.fsencode(p) + b"\0" for p in paths)
    subprocess.run([sys.executable, "-m", "gemma4enc", "encode", "--files-from", "-", "-0", "-o", str(out), "-q"],
                   input=listing, check=False)  # its rows say how each file went; the second verify tells
    return len(paths)


@command()
def compact(out: OutFolder, prune: Annotated[bool, typer.Option("--prune", help="Also drop the rows and tokens of inputs that no longer exist.")] = False,
            json_out: Json = False):
    """Rewrite the manifest with one row per file (the latest), under OUT's lock."""
    from ..output.compact import compact as rewrite
    from ..output.ledger import Ledger
    from ..output.lock import Lock
    from ..output.repair import repair

    if not (out / "manifest.jsonl").exists():
        raise UsageError(f"{out}: no manifest.jsonl; is this a gemma4enc output folder?")
    with Lock(out):
        ledger = Ledger(out)  # read once, by repair; compact reads on from there
        notes = repair(out, ledger)
        report = rewrite(out, ledger, prune=prune) | {"notes": notes}
    if json_out:
        typer.echo(json.dumps(report, indent=2))
    else:
        typer.echo(f"{report['out']}: {report['rows_before']} rows → {report['rows_after']}; pruned "
                   f"{report['pruned']} file(s), {report['pruned_tokens']:,} tokens, {report['shards_rewritten']} "
                   "shard(s) rewritten")


@command()
def bench(
    folder: Annotated[Optional[Path], typer.Argument(help="--e2e: measure a sample of this folder instead of the generated real-size set.", show_default=False)] = None,
    size: Annotated[str, typer.Option(help="Released tower size to imitate: e2b, 26b or 12b (the unified model's embedder; random weights).")] = "e2b",
    layers: Annotated[Optional[int], typer.Option(help="Use only N encoder layers (to fit a CPU's time).")] = None,
    workload: Annotated[Optional[list[str]], typer.Option(help="photos, video or mixed (repeatable).")] = None,
    items: Annotated[int, typer.Option(help="Items per workload (video: clips of 32 frames); --e2e DIR: files sampled per kind.")] = 24,
    repeats: Annotated[int, typer.Option(help="Interleaved rounds; medians are reported.")] = 3,
    device: Device = "auto",
    dtype: Dtype = "auto",
    max_batch_patches: MaxPatches = None,
    use_compile: Annotated[bool, typer.Option("--compile", help="Add `compiled`: serial through the torch.compile'd layers (compile time reported apart).")] = False,
    e2e: Annotated[bool, typer.Option("--e2e", help="Instead: real-size media (generated once and cached, or a sample of FOLDER) per kind: decode rate per core, peak RSS per worker, cores that keep the tower fed; then decode workers → tower → shards and their overlap.")] = False,
    tower_rate: Annotated[Optional[float], typer.Option(help="--e2e: photos/s at 280 tokens the tower takes (e.g. your GPU's), instead of the rate measured here.", min=0.001)] = None,
    workers: Workers = None,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Also write the report as JSON here.")] = None,
):
    """Benchmark hf-padded, serial, bucket and pack side by side (items/s, patches/s, memory, MFU)."""
    if folder is not None and not e2e:
        raise UsageError("a FOLDER is measured only with --e2e")
    if folder is not None and not folder.is_dir():
        raise UsageError(f"{folder}: not a folder")
    if e2e:
        from ..dev.e2e import e2e as run_e2e

        report = run_e2e(size, layers, device, dtype, items, workers, repeats, folder, tower_rate,
                         log=lambda s: typer.echo(s))
    else:
        from ..dev.bench import bench as run_bench

        report = run_bench(size, layers, device, dtype, tuple(workload or ["photos"]), items, repeats,
                           max_batch_patches, use_compile, log=lambda s: typer.echo(s))
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2))


@command()
def fetch(
    model: Annotated[str, typer.Argument(help="Hub id (org/name).")],
    revision: Annotated[Optional[str], typer.Option(help="Branch, tag or commit (default: main).")] = None,
    json_out: Json = False,
):
    """Fetch a hub checkpoint's config and vision tensors only (HTTP range requests) into the cache, so
    that encode --model MODEL runs offline (HF_HUB_OFFLINE=1) here or wherever the cache is copied."""
    from ..model.hub import fetch as fetch_vision

    if model.count("/") != 1 or model.startswith((".", "/", "~")) or Path(model).expanduser().exists():
        raise UsageError(f"{model}: not a hub id like 'org/name' (a local folder needs no fetch)")
    report = fetch_vision(model, revision, log=lambda m: typer.echo(f"gemma4enc: {m}", err=True))
    if json_out:
        typer.echo(json.dumps(report, indent=2))
        return
    how = "already cached, nothing fetched" if report["cached"] else f"{report['bytes_fetched']:,} bytes fetched"
    tensors = f"{report['tensors']} vision tensors, " if "tensors" in report else ""
    typer.echo(f"{model}@{report['commit']}: {tensors}{how}")
    if report.get("files_skipped"):
        typer.echo(f"skipped (no vision tensor): {', '.join(report['files_skipped'])}")
    if report.get("source_bytes"):
        typer.echo(f"of {report['source_bytes']:,} bytes in {len(report['source_files'])} file(s) holding vision tensors")
    typer.echo(f"folder: {report['folder']}")


@command()
def demo(folder: Annotated[Path, typer.Argument(help="Where to put the demo checkpoint, media and output.")] = Path("demo")):
    """Run the real pipeline on generated media with a tiny random checkpoint (no hub needed)."""
    from ..dev.demo import make_demo

    ckpt, media = make_demo(folder)
    typer.echo(f"checkpoint: {ckpt}\nmedia: {media}", err=True)
    encode(roots=[str(media)], out=folder / "embeddings", model=str(ckpt), dtype="float32", device="cpu", frames=8,
           out_dtype="float32", json_out=True)


def main() -> None:
    """The console script: every command maps its errors to EXIT_CODES (see Command)."""
    # Before torch loads OpenMP: its threads sleep when they run out of work instead of spinning.
    # On a CPU shared with anything else, a spinning thread takes the core its busy sibling needs,
    # and the tower loses far more than the cores it shares (docs/benchmarks.md). A value already
    # in the environment is kept.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    app()
