"""Images → RGB pixels with Pillow: every mode to RGB, EXIF orientation, HEIF registered on first use,
Pillow's decompression-bomb limit per call; with --resize fast, decoded at the smallest scale
that holds the target size (JPEG's DCT scaling, else a box pre-shrink)."""

from __future__ import annotations

import contextlib
import functools

import numpy as np
from PIL import Image, ImageFile, ImageOps

from ..rows import Status
from .formats import claimed, open_image
from .frames import DecodeError, Frames
from .kinds import SNIFF_BYTES, sniff
from .patches import Fitted, target_size


def to_rgb(image: Image.Image) -> Image.Image:
    """Every Pillow mode to RGB on purpose: 16-bit scaled, alpha composited on white."""
    mode = image.mode
    if mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        top = 65535.0 if mode.startswith("I;16") or _extrema(image)[1] > 255 else 255.0
        key = image.info.get("transparency")  # a 16-bit grey PNG's tRNS: that value is transparent

        def grey(raw):
            array = np.clip(raw * (255.0 / top), 0, 255).round().astype(np.uint8)
            if isinstance(key, int):
                array[raw == key] = 255  # on white
            return array

        return _banded(image, grey).convert("RGB")
    if mode == "F":
        lo, hi = _extrema(image)
        scale = 255.0 / (hi - lo) if hi > lo else 0.0
        return _banded(image, lambda array: ((array - lo) * scale).astype(np.uint8)).convert("RGB")
    # transformers' convert_to_rgb: an alpha band, or a colour key (a PNG's tRNS on RGB, grey or a
    # palette: info["transparency"]), makes RGBA, composited on white; "La"/"RGBa" carry neither
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, image.convert("RGBA")).convert("RGB")
    return image.convert("RGB") if mode != "RGB" else image


# 16-bit and float images are scaled in float64 a band of rows at a time: whole, an 88 M-pixel
# 16-bit PNG held ~2.4 GB of float64 temporaries (issue 44); banded, its decode holds the image,
# its 8-bit copy and one band (BAND_PIXELS float64s, a few times over)
BAND_PIXELS = 1 << 20


