"""Sampled video frames → patches at 70 tokens: CPU time per sampled frame, per backend and path.

    .venv/bin/python benchmarks/video_decode.py [--rounds 2] [--frames 32] [--clip NAME ...]

Real-size clips are made once (PyAV encodes them) and cached in ~/.cache/gemma4enc/bench-media/
(`GEMMA4ENC_BENCH_MEDIA` overrides). Every frame carries its own index as a bar code in its top
strip, so each sampled frame is read back from its patches and a wrong frame is counted.

Time is the process's CPU time (all its threads) per sampled frame: on a shared machine that is
what one core pays, where wall time also counts other processes. Rounds are interleaved and the
minimum is reported.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gemma4enc.media import video as decode  # noqa: E402
from gemma4enc.media.decode import decode_video, prefit  # noqa: E402
from gemma4enc.media.patches import PATCH, patchify  # noqa: E402
from gemma4enc.options import Sampling

TOKENS = 70  # Gemma4VideoProcessor's budget per frame
BITS = 12  # index bits in the bar code: up to 4095 frames
STRIP = 8  # the bar code fills the top 1/STRIP of the frame; the rest is moving texture

# name: (codec, width, height, seconds, encoder options)
CLIPS = {
    "h264_1080p_60s.mp4": ("libx264", 1920, 1080, 60, {"preset": "veryfast", "crf": "23", "g": "250",
                                                       "bf": "3", "sc_threshold": "0"}),
    "h264_480p_10s.mp4": ("libx264", 854, 480, 10, {"preset": "veryfast", "crf": "23", "g": "250", "bf": "3"}),
    "hevc_1080p_10s.mp4": ("libx265", 1920, 1080, 10, {"preset": "ultrafast", "crf": "26",
                                                      "x265-params": "keyint=250:bframes=3:log-level=error"}),
    "vp9_1080p_10s.webm": ("libvpx-vp9", 1920, 1080, 10, {"deadline": "realtime", "cpu-used": "8", "g": "250",
                                                         "crf": "32", "b": "0"}),
}
FPS = 30


def media_dir() -> Path:
    folder = Path(os.environ.get("GEMMA4ENC_BENCH_MEDIA", Path.home() / ".cache/gemma4enc/bench-media"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


# ---- clips that carry their own truth -----------------------------------------------------------


def _texture(height: int, width: int, seed: int) -> np.ndarray:
    """Smooth blobs plus fine grain, twice the frame size, so a pan shows fresh content."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (height // 16 + 2, width // 16 + 2)).astype(np.float32)
    smooth = np.kron(coarse, np.ones((16, 16), np.float32))[:height, :width]
    return np.clip(smooth * 0.7 + rng.normal(0, 8, (height, width)), 0, 255).astype(np.uint8)


