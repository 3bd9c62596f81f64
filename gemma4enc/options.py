"""Every setting of a run, in one frozen dataclass passed down whole and saved in the output."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .decode import Sampling

DEFAULT_MODEL = "google/gemma-4-E2B-it"  # the smallest released Gemma 4 with a vision tower


@dataclass(frozen=True)
class Options:
    # checkpoint folder or hub id (resolved through the Hugging Face cache)
    model: str = DEFAULT_MODEL
    # float32 | bfloat16 | float16 | auto (bfloat16 on CUDA and on CPUs with AMX, float32 elsewhere)
    dtype: str = "auto"
    # auto | cpu | cuda | cuda:N | mps
    device: str = "auto"
    # soft-token budget per image (70/140/280/560/1120): sets the resize
    image_tokens: int = 280
    # soft-token budget per video frame (Gemma4VideoProcessor's default is 70)
    video_tokens: int = 70
    # images: fast (decode at the smallest JPEG scale / box-shrink that holds the target, then the
    # processor's bicubic; ≥ 45 dB PSNR of exact, same patch grid) | exact (Gemma4ImageProcessorPil's pixels)
    resize: str = "fast"
    # which frames of a video
    sampling: Sampling = field(default_factory=Sampling)
    # auto | decord | pyav
    video_backend: str = "auto"
    # auto | serial | bucket | pack
    batching: str = "auto"
    # share of free accelerator memory a batch may use
    memory_fraction: float = 0.7
    # patches per tower call; None: from the measured memory model
    max_batch_patches: int | None = None
    # torch.compile the encoder's layers for same-size stacks (serial, bucket)
    compile: bool = False
    # target shard size, bytes
    shard_bytes: int = 1 << 30
    # dtype of the stored tokens
    out_dtype: str = "bfloat16"
    # Pillow's decompression-bomb limit, pixels (None: no limit)
    max_image_pixels: int | None = 89_478_485
    # also store the mean token of each file
    pooled: bool = True
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

    def fingerprint(self) -> dict:
        """The settings that change what is written: a re-run must match them."""
        keep = ("model", "dtype", "image_tokens", "video_tokens", "resize", "sampling", "out_dtype", "pooled")
        return {k: v for k, v in asdict(self).items() if k in keep}
