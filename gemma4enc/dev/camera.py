"""Camera-like photos at real sizes, for the tests of the fast resize and the decode benchmark.

A phone photo is smooth light and colour, some hard edges, fine texture and sensor noise,
saved as a 4:2:0 JPEG at quality ~90. Each layer matters here: the noise and the texture are
what a reduced-size decode and a box pre-shrink filter differently from a full-size bicubic,
and they make libjpeg's entropy decoding (the part a reduced decode cannot skip) as costly
as a real photo's. Only NumPy and Pillow: 12 MP in about a second.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from ..media.image import UPRIGHT

ORIENTATION = 0x0112  # the EXIF tag
# the transpose that stores an upright picture under each orientation (the inverse of UPRIGHT's)
STORED = {**UPRIGHT, 6: Image.Transpose.ROTATE_90, 8: Image.Transpose.ROTATE_270}


def _field(rng, width: int, height: int, cells: int, amplitude: float) -> np.ndarray:
    """Smooth random (height, width, 3) variation: a coarse random grid, bicubic-enlarged."""
    gw, gh = max(2, cells), max(2, cells * height // max(width, 1))
    grid = rng.uniform(-amplitude, amplitude, (gh, gw, 3)).astype(np.float32)
    channels = [
        np.asarray(Image.fromarray(grid[..., c], "F").resize((width, height), Image.Resampling.BICUBIC))
        for c in range(3)
    ]
    return np.stack(channels, -1)


def camera_photo(width: int, height: int, seed: int = 0, noise: float = 4.0) -> Image.Image:
    """An upright RGB picture: light and colour fields, shapes with hard edges, texture, noise."""
    rng = np.random.default_rng(seed)
    base = Image.fromarray(np.clip(128 + _field(rng, width, height, 6, 90), 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(base)
    for _ in range(40):  # objects: hard edges at every angle and scale
        x, y = rng.integers(0, width), rng.integers(0, height)
        r = int(rng.integers(max(4, width // 80), max(8, width // 6)))
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        if rng.random() < 0.5:
            draw.ellipse((x - r, y - r, x + r, y + r // 2), fill=colour)
        else:
            draw.polygon([(x, y), (x + r, y + r // 3), (x + r // 2, y + r)], fill=colour)
    pixels = np.asarray(base, dtype=np.float32)
    pixels += _field(rng, width, height, max(8, width // 24), 14)  # texture: foliage, fabric, walls
    pixels += rng.normal(0, noise, (height, width, 1)).astype(np.float32)  # sensor noise: luma
    pixels += rng.normal(0, noise / 2, (height, width, 3)).astype(np.float32)  # ... and some chroma
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def save_photo(image: Image.Image, path: Path, orientation: int = 1, quality: int = 90, **save) -> Path:
    """Save `image` so that it displays upright under EXIF `orientation` (the pixels stored turned)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    stored = image.transpose(STORED[orientation]) if orientation in STORED else image
    exif = Image.Exif()
    if orientation != 1:
        exif[ORIENTATION] = orientation
    if path.suffix.lower() in (".jpg", ".jpeg"):
        save = {"quality": quality, "subsampling": "4:2:0", **save}
    elif path.suffix.lower() == ".heic":
        save = {"quality": quality, **save}
    stored.save(path, exif=exif.tobytes(), **save)
    return path
