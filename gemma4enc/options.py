"""Every setting of a run, in one frozen dataclass passed down whole and saved in the output.

`Options` owns the defaults (the CLI reads its own from `Options()`) and checks itself when
built, so a library caller gets the same one-line `UsageError` as the command line. Fields
marked `fingerprint` change what is written; a re-run into the same OUT must match them.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, fields
from fractions import Fraction

from .decode import Sampling, seek_bound
from .errors import UsageError
from .patches import SOFT_TOKEN_BUDGETS

DEFAULT_MODEL = "google/gemma-4-E2B-it"  # the smallest released Gemma 4 with a vision tower
DTYPES = ("auto", "float32", "bfloat16", "float16")
OUT_DTYPES = ("bfloat16", "float16", "float32")
VIDEO_BACKENDS = ("auto", "decord", "pyav")
BATCHING = ("auto", "serial", "bucket", "pack")
ENGINES = ("local", "ray")
DEVICE = re.compile(r"auto|cpu|mps|cuda(:\d+)?")
# decimal like a disk's label (K, KB = 10³), binary with an i (KiB = 2¹⁰)
SIZE_UNITS = {"": 1, "B": 1, **{p + s: 10 ** (3 * k) for k, p in enumerate("KMGT", 1) for s in ("", "B")},
              **{p + "IB": 2 ** (10 * k) for k, p in enumerate("KMGT", 1)}}
SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*")


def fingerprint(**kw):
    """A field that changes what is written: recorded in settings.json and checked on a re-run."""
    return field(metadata={"fingerprint": True}, **kw)


def parse_size(text: str, flag: str = "--shard-size") -> int:
    """'10M', '1.5G', '256MB', '1GiB' or plain bytes → bytes (more than 0)."""
    m = SIZE.fullmatch(text)
    if not m or m.group(2).upper() not in SIZE_UNITS:
        raise UsageError(f"{flag} {text!r}: use a size like 256MB, 1.5G, 1GiB or a number of bytes")
    size = int(Fraction(m.group(1)) * SIZE_UNITS[m.group(2).upper()])
    if size < 1:
        raise UsageError(f"{flag} {text!r}: must be at least 1 byte")
    return size


def format_size(size: int) -> str:
    """The shortest exact spelling parse_size reads back: 1GiB, 256MB, 1536."""
    exact = [f"{size // SIZE_UNITS[u.upper()]}{u}" for u in ("TiB", "GiB", "MiB", "KiB", "TB", "GB", "MB", "KB")
             if size % SIZE_UNITS[u.upper()] == 0]
    return min([*exact, str(size)], key=len)  # not the first unit that divides: 256MB is also 250000KiB


@dataclass(frozen=True)
class Options:
    # checkpoint folder or hub id (resolved through the Hugging Face cache)
    model: str = fingerprint(default=DEFAULT_MODEL)
    # a hub id's branch, tag or commit (None: main); settings.json records the commit it resolved to
    revision: str | None = None
    # float32 | bfloat16 | float16 | auto (bfloat16 on CUDA and on CPUs with AMX, float32 elsewhere).
    # In the fingerprint as the dtype the tower ran in (auto resolved): float32 and bfloat16 tokens differ
    dtype: str = fingerprint(default="auto")
    # auto | cpu | cuda | cuda:N | mps
    device: str = "auto"
    # soft-token budget per image (70/140/280/560/1120): sets the resize
    image_tokens: int = fingerprint(default=280)
    # soft-token budget per video frame (Gemma4VideoProcessor's default is 70)
    video_tokens: int = fingerprint(default=70)
    # fast: images decoded at the smallest JPEG scale / box-shrink that holds the target, and
    # 1080p+ video frames box-reduced by a whole factor, then the processor's bicubic (≥ 45 dB PSNR
    # of exact, same patch grid) | exact (Gemma4ImageProcessorPil's pixels)
    resize: str = fingerprint(default="fast")
    # which frames of a video
    sampling: Sampling = fingerprint(default_factory=Sampling)
    # auto | decord | pyav
    video_backend: str = "auto"
    # exact: each sampled frame is the one asked for | keyframe: each moved to the nearest keyframe
    # (only keyframes are decoded; frame_indices say which frames were taken)
    seek: str = fingerprint(default="exact")
    # auto | serial | bucket | pack
    batching: str = "auto"
    # share of free accelerator memory a batch may use, in (0, 1]
    memory_fraction: float = 0.7
    # patches per tower call, at least 1; None: from the measured memory model
    max_batch_patches: int | None = None
    # torch.compile the encoder's layers for same-size stacks (serial, bucket)
    compile: bool = False
    # target shard size, bytes (at least 1)
    shard_bytes: int = 1 << 30
    # dtype of the stored tokens
    out_dtype: str = fingerprint(default="bfloat16")
    # Pillow's decompression-bomb limit, pixels (None: no limit)
    max_image_pixels: int | None = 89_478_485
    # also store the mean token of each file: whether shards hold a `pooled` tensor, so in the fingerprint
    pooled: bool = fingerprint(default=True)
    # decode worker processes (None: from the CPU count; 0: decode in the main process, no timeout)
    workers: int | None = None
    # seconds one file may take to decode before its worker is killed (None: no limit)
    decode_timeout: float | None = 120.0
    # write a shard at least this often (seconds), so a kill loses little finished work
    flush_seconds: float = 60.0
    # also compare files by content (sha256), not only size + mtime
    hash: bool = False
    # re-try files whose last row is a failure
    retry_failed: bool = False
    # abort (exit 3) once more files than this have failed in this run (None: never)
    max_failures: int | None = None
    # several devices, one tower each ("all" = every CUDA device, or "cuda:0,cuda:1"); None: --device alone
    devices: str | None = None
    # local: this process (and its decode workers) | ray: a Ray Data actor pool (engines/ray.py)
    engine: str = "local"
    # --engine ray: None starts a private local Ray; "auto" or HOST:PORT joins a running cluster
    ray_address: str | None = None
    # --engine ray: actors (None: one per GPU of the cluster, or per CPU without GPUs)
    ray_actors: int | None = None
    # --engine ray: files per task, the unit that is handed to an actor, retried, and whose rows land together
    task_files: int = 64

    def __post_init__(self):
        _one_of("--dtype", self.dtype, DTYPES)
        _one_of("--out-dtype", self.out_dtype, OUT_DTYPES)
        _one_of("--video-backend", self.video_backend, VIDEO_BACKENDS)
        _one_of("--batching", self.batching, BATCHING)
        _one_of("--resize", self.resize, ("fast", "exact"))
        if not (isinstance(self.seek, str) and self.seek.startswith("nearest")):
            _one_of("--seek", self.seek, ("exact", "keyframe", "nearest", "nearest:SECONDS"))
        seek_bound(self.seek)  # nearest[:SECONDS]: SECONDS > 0
        _one_of("--engine", self.engine, ENGINES)
        _one_of("--max-soft-tokens", self.image_tokens, SOFT_TOKEN_BUDGETS)
        _one_of("--video-soft-tokens", self.video_tokens, SOFT_TOKEN_BUDGETS)
        if not self.model:
            raise UsageError("--model: give a checkpoint folder or a hub id")
        if self.revision is not None and not self.revision.strip():
            raise UsageError("--revision: give a branch, tag or commit")
        _device("--device", self.device)
        if self.devices is not None and self.devices != "all":
            names = [d.strip() for d in self.devices.split(",") if d.strip()]
            if not names:
                raise UsageError(f"--devices {self.devices!r}: use all or a list like cuda:0,cuda:1")
            for name in names:
                _device("--devices", name)
        self._check_sampling()
        self._check_numbers()
        self._check_engine()

    def _check_sampling(self) -> None:
        s = self.sampling
        if (s.frames is not None and s.frames < 1) or s.max_frames < 1 or (s.fps is not None and s.fps <= 0):
            raise UsageError("--frames, --max-frames and --fps must be positive")

    def _check_numbers(self) -> None:
        if not 0 < self.memory_fraction <= 1:
            raise UsageError(f"--memory-fraction {self.memory_fraction}: must be in (0, 1]")
        for flag, value in (("--max-batch-patches", self.max_batch_patches), ("--shard-size", self.shard_bytes),
                            ("--max-image-pixels", self.max_image_pixels), ("--task-files", self.task_files),
                            ("--ray-actors", self.ray_actors)):
            if value is not None and value < 1:
                raise UsageError(f"{flag} {value}: must be at least 1")
        for flag, value in (("--workers", self.workers), ("--max-failures", self.max_failures),
                            ("--flush-seconds", self.flush_seconds)):
            if value is not None and value < 0:
                raise UsageError(f"{flag} {value}: cannot be negative")
        if self.decode_timeout is not None and self.decode_timeout <= 0:
            raise UsageError(f"--decode-timeout {self.decode_timeout}: must be positive (0 on the command line: none)")

    def _check_engine(self) -> None:
        if self.engine != "ray" and (self.ray_address or self.ray_actors):
            raise UsageError("--ray-address and --ray-actors need --engine ray")
        if self.engine == "ray" and self.devices:
            raise UsageError("--devices is for the local engine; with --engine ray each actor has a GPU of its own")

    def fingerprint(self) -> dict:
        """The settings that change what is written (the fields marked `fingerprint`). Call it on
        the run's options after `model.resolve_dtype`, so that dtype names what the tower ran in."""
        values = asdict(self)
        return {f.name: values[f.name] for f in fields(self) if f.metadata.get("fingerprint")}


def _one_of(flag: str, value, choices: tuple) -> None:
    if value not in choices:
        raise UsageError(f"{flag} {value!r}: use one of {', '.join(map(str, choices))}")


def _device(flag: str, name: str) -> None:
    if not isinstance(name, str) or not DEVICE.fullmatch(name):
        raise UsageError(f"{flag} {name!r}: use auto, cpu, cuda, cuda:N or mps")
