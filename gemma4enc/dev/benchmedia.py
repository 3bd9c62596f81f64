"""Real-size media for `gemma4enc bench --e2e` and benchmarks/decode.py, made once and cached.

Phone photos (12 MP and 24 MP JPEG, some stored turned under EXIF orientation 6, a 12 MP
HEIC), 2560×1440 PNG screenshots, and panning noisy clips: H.264 10 s 480p and 60 s 1080p
(GOP 250, B-frames), HEVC and VP9 1080p 10 s. The folder is keyed by VERSION (bump it when a
generator changes what it makes) and by the scale: GEMMA4ENC_BENCH_SCALE shrinks every side
and every clip's length (tests use ~0.05); GEMMA4ENC_BENCH_MEDIA moves the cache.
A file is written under a hidden name and renamed when whole, so a kill leaves nothing half-made.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Callable

import numpy as np

VERSION = 2
PROGRESS_S = 5.0
FPS = 30
# sensor grain in every frame, ± levels of luma: it sets the bitrate (fresh noise does not compress);
# 3 gives 1080p H.264 at about a phone's rate (~50 MB a minute at 30 fps; 5 gave 115)
NOISE = 3
# fast presets that still make a long-GOP file with B-frames: generation stays affordable on 2 cores
X264 = {
    "preset": "superfast",
    "crf": "23",
    "x264-params": "keyint=250:min-keyint=25:bframes=3:scenecut=0",
}
X265 = {"preset": "ultrafast", "crf": "28", "x265-params": "keyint=250:bframes=4:log-level=error"}
VP9 = {"deadline": "realtime", "cpu-used": "8", "crf": "33", "b": "0", "g": "250", "row-mt": "1"}


def scale() -> float:
    value = float(os.environ.get("GEMMA4ENC_BENCH_SCALE", "1"))
    if not 0 < value <= 1:
        from ..errors import UsageError

        raise UsageError(f"GEMMA4ENC_BENCH_SCALE must be in (0, 1], not {value}")
    return value


def cache_dir() -> Path:
    root = Path(
        os.environ.get("GEMMA4ENC_BENCH_MEDIA", Path.home() / ".cache" / "gemma4enc" / "bench-media")
    )
    s = scale()
    return root / (f"v{VERSION}" if s == 1 else f"v{VERSION}-x{s:g}")


def _side(n: int, s: float, multiple: int = 2, least: int = 64) -> int:
    """A side scaled, even (4:2:0), and not below what every encoder accepts."""
    return max(least, int(n * s) // multiple * multiple)


def screenshot(width: int, height: int, seed: int):
    """A desktop: flat panels, hard edges, lines of small text, a photo in a window."""
    from PIL import Image, ImageDraw

    from .camera import camera_photo

    rng = np.random.default_rng(seed)
    image = Image.new("RGB", (width, height), (236, 236, 240))
    draw = ImageDraw.Draw(image)
    draw.rectangle((0, 0, width, max(4, height // 40)), fill=(40, 44, 52))
    for _ in range(6):
        x0, y0 = int(rng.integers(0, width * 2 // 3)), int(rng.integers(height // 36, height * 2 // 3))
        x1, y1 = (
            x0 + int(rng.integers(width // 8, width // 2)),
            y0 + int(rng.integers(height // 7, height // 2)),
        )
        draw.rectangle(
            (x0, y0, x1, y1), fill=tuple(int(c) for c in rng.integers(200, 256, 3)), outline=(90, 90, 90)
        )
        draw.rectangle((x0, y0, x1, y0 + 24), fill=tuple(int(c) for c in rng.integers(60, 160, 3)))
        for line in range(y0 + 32, y1 - 14, 18):
            words = " ".join(
                "".join(chr(97 + int(c)) for c in rng.integers(0, 26, rng.integers(2, 9)))
                for _ in range(int(rng.integers(3, 12)))
            )
            draw.text((x0 + 8, line), words, fill=(20, 20, 20))
    image.paste(camera_photo(width // 4, height // 4, seed=seed), (width * 5 // 8, height * 5 // 8))
    return image


def write_clip(
    path: Path,
    codec: str,
    size: tuple[int, int],
    seconds: float,
    options: dict,
    log=print,
    noise: int = NOISE,
) -> None:
    """A panning camera-like scene with fresh sensor noise in every frame, encoded from yuv420p."""
    import av

    from .camera import camera_photo

    w, h = size
    scene = camera_photo(w + w // 2, h + h // 4, seed=len(path.name)).convert("YCbCr")
    luma, cb, cr = (np.asarray(c) for c in scene.split())
    rng = np.random.default_rng(0)
    grain = [rng.integers(-noise, noise + 1, (h, w), dtype=np.int16) for _ in range(5)]
    total, start, last = max(2, int(seconds * FPS)), time.monotonic(), time.monotonic()
    with av.open(str(path), "w", format="mp4" if path.suffix == ".mp4" else "webm") as container:
        stream = container.add_stream(codec, rate=FPS, options=options)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        for i in range(total):
            x = int((w // 4) * (1 + np.sin(i / 97))) // 2 * 2  # even: chroma is at half resolution
            y = int((h // 8) * (1 + np.cos(i / 131))) // 2 * 2
            plane = np.clip(luma[y : y + h, x : x + w] + grain[i % 5], 0, 255).astype(np.uint8)
            u, v = (c[y : y + h : 2, x : x + w : 2] for c in (cb, cr))
            yuv = np.concatenate([plane, u.reshape(-1, w), v.reshape(-1, w)])
            container.mux(stream.encode(av.VideoFrame.from_ndarray(yuv, format="yuv420p")))
            if time.monotonic() - last > PROGRESS_S:
                last = time.monotonic()
                log(f"  {path.name}: frame {i + 1}/{total}, {time.monotonic() - start:.0f} s")
        container.mux(stream.encode())


def plan() -> dict[str, list[tuple[str, Callable[[Path], None]]]]:
    """kind -> [(file name, how to make it)]. Names with 'o6' are stored turned (EXIF orientation 6)."""
    from .camera import camera_photo, save_photo

    s = scale()

    def photo(w, h, seed, orientation=1, quality=90):
        return lambda path: save_photo(
            camera_photo(_side(w, s), _side(h, s), seed=seed), path, orientation, quality
        )

    def clip(codec, w, h, seconds, options):
        return lambda path, log=print: write_clip(
            path, codec, (_side(w, s), _side(h, s)), seconds * s, options, log
        )

    return {
        "jpeg-12mp": [
            ("12mp-a.jpg", photo(4032, 3024, 1)),
            ("12mp-b-o6.jpg", photo(3024, 4032, 2, 6)),
            ("12mp-c.jpg", photo(4032, 3024, 3)),
            ("12mp-d-o6.jpg", photo(3024, 4032, 4, 6)),
        ],
        "jpeg-24mp": [("24mp-a.jpg", photo(6000, 4000, 5)), ("24mp-b-o6.jpg", photo(4000, 6000, 6, 6))],
        "heic-12mp": [("12mp-a.heic", photo(4032, 3024, 7, quality=50))],  # ~2–3 MB, as a phone's
        "png-screenshot": [
            (
                f"screen-{i}.png",
                lambda path, i=i: screenshot(_side(2560, s), _side(1440, s), i).save(path),
            )
            for i in range(2)
        ],
        "h264-480p-10s": [("h264-480p-10s.mp4", clip("libx264", 854, 480, 10, X264))],
        "h264-1080p-60s": [("h264-1080p-60s.mp4", clip("libx264", 1920, 1080, 60, X264))],
        "hevc-1080p-10s": [("hevc-1080p-10s.mp4", clip("libx265", 1920, 1080, 10, X265))],
        "vp9-1080p-10s": [("vp9-1080p-10s.webm", clip("libvpx-vp9", 1920, 1080, 10, VP9))],
    }


CODEC = {"h264": "libx264", "hevc": "libx265", "vp9": "libvpx-vp9"}


def missing_encoder(kind: str) -> str | None:
    """The encoder a clip kind needs when this PyAV build lacks it, else None."""
    codec = CODEC.get(kind.split("-")[0])
    if codec is None:
        return None
    import av

    return None if codec in av.codecs_available else codec


def generated(kinds: list[str] | None = None, log=print) -> tuple[dict[str, list[str]], float]:
    """kind -> files, making what the cache lacks; and the seconds spent making them (0: all cached)."""
    from ..media.image import register_heif

    register_heif()
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    groups, spent = {}, 0.0
    for kind, files in plan().items():
        if kinds and kind not in kinds:
            continue
        if codec := missing_encoder(kind):
            log(f"{kind}: skipped, this PyAV has no {codec} encoder")
            continue
        for name, make in files:
            path = folder / name
            if path.exists():
                continue
            log(f"generating {path} (once; cached)")
            start, cpu = time.monotonic(), time.process_time()
            part = path.with_name(f".{path.stem}.part{path.suffix}")
            make(part, log=log) if path.suffix in (".mp4", ".webm") else make(part)
            part.rename(path)
            spent += time.process_time() - cpu
            log(f"  {name}: {path.stat().st_size / 1e6:.1f} MB in {time.monotonic() - start:.0f} s")
        groups[kind] = [str(folder / name) for name, _ in files]
    return groups, spent


def sampled(folder: Path, count: int, seed: int = 0) -> dict[str, list[str]]:
    """A user's folder: up to `count` files per kind and extension, drawn at random."""
    from ..media.discover import discover

    items, _ = discover([str(folder)])
    groups: dict[str, list[str]] = {}
    for item in items:
        if item.kind in ("image", "video") and not item.error:
            ext = Path(item.path).suffix.lower().lstrip(".") or "noext"
            groups.setdefault(f"{item.kind}-{ext}", []).append(item.path)
    rng = random.Random(seed)
    return {k: sorted(rng.sample(v, min(count, len(v)))) for k, v in sorted(groups.items())}


def is_video(kind: str) -> bool:
    return kind.startswith(("h264", "hevc", "vp9", "video"))
