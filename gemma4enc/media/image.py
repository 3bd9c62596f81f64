"""Images → RGB pixels with Pillow: every mode to RGB, EXIF orientation, HEIF registered on first use,
Pillow's decompression-bomb limit per call; with --resize fast, decoded at the smallest scale
that holds the target size (JPEG's DCT scaling, else a box pre-shrink)."""

from __future__ import annotations

import contextlib
import functools

import numpy as np
from PIL import Image, ImageFile, ImageOps

from ..rows import Status
from .frames import DecodeError, Frames
from .kinds import SNIFF_BYTES, sniff
from .patches import Fitted, target_size


def to_rgb(image: Image.Image) -> Image.Image:
    """Every Pillow mode to RGB on purpose: 16-bit scaled, alpha composited on white."""
    mode = image.mode
    if mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        array = np.asarray(image, dtype=np.float64)
        top = 65535.0 if mode.startswith("I;16") or array.max() > 255 else 255.0
        array = np.clip(array * (255.0 / top), 0, 255).round().astype(np.uint8)
        return Image.fromarray(array, "L").convert("RGB")
    if mode == "F":
        array = np.asarray(image, dtype=np.float64)
        lo, hi = float(np.nanmin(array)), float(np.nanmax(array))
        scale = 255.0 / (hi - lo) if hi > lo else 0.0
        return Image.fromarray(((array - lo) * scale).astype(np.uint8), "L").convert("RGB")
    if mode == "P" and "transparency" in image.info or mode in ("LA", "PA", "La", "RGBa"):
        image = image.convert("RGBA")
        mode = "RGBA"
    if mode == "RGBA":
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, image).convert("RGB")
    return image.convert("RGB") if mode != "RGB" else image


@functools.cache
def _register_heif() -> None:
    """HEIC/HEIF support, added to Pillow at the first image we decode (not at import)."""
    try:
        from pillow_heif import register_heif_opener

        register_heif_opener()
    except ImportError:  # HEIC files then get an `unsupported` row
        pass


@contextlib.contextmanager
def _pillow_limits():
    """Pillow's bomb check off (ours is made on the full-size header, in the user's figure: Pillow's
    error quotes twice its limit) and truncated files errors, for this decode only: the process's
    own settings are put back, so a library user's stay theirs."""
    saved = Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES
    Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES = (
        None,
        False,
    )  # truncated: not a grey patch
    try:
        yield
    finally:
        Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES = saved


def decode_image(path: str, max_pixels: int | None, fit: int | None = None) -> Frames:
    """First frame of the file, EXIF-oriented, as RGB; bombs and truncation are errors.

    fit: a soft-token budget (--resize fast): decode no more pixels than its target size
    needs and return the image already resized to it, as a `Fitted`. None (--resize exact):
    the full-size image, which patchify resizes exactly as the processor does.
    """
    _register_heif()
    try:
        with _pillow_limits():
            with Image.open(path) as image:
                width, height = image.size  # from the header: nothing decoded yet
                if max_pixels and width * height > max_pixels:
                    raise DecodeError(
                        Status.TOO_LARGE,
                        f"{width}×{height} = {width * height:,} pixels, more than --max-image-pixels "
                        f"{max_pixels:,} (a decompression bomb?); raise --max-image-pixels to allow it",
                    )
                frames = getattr(image, "n_frames", 1)
                image.seek(0)
                if fit is None:
                    image.load()  # lazy open: a truncated file fails here, inside the try
                    rgb = to_rgb(ImageOps.exif_transpose(image))
                    decoded = rgb.size
                else:
                    fast = _heic(path, image, fit) if image.format == "HEIF" else None
                    rgb, decoded = fast or _fitted(image, fit)
    except Image.UnidentifiedImageError:
        if isinstance(path, str):
            with open(path, "rb") as f:
                looks_like_image = sniff(f.read(SNIFF_BYTES)) == "image"
        else:  # a file object (a URL's, a tar member's)
            path.seek(0)
            looks_like_image = sniff(path.read(SNIFF_BYTES)) == "image"
        if looks_like_image:
            raise DecodeError(Status.DECODE_ERROR, "corrupt image: its header is unreadable") from None
        raise DecodeError(
            Status.UNSUPPORTED, "the content is not an image format Pillow reads"
        ) from None
    except (FileNotFoundError, PermissionError):
        raise  # the caller says these in its own words
    except (OSError, SyntaxError, ValueError, EOFError) as e:  # truncated, corrupt, bad header
        raise DecodeError(Status.DECODE_ERROR, f"{type(e).__name__}: {e}") from None
    info = {"width": rgb.width, "height": rgb.height, "source_frames": frames, "decoded": list(decoded)}
    if fit is not None and fast:
        info["backend"] = "pyav"  # FFmpeg's HEVC decoder, not libheif's
    return Frames(images=[rgb], info=info)


