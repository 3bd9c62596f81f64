"""The command line's flags, declared once with a one-line help each (docs/cli.md is made from
them; docs/commands.md says more about each, by topic)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

Arg, Opt = typer.Argument, typer.Option

Roots = Annotated[
    list[str], Arg(help="Folders, files, URLs (s3://…) or WebDataset .tar shards (docs/remote.md).")
]
# str, not Path: a Path would fold the // of s3://bucket/prefix
Out = Annotated[
    str,
    Opt("--out", "-o", metavar="OUT", help="Output folder for shards and manifest, or a URL (s3://…)."),
]
Model = Annotated[str, Opt(help="Checkpoint folder (HF layout) or hub id (its vision tensors only).")]
Revision = Annotated[Optional[str], Opt(help="A hub id's branch, tag or commit (default: main).")]
Dtype = Annotated[str, Opt(help="Tower dtype: auto, float32, bfloat16 or float16.")]
Device = Annotated[str, Opt(help="auto, cpu, cuda, cuda:N or mps.")]
ImageTokens = Annotated[int, Opt("--max-soft-tokens", help="Soft tokens per image: 70 … 1120.")]
VideoTokens = Annotated[int, Opt("--video-soft-tokens", help="Soft tokens per video frame: 70 … 1120.")]
Frames = Annotated[int, Opt("--frames", help="Frames sampled uniformly per video (not with --fps).")]
Fps = Annotated[Optional[float], Opt("--fps", help="Sample this many frames per second instead.")]
MaxFrames = Annotated[int, Opt("--max-frames", help="Cap on frames per video with --fps.")]
Resize = Annotated[
    str, Opt("--resize", help="fast (≥ 45 dB of exact, same grid), exact (the PIL processor's) or "
    "torchvision (the default processors', vLLM's).")
]
Backend = Annotated[
    str, Opt("--video-backend", help="auto (PyAV, decord where it cannot), decord or pyav.")
]
Seek = Annotated[
    str, Opt("--seek", help="exact, keyframe, or nearest[:SECONDS] (a keyframe within a bound).")
]
Batching = Annotated[str, Opt(help="auto, serial, bucket (same patch count) or pack (any size).")]
MemFraction = Annotated[
    float, Opt("--memory-fraction", help="Share of free accelerator memory a batch may use.")
]
MaxPatches = Annotated[
    Optional[int], Opt("--max-batch-patches", help="Patches per tower call (no memory model).")
]
Compile = Annotated[
    bool, Opt("--compile", help="torch.compile the encoder's layers (serial and bucket).")
]
ShardSize = Annotated[str, Opt("--shard-size", help="Target shard size: bytes, or 256MB, 1.5G, 1GiB.")]
OutDtype = Annotated[str, Opt("--out-dtype", help="Stored token dtype: bfloat16, float16 or float32.")]
FilesFrom = Annotated[
    Optional[str],
    Opt("--files-from", help="Read the paths (or URLs, .tar shards) from this file ('-' = stdin)."),
]
Null = Annotated[bool, Opt("--null", "-0", help="--files-from names end in NUL bytes (find -print0).")]
Include = Annotated[
    Optional[list[str]],
    Opt("--include", metavar="GLOB", help="Only paths matching this glob, in any case (repeatable)."),
]
Exclude = Annotated[
    Optional[list[str]],
    Opt("--exclude", metavar="GLOB", help="Skip paths, or folders, matching this glob, in any case."),
]
Hidden = Annotated[bool, Opt("--hidden", help="Also walk hidden files and folders.")]
MaxPixels = Annotated[int, Opt("--max-image-pixels", help="Refuse larger images (0 = no limit).")]
Pooled = Annotated[bool, Opt("--pooled/--no-pooled", help="Also store each file's mean token.")]
Store = Annotated[str, Opt("--store", help="tokens, or pooled (the mean tokens only).")]
Workers = Annotated[Optional[int], Opt("--workers", help="Decode worker processes (0 = in this one).")]
DecodeTimeout = Annotated[
    float, Opt("--decode-timeout", help="Seconds a file may take to decode (0 = no limit).")
]
FlushSeconds = Annotated[float, Opt("--flush-seconds", help="Write a shard at least this often.")]
Hash = Annotated[bool, Opt("--hash", help="Also compare files by content (sha256).")]
RetryFailed = Annotated[bool, Opt("--retry-failed", help="Try again the files whose last row failed.")]
MaxFailures = Annotated[
    Optional[int], Opt("--max-failures", help="Abort (exit 3) past this many failures.")
]
Overwrite = Annotated[bool, Opt("--overwrite", help="Replace what OUT holds instead of resuming.")]
Devices = Annotated[Optional[str], Opt("--devices", help="A tower on each: all, or cuda:0,cuda:1.")]
Engine = Annotated[str, Opt("--engine", help="local, or ray (pip install 'gemma4enc[ray]').")]
RayAddress = Annotated[
    Optional[str], Opt("--ray-address", help="With ray: auto or HOST:PORT (default: a private Ray).")
]
RayActors = Annotated[
    Optional[int], Opt("--ray-actors", help="With ray: actors (default: one per GPU, else CPU).")
]
TaskFiles = Annotated[
    int, Opt("--task-files", help="With ray: files per task (handed out and retried whole).")
]
OutFolder = Annotated[
    str, Arg(help="An output folder of gemma4enc encode, or its URL (s3://…).")
]
Json = Annotated[bool, Opt("--json", help="Print a JSON summary on stdout.")]
Quiet = Annotated[bool, Opt("--quiet", "-q", help="No progress or messages on stderr.")]
# str, not Path, as every path below: a Path folds s3://b/x into a local folder "s3:" (see local_path)
LogFile = Annotated[
    Optional[str], Opt("--log-file", metavar="<path>", help="Also append every message, timestamped, to this file.")
]


def local_path(value, what: str) -> Path | None:
    """A path gemma4enc writes or walks on this machine only (a log, a report, demo's and bench's
    folders, export's DEST): a URL is refused in one line (exit 2), never made a folder `s3:`."""
    from ..errors import UsageError
    from ..media.remote import is_url

    if value is None:
        return None
    if is_url(str(value)):
        raise UsageError(f"{value}: {what} must be a local path, not a URL")
    return Path(value)
