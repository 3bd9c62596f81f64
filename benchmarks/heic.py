"""HEIC to patches per core, --resize fast (FFmpeg's HEVC decoder, media/heic.py) against the
fast path through pillow-heif (the shortcut off, as before it) and exact (pillow-heif), on a 12 MP camera-like photo saved as a single image and as a phone's 512² grid.

    python benchmarks/heic.py [--rounds 3] [--budget 280] [--dir /tmp/heic-bench]

One process, one thread: fast and exact interleaved round by round, each the minimum of the
rounds in process CPU time (time.process_time); PSNR of fast against exact patch pixels, and the
backend the fast path reports (pyav when the shortcut was taken).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gemma4enc.dev.camera import camera_photo
from gemma4enc.media import image
from gemma4enc.media.image import register_heif, decode_image
from gemma4enc.media.patches import patchify


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--budget", type=int, default=280)
    p.add_argument("--dir", default="/tmp/heic-bench")
    args = p.parse_args()
    register_heif()
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    photo = None
    files = {}
    for name, tile in (("single", 0), ("grid512", 512)):
        path = folder / f"12mp-{name}.heic"
        if not path.exists():
            photo = photo or camera_photo(4032, 3024, seed=7)
            photo.save(path, format="HEIF", quality=50, tile_size=tile)
        files[name] = path
    for name, path in files.items():
        best = {"fast": float("inf"), "libheif-fast": float("inf"), "exact": float("inf")}
        out = {}
        for _ in range(args.rounds):
            for method in ("fast", "libheif-fast", "exact"):
                shortcut = image._heic
                if method == "libheif-fast":
                    image._heic = lambda *a: None
                t = time.process_time()
                frames = decode_image(str(path), None, fit=None if method == "exact" else args.budget)
                patches = patchify(frames.images[0], args.budget)
                best[method] = min(best[method], time.process_time() - t)
                image._heic = shortcut
                out[method] = (frames, patches)
        a, b = out["fast"][1].pixels.astype(np.float64), out["exact"][1].pixels.astype(np.float64)
        psnr = 10 * np.log10(255.0**2 / np.mean((a - b) ** 2))
        print(
            f"{name}: {path.stat().st_size / 1e6:.1f} MB, fast {best['fast'] * 1e3:.0f} ms "
            f"(backend {out['fast'][0].info.get('backend', 'pillow-heif')}), "
            f"fast through pillow-heif {best['libheif-fast'] * 1e3:.0f} ms, exact {best['exact'] * 1e3:.0f} ms; "
            f"{best['libheif-fast'] / best['fast']:.2f}x / {best['exact'] / best['fast']:.2f}x, "
            f"PSNR fast vs exact {psnr:.1f} dB"
        )


if __name__ == "__main__":
    main()
