"""Images and frames → Gemma 4 patches, exactly as `Gemma4ImageProcessorPil` makes them, or
(--resize torchvision) as the torchvision-backend processors do.

We keep pixels as uint8 (4× smaller than the processor's float32 on the way to the device)
and no padding rows; the tower scales them to [0, 1] with the processor's own rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from ..options import SOFT_TOKEN_BUDGETS

PATCH = 16  # pixels per patch side
POOL = 3  # k: k×k patches pool into one soft token

# How a processor turns a uint8 pixel into float32 (the tower's table for it, model/tower.py):
# x / 255 correctly rounded: the PIL processor (float64 then rounded) and the torchvision video
# processor (fused rescale and normalize: a float32 division); x · float32(1/255): the
# torchvision image processor (`image * rescale_factor`), 1 ulp off on 126 of the 256 values.
DIVIDE, MULTIPLY = 0, 1


@dataclass(frozen=True)
class Patches:
    pixels: np.ndarray  # (n, 16*16*3) uint8: channels-last inside a patch, patches row-major
    positions: np.ndarray  # (n, 2) int64: (x, y) = (column, row) of each patch
    unit: int = DIVIDE  # how the processor scales the pixels to [0, 1]: DIVIDE or MULTIPLY

    @property
    def n(self) -> int:
        return self.pixels.shape[0]

    @property
    def soft_tokens(self) -> int:
        return self.n // (POOL * POOL)


def target_size(height: int, width: int, max_soft_tokens: int) -> tuple[int, int]:
    """The processor's aspect-preserving size: sides multiples of 48 px, ≤ budget×9 patches.

    Our own statement of Gemma4ImageProcessorPil's rule (tests/test_patches.py holds it equal
    to transformers' function), so decode workers need not import transformers (and torch).
    The float operations are the processor's, in its order, so rounding at a multiple of 48
    falls the same way.
    """
    if max_soft_tokens not in SOFT_TOKEN_BUDGETS:
        raise ValueError(f"max_soft_tokens must be one of {SOFT_TOKEN_BUDGETS}, got {max_soft_tokens}")
    side = PATCH * POOL  # both sides are whole pooling cells
    pixels = max_soft_tokens * POOL * POOL * PATCH * PATCH  # the budget, in pixels
    scale = math.sqrt(pixels / (height * width))  # the same area, the same aspect
    h = int(math.floor(scale * height / side)) * side
    w = int(math.floor(scale * width / side)) * side
    if h == 0 and w == 0:
        raise ValueError(f"cannot resize {height}x{width} to a whole number of {side}-pixel cells")
    longest = max_soft_tokens * side  # a one-cell-thin sliver holds the whole budget along its length
    if h == 0:  # a very wide strip: one cell tall, as long as its aspect allows
        h, w = side, min(int(math.floor(width / height)) * side, longest)
    elif w == 0:
        w, h = side, min(int(math.floor(height / width)) * side, longest)
    if h * w > pixels:
        raise ValueError(f"resizing {height}x{width} to {h}x{w} exceeds {max_soft_tokens} soft tokens")
    return h, w


@dataclass(frozen=True)
class Fitted:
    """An image the decoder already brought to the target size of a larger original (--resize fast).

    The target depends on the original's size, not on the fitted image's (the rule is not
    idempotent), so the original's upright size travels with it.
    """

    image: Image.Image  # RGB, upright
    height: int  # of the original, upright
    width: int


def patchify(
    image: Image.Image | np.ndarray | Fitted, max_soft_tokens: int, resize: str = "pil", unit: int = DIVIDE
) -> Patches:
    """Resize (bicubic, up or down, as the processor does) and cut into 16×16 patches.

    resize: "pil" (Pillow's bicubic, Gemma4ImageProcessorPil's) or "torchvision" (torch's
    antialiased bicubic on uint8, the torchvision-backend processors'); unit: see DIVIDE.
    """
    if resize == "torchvision":
        return _patchify_torch(image, max_soft_tokens, unit)
    if isinstance(image, np.ndarray):
        image = Image.fromarray(image)  # (H, W, 3) uint8 frames from the video decoders
    size = (image.height, image.width)
    if isinstance(image, Fitted):
        image = image.image
    if image.mode != "RGB":
        raise ValueError(f"patchify needs an RGB image, got mode {image.mode}")
    h, w = target_size(*size, max_soft_tokens)
    if (h, w) != (image.height, image.width):
        image = image.resize((w, h), resample=Image.Resampling.BICUBIC)
    return _cut(np.asarray(image, dtype=np.uint8), unit)


def _patchify_torch(image: Image.Image | np.ndarray, max_soft_tokens: int, unit: int) -> Patches:
    from .torchresize import resize

    if isinstance(image, Fitted):
        raise ValueError("--resize torchvision resizes the full-size image: it takes no pre-fitted one")
    if isinstance(image, Image.Image):
        if image.mode != "RGB":
            raise ValueError(f"patchify needs an RGB image, got mode {image.mode}")
        image = np.asarray(image, dtype=np.uint8)
    h, w = target_size(image.shape[0], image.shape[1], max_soft_tokens)
    return _cut(resize(image, h, w), unit)


def _cut(array: np.ndarray, unit: int) -> Patches:
    """(h, w, 3) uint8 at the target size → patches, row-major, channels-last inside each."""
    h, w = array.shape[:2]
    ph, pw = h // PATCH, w // PATCH
    pixels = array.reshape(ph, PATCH, pw, PATCH, 3).transpose(0, 2, 1, 3, 4)  # (ph, pw, 16, 16, 3)
    pixels = np.ascontiguousarray(pixels.reshape(ph * pw, PATCH * PATCH * 3))  # (n, 768)
    xs, ys = np.meshgrid(np.arange(pw), np.arange(ph), indexing="xy")
    positions = np.stack([xs, ys], axis=-1).reshape(ph * pw, 2).astype(np.int64)  # (n, 2)
    return Patches(pixels=pixels, positions=positions, unit=unit)
