"""Every setting of a run, in one frozen dataclass passed down whole and saved in the output.

`Options` owns the defaults (the CLI reads its own from `Options()`) and checks itself when
built, so a library caller gets the same one-line `UsageError` as the command line. Fields
marked `fingerprint` change what is written; a re-run into the same OUT must match them.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, fields
from fractions import Fraction

import numpy as np

from .errors import UsageError

SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)  # the soft-token budgets Gemma 4's processor knows
# What one video's sampled frames may hold once patchified: a soft token is 3×3 patches of 16×16 RGB
# bytes and an int64 (x, y) each. --frames / --max-frames past it are refused (issue 44: a flag
# of a million frames grew a worker without bound); 8,695 frames at 70 soft tokens, 543 at 1120.
FRAMES_BYTES_MAX = 4 << 30
SOFT_TOKEN_BYTES = 3 * 3 * (16 * 16 * 3 + 16)
DEFAULT_FRAMES = 32  # frames per video, uniform (Gemma4VideoProcessor's default), and the cap with --fps
NEAREST_SHIFT = (
    0.5  # --seek nearest: seconds a sample may move to a keyframe (a phone's 1 s GOP: every sample)
)
DEFAULT_MODEL = "google/gemma-4-E2B-it"  # the smallest released Gemma 4 with a vision tower
DTYPES = ("auto", "float32", "bfloat16", "float16")
# the stored dtypes, the one map of them: name → (safetensors' dtype code, bytes a value); torch
# and numpy take the names as they are (getattr(torch, name), np.dtype(name))
OUT_DTYPES = {"bfloat16": ("BF16", 2), "float16": ("F16", 2), "float32": ("F32", 4)}
VIDEO_BACKENDS = ("auto", "decord", "pyav")
BATCHING = ("auto", "serial", "bucket", "pack")
ENGINES = ("local", "ray")
STORES = ("tokens", "pooled")
# --resize: fast and exact are Pillow's bicubic (Gemma4ImageProcessorPil), torchvision is torch's (the default processors)
RESIZES = ("fast", "exact", "torchvision")
DEVICE = re.compile(r"auto|cpu|mps|cuda(:\d+)?")
# decimal like a disk's label (K, KB = 10³), binary with an i (KiB = 2¹⁰)
SIZE_UNITS = {
    "": 1,
    "B": 1,
    **{p + s: 10 ** (3 * k) for k, p in enumerate("KMGT", 1) for s in ("", "B")},
    **{p + "IB": 2 ** (10 * k) for k, p in enumerate("KMGT", 1)},
}
SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*")


# the settings that shape the output and that a re-run may omit: Options.resume reads them back from
# OUT/settings.json (and the sampling's frames, fps and max_frames, each on its own)
RECORDED = (
    "model",
    "revision",
    "dtype",
    "image_tokens",
    "video_tokens",
    "resize",
    "seek",
    "out_dtype",
    "pooled",
    "store",
)


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
    exact = [
        f"{size // SIZE_UNITS[u.upper()]}{u}"
        for u in ("TiB", "GiB", "MiB", "KiB", "TB", "GB", "MB", "KB")
        if size % SIZE_UNITS[u.upper()] == 0
    ]
    return min([*exact, str(size)], key=len)  # not the first unit that divides: 256MB is also 250000KiB


@dataclass(frozen=True)
class Sampling:
    frames: int | None = (
        DEFAULT_FRAMES  # uniform frames per video (Gemma4VideoProcessor's default); None with fps
    )
    fps: float | None = None  # or: frames per second of video, capped by max_frames
    max_frames: int = DEFAULT_FRAMES  # cap for fps sampling

    def indices(self, total: int, timestamps: np.ndarray | None = None) -> list[int]:
        """Frame indices to take from a video of `total` frames (presentation order)."""
        if total <= 0:
            return []
        if self.fps is None:
            n = min(self.frames or DEFAULT_FRAMES, total)
            return [i * total // n for i in range(n)]  # as Gemma4VideoProcessor: arange(n) * total // n
        assert timestamps is not None and len(timestamps) == total
        wanted = np.arange(0.0, float(timestamps[-1]) + 1e-9, 1.0 / self.fps)
        # the last frame shown at or before each wanted time
        idx = np.clip(np.searchsorted(timestamps, wanted + 1e-6, side="right") - 1, 0, total - 1)
        idx = sorted(set(idx.tolist()))
        if len(idx) > self.max_frames:
            idx = [idx[i * len(idx) // self.max_frames] for i in range(self.max_frames)]
        return idx


WORKERS_PER_CORE = 4  # the most --workers a core may have (a decode that waits on a slow disk or store)


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
    # of exact, same patch grid) | exact (Gemma4ImageProcessorPil's pixels) | torchvision (the
    # pixels of Gemma4ImageProcessor and Gemma4VideoProcessor, transformers' default and vLLM's)
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
    # what shards keep: tokens (and the pooled vectors) | pooled (the file's and each frame's mean only)
    store: str = fingerprint(default="tokens")
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
    # local: this process (and its decode workers) | ray: a pool of Ray actors (run/ray/)
    engine: str = "local"
    # --engine ray: None starts a private local Ray; "auto" or HOST:PORT joins a running cluster
    ray_address: str | None = None
    # --engine ray: actors (None: one per GPU of the cluster, or per CPU without GPUs)
    ray_actors: int | None = None
    # --engine ray: files per task, the unit that is handed to an actor, retried, and whose rows land together
    task_files: int = 64

    def __post_init__(self):
        _one_of("--dtype", self.dtype, DTYPES)
        _one_of("--out-dtype", self.out_dtype, tuple(OUT_DTYPES))
        _one_of("--video-backend", self.video_backend, VIDEO_BACKENDS)
        _one_of("--batching", self.batching, BATCHING)
        _one_of("--resize", self.resize, RESIZES)
        if not (isinstance(self.seek, str) and self.seek.startswith("nearest")):
            _one_of("--seek", self.seek, ("exact", "keyframe", "nearest", "nearest:SECONDS"))
        seek_bound(self.seek)  # nearest[:SECONDS]: SECONDS > 0
        _one_of("--engine", self.engine, ENGINES)
        _one_of("--store", self.store, STORES)
        if self.store == "pooled" and not self.pooled:
            raise UsageError(
                "--store pooled keeps only the pooled vectors: it cannot go with --no-pooled"
            )
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
        if (
            (s.frames is not None and s.frames < 1)
            or s.max_frames < 1
            or (s.fps is not None and s.fps <= 0)
        ):
            raise UsageError("--frames, --max-frames and --fps must be positive")
        most = FRAMES_BYTES_MAX // (self.video_tokens * SOFT_TOKEN_BYTES)
        flag, asked = ("--frames", s.frames) if s.frames is not None else ("--max-frames", s.max_frames)
        if asked > most:
            raise UsageError(
                f"{flag} {asked:,}: a video's sampled frames at --video-soft-tokens {self.video_tokens} "
                f"would hold {asked * self.video_tokens * SOFT_TOKEN_BYTES / 2**30:,.1f} GiB of patches, past "
                f"the {FRAMES_BYTES_MAX >> 30} GiB one file may decode to; at most {most:,} frames"
            )

    def _check_numbers(self) -> None:
        if not 0 < self.memory_fraction <= 1:
            raise UsageError(f"--memory-fraction {self.memory_fraction}: must be in (0, 1]")
        for flag, value in (
            ("--max-batch-patches", self.max_batch_patches),
            ("--shard-size", self.shard_bytes),
            ("--task-files", self.task_files),
            ("--ray-actors", self.ray_actors),
        ):
            if value is not None and value < 1:
                raise UsageError(f"{flag} {value}: must be at least 1")
        if self.max_image_pixels is not None and self.max_image_pixels < 0:
            raise UsageError(f"--max-image-pixels {self.max_image_pixels}: must be 0 (no limit) or more")
        for flag, value in (
            ("--workers", self.workers),
            ("--max-failures", self.max_failures),
            ("--flush-seconds", self.flush_seconds),
        ):
            if value is not None and value < 0:
                raise UsageError(f"{flag} {value}: cannot be negative")
        if self.decode_timeout is not None and self.decode_timeout <= 0:
            raise UsageError(
                f"--decode-timeout {self.decode_timeout}: must be positive (0 on the command line: none)"
            )

    def _check_engine(self) -> None:
        import os

        cap = WORKERS_PER_CORE * (os.cpu_count() or 1)
        if self.engine == "local" and self.workers is not None and self.workers > cap:
            raise UsageError(
                f"--workers {self.workers}: at most {cap} on this machine ({WORKERS_PER_CORE} a core: "
                "decoding is CPU work; more processes only share the cores)"
            )
        if self.engine != "ray" and (self.ray_address or self.ray_actors):
            raise UsageError("--ray-address and --ray-actors need --engine ray")
        if self.engine == "ray" and self.devices:
            raise UsageError(
                "--devices is for the local engine; with --engine ray each actor has a GPU of its own"
            )

    def fingerprint(self) -> dict:
        """The settings that change what is written (the fields marked `fingerprint`). Call it on
        the run's options after `model.resolve_dtype`, so that dtype names what the tower ran in."""
        values = asdict(self)
        return {f.name: values[f.name] for f in fields(self) if f.metadata.get("fingerprint")}

    @classmethod
    def resume(
        cls, saved: dict | None, flags: dict, given=frozenset(), where: str = "settings.json"
    ) -> tuple[Options, list[str]]:
        """A run's options, and the notes to show: the settings given, and for each output-shaping one
        not given (RECORDED, and the sampling), what OUT's settings.json (`saved`) recorded, so that a
        re-run may omit them. `flags`: settings by field name, `frames`/`fps`/`max_frames` in place of
        `sampling`; what is missing takes its default. `given`: the names the user gave."""
        default = cls()
        kw = {f.name: getattr(default, f.name) for f in fields(cls) if f.name != "sampling"}
        kw |= {
            "frames": default.sampling.frames,
            "fps": default.sampling.fps,
            "max_frames": default.sampling.max_frames,
        }
        kw |= flags
        recorded = _recorded(saved or {}, set(given))
        notes = []
        differ = ", ".join(f"{k} {v}" for k, v in recorded.items() if kw.get(k) != v)
        if differ:
            notes.append(f"as {where} records: {differ}")
        kw |= recorded
        notes += [f"warning: {note}" for note in _no_effect(kw, set(given))]
        frames, fps, max_frames = kw.pop("frames"), kw.pop("fps"), kw.pop("max_frames")
        # only the setting that has an effect is recorded: --frames without --fps, --max-frames with it
        sampling = Sampling(
            frames=None if fps else frames, fps=fps, max_frames=max_frames if fps else DEFAULT_FRAMES
        )
        return cls(**kw, sampling=sampling), notes