def _bands(image: Image.Image):
    rows = max(1, BAND_PIXELS // max(1, image.width))
    for top in range(0, image.height, rows):
        yield top, np.asarray(image.crop((0, top, image.width, min(image.height, top + rows))), dtype=np.float64)


def _extrema(image: Image.Image) -> tuple[float, float]:
    """(min, max) over the image's values, NaN left out, a band at a time."""
    lo, hi = np.inf, -np.inf
    for _, band in _bands(image):
        if band.size and not np.isnan(band).all():
            lo, hi = min(lo, float(np.nanmin(band))), max(hi, float(np.nanmax(band)))
    return (lo, hi) if lo <= hi else (np.nan, np.nan)


def _banded(image: Image.Image, convert) -> Image.Image:
    """An "L" image whose rows are convert(float64 band) of `image`'s, made a band at a time."""
    out = np.empty((image.height, image.width), np.uint8)
    for top, band in _bands(image):
        out[top : top + len(band)] = convert(band)
    return Image.fromarray(out, "L")


@functools.cache
def register_heif() -> None:
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
    register_heif()
    try:
        with _pillow_limits():
            with open_image(path) as image:
                width, height = image.size  # from the header: nothing decoded yet
                if max_pixels and width * height > max_pixels:
                    raise DecodeError(
                        Status.TOO_LARGE,
                        f"{width}×{height} = {width * height:,} pixels, more than --max-image-pixels "
                        f"{max_pixels:,} (a decompression bomb?); raise --max-image-pixels to allow it",
                    )
                # PSD's "frames" are its layers, and a bad layer table must not cost the composite
                frames = 1 if image.format == "PSD" else getattr(image, "n_frames", 1)
                # as opened: the first frame, HEIF's primary image (a burst's or a collection's chosen
                # one, not always its first), or PSD's composite, which numbers its layers from 1
                first = getattr(image, "_min_frame", 0)
                if image.format == "PSD" and image.tell() != first:
                    image.seek(first)
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
                head = f.read(HEADER_BYTES)
        else:  # a file object (a URL's, a tar member's)
            path.seek(0)
            head = path.read(HEADER_BYTES)
        bits = jpeg_precision(head)
        if bits not in (None, 8):  # valid, but not what this Pillow build decodes: not "corrupt"
            raise DecodeError(
                Status.UNSUPPORTED, f"a {bits}-bit JPEG: Pillow's libjpeg decodes 8-bit JPEGs only"
            ) from None
        extent = avif_extent(head)
        if extent and extent[0] * extent[1] > AVIF_PIXELS:  # valid, past what libavif decodes
            raise DecodeError(
                Status.UNSUPPORTED,
                f"an AVIF of {extent[0]}×{extent[1]}: more pixels than libavif decodes (16384×16384)",
            ) from None
        head = head[:SNIFF_BYTES]
        if sniff(head) == "image" or claimed(head[:16]):  # 16: the bytes Pillow's checks see
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


HEADER_BYTES = 1 << 16  # where a JPEG's frame header is looked for (EXIF and ICC segments come first)


AVIF_PIXELS = 16384 * 16384  # libavif's default image size limit (AVIF_DEFAULT_IMAGE_SIZE_LIMIT)


def avif_extent(head: bytes) -> tuple[int, int] | None:
    """(width, height) an AVIF's first `ispe` property states, or None where `head` is no AVIF
    (its ftyp names no avif/avis brand) or states none."""
    if head[4:8] != b"ftyp":
        return None
    brands = head[8:int.from_bytes(head[:4], "big")]
    if not any(brands[i:i + 4] in (b"avif", b"avis") for i in range(0, len(brands), 4)):
        return None
    at = head.find(b"ispe")
    if at < 4 or at + 16 > len(head):
        return None
    return int.from_bytes(head[at + 8 : at + 12], "big"), int.from_bytes(head[at + 12 : at + 16], "big")


def jpeg_precision(head: bytes) -> int | None:
    """The sample precision of a JPEG's frame header (SOF0-15 but DHT, JPG, DAC), or None where
    `head` is no JPEG or holds no frame header."""
    if head[:2] != b"\xff\xd8":
        return None
    at = 2
    while at + 4 <= len(head) and head[at] == 0xFF:
        marker, length = head[at + 1], int.from_bytes(head[at + 2 : at + 4], "big")
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            return head[at + 4] if at + 4 < len(head) else None
        if marker in (0xD9, 0xDA) or length < 2:
            return None  # end of image, start of scan, or a broken segment: no frame header first
        at += 2 + length
    return None


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
# this many times its target, then bicubic. Photos hold 45 dB at 2×, hard edges do not: real
# bilevel scans fell to 38-44 dB at 2×, 45.7 at 3× and 48.2 at 3.5× after a 4× box
# (docs/benchmarks.md, 2026-12-03 section).
REDUCE_MARGIN = 3.5

# --resize fast, JPEG: decode at 1/s (libjpeg's DCT scaling) only where that is still this many
# times the target on each side. The smaller the scale the cruder its filter, so the more the
# processor's bicubic must shrink after it: at a draft just above the target, real camera photos
# came out at 32-43 dB. Worst of ~140 real camera JPEGs (4:2:2 ones the worst): 1/2 at 2× 45.5 dB,
# at 2.25× 45.7 (so 2.2×, which a 12 MP photo at 280 tokens still meets); 1/4 at 2.75× 45.4 (so
# 3×); 1/8 is taken at 4×, which only images of 150 MP and more reach (docs/benchmarks.md).
DRAFT_MARGIN = {8: 4.0, 4: 3.0, 2: 2.2}


def _draft_scale(size: tuple[int, int], want: tuple[int, int]) -> int:
    """The smallest DCT scale 1/s whose decode (libjpeg rounds its sides up) keeps DRAFT_MARGIN."""
    for s in (8, 4, 2):
        if all(-(-side // s) >= DRAFT_MARGIN[s] * w for side, w in zip(size, want)):
            return s
    return 1


def _fitted(image: Image.Image, budget: int) -> tuple[Fitted, tuple[int, int]]:
    """--resize fast: the image at its target size, decoded at the smallest size that holds it.

    The target comes from the full-size upright dimensions (the header's), so the patch grid is
    the processor's. JPEG: libjpeg's DCT-domain scaling (draft) to the smallest of 1/2, 1/4, 1/8
    that keeps DRAFT_MARGIN, so no full-size buffer exists; else (other formats, and a JPEG no
    scale fits) a box pre-shrink (reduce) within REDUCE_MARGIN. No other format's draft is used:
    pillow-heif's decodes an embedded thumbnail in place of the image. Then the processor's
    bicubic, in the stored orientation (the draft's box is in stored coordinates), and last the
    EXIF turn on the small result.
    Returns the fitted image and the (width, height) actually decoded.
    """
    orientation = image.getexif().get(0x0112, 1)
    turned = orientation in (5, 6, 7, 8)  # these swap width and height
    stored_w, stored_h = image.size
    height, width = (stored_w, stored_h) if turned else (stored_h, stored_w)
    th, tw = target_size(height, width, budget)
    want = (th, tw) if turned else (tw, th)  # the target as stored: (width, height)
    scale = _draft_scale(image.size, want) if image.format in ("JPEG", "MPO") else 1
    # asked for 1/scale of each side, rounded down, Pillow's draft takes exactly that scale
    drafted = image.draft("RGB", (stored_w // scale, stored_h // scale)) if scale > 1 else None
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