def _heic(path, image: Image.Image, budget: int) -> tuple[Fitted, tuple[int, int]] | None:
    """--resize fast, HEIC: the tiles through FFmpeg's HEVC decoder (media/heic.py), turned by
    the EXIF orientation as _fitted does; None (pillow-heif decodes then) for anything it does
    not take or any failure: a file libheif can read is never lost to this shortcut."""
    try:
        from . import heic

        if isinstance(path, str):
            with open(path, "rb") as f:
                data = f.read()
        else:
            path.seek(0)
            data = path.read()
            path.seek(0)
        got = heic.fitted(data, image, budget)
    except Exception:  # noqa: BLE001 - every failure falls back to libheif, which says its own
        return None
    if got is None:
        return None
    rgb, orientation, (height, width), decoded = got
    if orientation in UPRIGHT:
        rgb = rgb.transpose(UPRIGHT[orientation])
    return Fitted(rgb, height, width), decoded


# EXIF orientation -> the transpose that turns the stored pixels upright (as ImageOps.exif_transpose)
UPRIGHT = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


# --resize fast, formats without a reduced decode: box-shrink by k only while the image stays
# this many times its target, then bicubic: a smaller margin let the box's blur through and fell
# towards the 45 dB floor (benchmarks/decode.py on 12 MP photos; figures in docs/benchmarks/decode.md).
REDUCE_MARGIN = 2.0


def _fitted(image: Image.Image, budget: int) -> tuple[Fitted, tuple[int, int]]:
    """--resize fast: the image at its target size, decoded at the smallest size that holds it.

    The target comes from the full-size upright dimensions (the header's), so the patch grid is
    the processor's. JPEG: libjpeg's DCT-domain scaling (draft) to the smallest of 1/2, 1/4, 1/8
    still at least the target, so no full-size buffer exists; other formats: a box pre-shrink
    (reduce) within REDUCE_MARGIN. Then the processor's bicubic, in the stored orientation (the
    draft's box is in stored coordinates), and last the EXIF turn on the small result.
    Returns the fitted image and the (width, height) actually decoded.
    """
    orientation = image.getexif().get(0x0112, 1)
    turned = orientation in (5, 6, 7, 8)  # these swap width and height
    stored_w, stored_h = image.size
    height, width = (stored_w, stored_h) if turned else (stored_h, stored_w)
    th, tw = target_size(height, width, budget)
    want = (th, tw) if turned else (tw, th)  # the target as stored: (width, height)
    drafted = image.draft("RGB", want)  # JPEG only (None elsewhere); picks a scale ≥ want
    image.load()  # lazy open: a truncated file fails here, inside the caller's try
    if orientation != 1 and image.getexif().get(0x0112, 1) == 1:  # the loader turned it itself (TIFF)
        orientation, (width, height) = 1, image.size  # so it is upright, full size: no draft here
        th, tw = target_size(height, width, budget)
        want, stored_w, stored_h = (tw, th), width, height
    decoded = image.size
    box = drafted[1] if drafted else (0, 0, stored_w, stored_h)
    rgb = to_rgb(image)
    k = int(min(rgb.width / (REDUCE_MARGIN * want[0]), rgb.height / (REDUCE_MARGIN * want[1])))
    if not drafted and k >= 2:
        rgb = rgb.reduce(k)
        box = (0, 0, stored_w / k, stored_h / k)
    if rgb.size != want or box != (0, 0, *rgb.size):
        rgb = rgb.resize(want, resample=Image.Resampling.BICUBIC, box=box)
    if orientation in UPRIGHT:
        rgb = rgb.transpose(UPRIGHT[orientation])
    return Fitted(rgb, height, width), decoded