def _recorded(saved: dict, given: set) -> dict:
    """The output-shaping settings a run did not give, as settings.json recorded them."""
    kw = {key: saved[key] for key in RECORDED if key in saved and key not in given}
    sampling = saved.get("sampling") or {}
    if not sampling:
        return kw
    values = {
        "frames": sampling.get("frames") or DEFAULT_FRAMES,
        "fps": sampling.get("fps"),
        "max_frames": sampling.get("max_frames", DEFAULT_FRAMES),
    }
    return kw | {k: v for k, v in values.items() if k not in given}


def _no_effect(kw: dict, given: set) -> list[str]:
    """Flags that were given but change nothing (neither refused nor recorded)."""
    notes = []
    if "max_frames" in given and kw.get("fps") is None:
        notes.append("--max-frames has no effect without --fps (it caps --fps sampling); ignored")
    if "frames" in given and kw.get("fps") is not None:
        notes.append("--frames has no effect with --fps (--max-frames caps the frames); ignored")
    return notes


def seek_bound(seek: str) -> float | None:
    """--seek nearest[:SECONDS] → the largest shift in seconds; None for exact and keyframe."""
    if not seek.startswith("nearest"):
        return None
    mode, _, value = seek.partition(":")
    try:
        bound = float(value) if value else NEAREST_SHIFT
    except ValueError:
        bound = -1.0
    if mode != "nearest" or not bound > 0 or bound == float("inf"):
        raise UsageError(
            f"--seek {seek!r}: nearest takes a shift bound in seconds above 0, e.g. nearest:0.5"
        )
    return bound


def _one_of(flag: str, value, choices: tuple) -> None:
    if value not in choices:
        raise UsageError(f"{flag} {value!r}: use one of {', '.join(map(str, choices))}")


def _device(flag: str, name: str) -> None:
    if not isinstance(name, str) or not DEVICE.fullmatch(name):
        raise UsageError(f"{flag} {name!r}: use auto, cpu, cuda, cuda:N or mps")