def _yuv_frame(index: int, width: int, height: int, luma: np.ndarray, chroma: np.ndarray,
               rng: np.random.Generator) -> np.ndarray:
    """(H*3/2, W) yuv420p: a panning texture, a little noise, and `index` in a black/white strip."""
    dx, dy = (index * 5) % (luma.shape[1] - width), (index * 3) % (luma.shape[0] - height)
    y = luma[dy: dy + height, dx: dx + width].copy()
    y[height // STRIP:] += rng.integers(0, 2, (height - height // STRIP, width), dtype=np.uint8)
    col = width // BITS
    for bit in range(BITS):
        y[: height // STRIP, bit * col: (bit + 1) * col] = 235 if (index >> bit) & 1 else 16
    y[: height // STRIP, BITS * col:] = 16
    h2, w2 = height // 2, width // 2
    u = chroma[dy // 2: dy // 2 + h2, dx // 2: dx // 2 + w2].copy()
    v = chroma[::-1, ::-1][dy // 2: dy // 2 + h2, dx // 2: dx // 2 + w2].copy()
    u[: height // STRIP // 2] = v[: height // STRIP // 2] = 128
    return np.concatenate([y, u.reshape(-1, width), v.reshape(-1, width)])


def make_clip(path: Path, codec: str, width: int, height: int, seconds: int, options: dict) -> None:
    import av

    frames = seconds * FPS
    luma = _texture(height * 2, width * 2, 1)
    chroma = (128 + (_texture(height, width, 2).astype(np.int16) - 128) // 4).astype(np.uint8)  # camera-like colour
    rng = np.random.default_rng(3)
    partial = path.with_name(path.stem + ".partial" + path.suffix)
    started = last = time.monotonic()
    with av.open(str(partial), "w") as container:
        stream = container.add_stream(codec, rate=FPS)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = dict(options)
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(_yuv_frame(i, width, height, luma, chroma, rng), format="yuv420p")
            for packet in stream.encode(frame):
                container.mux(packet)
            if time.monotonic() - last > 5:
                last = time.monotonic()
                print(f"  {path.name}: {i + 1}/{frames} frames encoded, {last - started:.0f} s", flush=True)
        for packet in stream.encode():
            container.mux(packet)
    partial.rename(path)
    print(f"  {path.name}: {frames} frames, {path.stat().st_size / 1e6:.1f} MB, {time.monotonic() - started:.0f} s",
          flush=True)


def clip(name: str) -> Path:
    path = media_dir() / name
    if not path.exists():
        print(f"making {path} (once; cached)", flush=True)
        make_clip(path, *CLIPS[name])
    return path


def read_index(patches) -> int:
    """The bar code of a frame, read back from its patches (any size: relative columns)."""
    ph, pw = int(patches.positions[:, 1].max()) + 1, int(patches.positions[:, 0].max()) + 1
    image = patches.pixels.reshape(ph, pw, PATCH, PATCH, 3).transpose(0, 2, 1, 3, 4).reshape(ph * PATCH, pw * PATCH, 3)
    band = image[: image.shape[0] // STRIP - 2].astype(np.float32).mean(axis=(0, 2))
    col = image.shape[1] / BITS
    # the strip's columns were cut at width // BITS of the source: stay well inside each one
    bits = [band[int(b * col + col * 0.3): int(b * col + col * 0.6)].mean() > 127 for b in range(BITS)]
    return sum(1 << b for b, on in enumerate(bits) if on)


# ---- timing -------------------------------------------------------------------------------------


TODAY = {"SKIPS_NONREF": set()}  # gemma4enc.media.video as it was before issue 14: each new step turned off
EXACT = {"resize": "exact"}  # the processor's resize of full-size frames, as today
FAST = {"resize": "fast"}  # the default since issue 14: prefit (box reduce) first, as media/prepare.py does


def cases() -> dict[str, tuple[dict, dict]]:
    """Each case: keyword arguments of decode_video (+ resize), and gemma4enc.media.video settings it runs under."""
    return {
        "decord today": ({"backend": "decord", **EXACT}, {}),
        "pyav today": ({"backend": "pyav", **EXACT}, TODAY),
        "pyav skip-nonref": ({"backend": "pyav", **EXACT}, {}),
        "decord fast": ({"backend": "decord", **FAST}, {}),
        "pyav skip + fast": ({"backend": "pyav", **FAST}, {}),
        "pyav, tail: 2 threads": ({"backend": "pyav", **FAST}, {"THREADS": 2}),  # a run's last file (workers.py)
        "decord --seek keyframe": ({"backend": "decord", "seek": "keyframe", **FAST}, {}),
        "pyav --seek keyframe": ({"backend": "pyav", "seek": "keyframe", **FAST}, {}),
    }


def run_case(path: Path, frames: int, kwargs: dict, settings: dict) -> tuple[float, float, int, int]:
    """CPU seconds, wall seconds, frames returned, frames whose bar code disagrees with their index."""
    kwargs = dict(kwargs)
    fit = prefit if kwargs.pop("resize") == "fast" else lambda image, _: image
    transform = lambda image: patchify(fit(image, TOKENS), TOKENS)  # noqa: E731 - as media/prepare.py does
    saved = {k: getattr(decode, k) for k in settings}
    for k, v in settings.items():
        setattr(decode, k, v)
    try:
        start, wall = time.process_time(), time.perf_counter()
        got = decode_video(str(path), Sampling(frames=frames), transform=transform, **kwargs)
        cpu, wall = time.process_time() - start, time.perf_counter() - wall
    finally:
        for k, v in saved.items():
            setattr(decode, k, v)
    wrong = sum(read_index(p) != i for p, i in zip(got.images, got.indices))
    return cpu, wall, len(got.indices), wrong


def demux_pass(path: Path) -> float:
    """CPU seconds of the index pass decode_video_pyav makes before decoding (pts and keyframes of
    every packet): what skipping it for MP4, whose moov box already indexes the samples, could save."""
    import av

    start = time.process_time()
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        index = [(p.pts, p.is_keyframe) for p in container.demux(stream) if p.pts is not None and p.size]
    assert index
    return time.process_time() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--frames", type=int, default=32)
    parser.add_argument("--clip", action="append", choices=sorted(CLIPS), help="default: all")
    args = parser.parse_args(argv)
    names = args.clip or list(CLIPS)
    paths = {name: clip(name) for name in names}
    table = cases()
    best: dict[tuple[str, str], float] = {}
    walls: dict[tuple[str, str], float] = {}
    seen: dict[tuple[str, str], tuple[int, int]] = {}
    for r in range(args.rounds):
        for name in names:
            for case, (kwargs, settings) in table.items():
                cpu, wall, n, wrong = run_case(paths[name], args.frames, kwargs, settings)
                key = (name, case)
                best[key] = min(best.get(key, float("inf")), cpu / max(n, 1))
                walls[key] = min(walls.get(key, float("inf")), wall)
                seen[key] = (n, max(wrong, seen.get(key, (0, 0))[1]))
                print(f"  round {r + 1}/{args.rounds} {name:22s} {case:24s} {cpu:6.2f} s CPU, {wall:6.2f} s wall, {n} frames, "
                      f"{wrong} wrong", flush=True)
    print(f"\n{args.frames} uniformly sampled frames → patches at {TOKENS} tokens; CPU ms per sampled frame "
          f"(min of {args.rounds} rounds), sampled frames/s per core, wall s for the clip (noisy), wrong frames")
    for name in names:
        today = min(best[(name, c)] for c in ("decord today", "pyav today"))
        demux = min(demux_pass(paths[name]) for _ in range(args.rounds))
        default = best[(name, "pyav skip + fast")] * seen[(name, "pyav skip + fast")][0]
        print(f"\n{name}: the demux pass {demux * 1000:.0f} ms CPU, {demux / default:.1%} of the default path's "
              f"{default:.2f} s for the clip")
        for case in table:
            per = best[(name, case)]
            n, wrong = seen[(name, case)]
            print(f"  {case:24s} {per * 1000:8.1f} ms  {1 / per:6.1f} frames/s/core  {walls[(name, case)]:6.2f} s wall  "
                  f"{n:3d} frames  "
                  f"{wrong} wrong  ×{today / per:.2f} vs today's best")


if __name__ == "__main__":
    main()
