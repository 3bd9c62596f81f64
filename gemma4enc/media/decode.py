"""Files → RGB pixels: images with Pillow, videos as sampled frames with decord or PyAV.

Every failure here is a `DecodeError` with a status (the manifest's error class) and a
message naming the reason; callers record it and go on.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import warnings
from collections import deque
from dataclasses import dataclass, field

import numpy as np
from PIL import Image, ImageFile, ImageOps

from ..options import Sampling
from ..rows import Status
from .discover import SNIFF_BYTES, sniff
from .patches import Fitted, target_size


class DecodeError(Exception):
    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status  # e.g. "decode_error", "unsupported", "too_large", "empty"


@dataclass
class Frames:
    """What decoding one file gives: one image, or a video's sampled frames."""

    images: list  # PIL RGB images or (H, W, 3) uint8 arrays, in rising frame order
    indices: list[int] = field(default_factory=lambda: [0])  # frame numbers in the source (presentation order)
    timestamps: list[float] = field(default_factory=lambda: [0.0])  # seconds from the stream start
    info: dict = field(default_factory=dict)  # width, height, fps, total_frames, backend, …


# ---- images ---------------------------------------------------------------------------------


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
def _pillow_limits(max_pixels: int | None):
    """Pillow's bomb limit ours (checked on the full-size header) and truncated files errors, for
    this decode only: the process's own settings are put back, so a library user's stay theirs."""
    saved = Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES
    Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES = max_pixels, False  # truncated: not a grey patch
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
        with warnings.catch_warnings(), _pillow_limits(max_pixels):
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as image:
                frames = getattr(image, "n_frames", 1)
                image.seek(0)
                if fit is None:
                    image.load()  # lazy open: a truncated file fails here, inside the try
                    rgb = to_rgb(ImageOps.exif_transpose(image))
                    decoded = rgb.size
                else:
                    rgb, decoded = _fitted(image, fit)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise DecodeError(Status.TOO_LARGE, f"{e} (raise --max-image-pixels to allow it)") from None
    except Image.UnidentifiedImageError:
        if isinstance(path, str):
            with open(path, "rb") as f:
                looks_like_image = sniff(f.read(SNIFF_BYTES)) == "image"
        else:  # a file object (a URL's, a tar member's)
            path.seek(0)
            looks_like_image = sniff(path.read(SNIFF_BYTES)) == "image"
        if looks_like_image:
            raise DecodeError(Status.DECODE_ERROR, "corrupt image: its header is unreadable") from None
        raise DecodeError(Status.UNSUPPORTED, "the content is not an image format Pillow reads") from None
    except (FileNotFoundError, PermissionError):
        raise  # the caller says these in its own words
    except (OSError, SyntaxError, ValueError, EOFError) as e:  # truncated, corrupt, bad header
        raise DecodeError(Status.DECODE_ERROR, f"{type(e).__name__}: {e}") from None
    info = {"width": rgb.width, "height": rgb.height, "source_frames": frames, "decoded": list(decoded)}
    return Frames(images=[rgb], info=info)


# EXIF orientation -> the transpose that turns the stored pixels upright (as ImageOps.exif_transpose)
UPRIGHT = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
           5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
           8: Image.Transpose.ROTATE_90}
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


# ---- videos ---------------------------------------------------------------------------------


def _same(frame):
    return frame


# --resize fast, videos: a frame is box-averaged by a whole factor first while the processor's
# bicubic that follows still shrinks it by at least this much; below it the box's blur shows and
# the frame falls under the 45 dB floor (benchmarks/video_decode.py; docs/benchmarks/video.md)
PREFIT_GAP = 1.8


def prefit(frame: np.ndarray, max_soft_tokens: int) -> np.ndarray:
    """(H, W, 3) frame → the same frame box-reduced where that keeps the fidelity floor and the patch grid."""
    h, w = frame.shape[:2]
    th, tw = target_size(h, w, max_soft_tokens)
    k = int(min(h / th, w / tw) // PREFIT_GAP)
    if k < 2 or h % k or w % k or target_size(h // k, w // k, max_soft_tokens) != (th, tw):
        return frame  # the grid is computed from the size it gets: reduce only where it is the same
    return np.asarray(Image.fromarray(frame).reduce(k))


def _apply_rotation(array: np.ndarray, degrees: int) -> np.ndarray:
    """PyAV reports a display rotation (counter-clockwise degrees) that it does not apply."""
    turns = (int(degrees) // 90) % 4
    return np.ascontiguousarray(np.rot90(array, k=turns)) if turns else array


def decode_video_pyav(path: str, sampling: Sampling, transform=_same, seek: str = "exact") -> Frames:
    """Index the stream by demuxing, then decode forward, seeking only past keyframes.

    Frame n is the n-th frame in presentation (pts) order. Packets are decoded one by one so
    a corrupt packet loses its frames, not the rest of the file. seek="keyframe": each sample
    moves to the nearest keyframe, and only keyframes are decoded.
    """
    import av

    with av.open(path) as container:
        if not container.streams.video:
            raise DecodeError(Status.NO_VIDEO_STREAM, "the file has no video stream")
        stream = container.streams.video[0]
        stream.thread_count = THREADS  # 1: workers decode in parallel, threads inside them only contend
        if THREADS > 1:  # the tail of a run: cores are idle (workers.py sets THREADS)
            stream.thread_type = "AUTO"
        pts, keyframes = [], []
        for packet in container.demux(stream):
            if packet.pts is not None and packet.size:
                pts.append(packet.pts)
                if packet.is_keyframe:
                    keyframes.append(packet.pts)
        if not pts:
            raise DecodeError(Status.EMPTY, "the video stream has no frames")
        order = np.array(sorted(pts))
        base = stream.start_time if stream.start_time is not None else int(order[0])
        times = (order - base) * float(stream.time_base)
        keyframes = sorted(keyframes)
        wanted = sampling.indices(len(order), times)
        if seek == "keyframe":
            wanted = snap_to_keyframes(wanted, np.searchsorted(order, keyframes).tolist())
        size: list[tuple[int, int]] = []
        got = _pyav_frames(container, stream, order, keyframes, wanted, transform, size, seek == "keyframe")
    if not got:
        raise DecodeError(Status.DECODE_ERROR, "no sampled frame could be decoded")
    indices = sorted(got)
    info = {"backend": "pyav", "codec": stream.codec_context.name, "total_frames": len(order),
            "fps": float(stream.average_rate or 0), "duration": float(times[-1]),
            "missing_frames": len(wanted) - len(indices), "height": size[0][0], "width": size[0][1]}
    return Frames(images=[got[i] for i in indices], indices=indices,
                  timestamps=[round(float(times[i]), 6) for i in indices], info=info)


def _pyav_frames(container, stream, order, keyframes, wanted, transform, size, keys_only=False) -> dict[int, object]:
    """Frame number -> transform(RGB array) for each wanted frame that decodes; size gets (h, w).

    keys_only: every wanted frame is a keyframe, so every other packet may be skipped.
    """
    index_of = {int(p): i for i, p in enumerate(order)}
    pending = deque(int(order[i]) for i in wanted)  # target pts, rising
    targets = set(pending)
    skip = None
    if keys_only or stream.codec_context.name in SKIPS_NONREF:
        skip = (lambda packet: packet.pts not in targets)
    skip_mode = "NONKEY" if keys_only else "NONREF"
    got: dict[int, np.ndarray] = {}
    frames, position = None, None  # the decoding run in progress and the pts it reached
    while pending:
        key = _keyframe_before(keyframes, pending[0])
        if frames is None or key > position:  # next target lies past the next keyframe: seek
            container.seek(key, stream=stream, backward=True)
            frames = _decoded(container, stream, skip, skip_mode)
        for frame in frames:
            position = frame.pts
            while pending and pending[0] < position:  # its packet was corrupt: lost
                pending.popleft()
            if pending and pending[0] == position:
                rgb = _apply_rotation(frame.to_ndarray(format="rgb24"), frame.rotation)
                size.append(rgb.shape[:2])
                got[index_of[position]] = transform(rgb)  # one full-size frame in memory at a time
                pending.popleft()
            if not pending or _keyframe_before(keyframes, pending[0]) > position:
                break
        else:
            break  # end of stream: the rest cannot be found
    return got


def snap_to_keyframes(wanted: list[int], keys: list[int]) -> list[int]:
    """Each frame index moved to the nearest keyframe index (the earlier on a tie), once each."""
    if not keys:
        return wanted
    snapped = set()
    for i in wanted:
        at = bisect.bisect_right(keys, i)
        before, after = keys[max(at - 1, 0)], keys[min(at, len(keys) - 1)]
        snapped.add(before if i - before <= after - i else after)
    return sorted(snapped)


def _keyframe_before(keyframes: list[int], pts: int) -> int:
    i = bisect.bisect_right(keyframes, pts) - 1
    return keyframes[max(i, 0)] if keyframes else pts


def _decoded(container, stream, skip=None, skip_mode="NONREF"):
    """Frames in presentation order, packet by packet, skipping packets that fail to decode.

    `skip(packet)` True: its frame is not wanted, so the decoder may drop it unless another
    frame refers to it (skip_frame NONREF); the wanted ones and every reference still decode,
    so each frame that comes out is exactly the one a full decode gives. NONKEY drops every
    frame but keyframes: for when only keyframes are wanted.
    """
    import av

    context = stream.codec_context
    for packet in container.demux(stream):
        if skip is not None:
            context.skip_frame = skip_mode if packet.pts is not None and skip(packet) else "DEFAULT"
        try:
            frames = packet.decode()
        except av.error.InvalidDataError:
            continue
        for frame in frames:
            if frame.pts is not None:
                yield frame


def decode_video_decord(path: str, sampling: Sampling, transform=_same, seek: str = "exact") -> Frames:
    import decord

    decord.logging.set_level(decord.logging.QUIET)
    try:
        reader = decord.VideoReader(path, ctx=decord.cpu(0), num_threads=THREADS)
    except (RuntimeError, decord.DECORDError) as e:
        raise DecodeError(Status.DECODE_ERROR, f"decord: {str(e).splitlines()[0][:200]}") from None
    total = len(reader)
    if total == 0:
        raise DecodeError(Status.EMPTY, "the video stream has no frames")
    times = reader.get_frame_timestamp(np.arange(total))[:, 0]
    wanted = sampling.indices(total, times)
    if seek == "keyframe":
        wanted = snap_to_keyframes(wanted, sorted(int(k) for k in reader.get_key_indices()))
    images = []
    for at in range(0, len(wanted), DECORD_CHUNK):
        try:
            batch = reader.get_batch(wanted[at: at + DECORD_CHUNK]).asnumpy()  # (F, H, W, 3) uint8
        except (RuntimeError, decord.DECORDError) as e:
            raise DecodeError(Status.DECODE_ERROR, f"decord: {str(e).splitlines()[0][:200]}") from None
        if batch.ndim != 4 or batch.shape[-1] != 3:  # seen with rotated clips: let PyAV do it
            raise DecodeError(Status.DECODE_ERROR, f"decord returned frames shaped {batch.shape}")
        images += [transform(frame) for frame in batch]
    info = {"backend": "decord", "total_frames": total, "fps": float(reader.get_avg_fps()),
            "duration": float(times[-1]), "height": int(batch.shape[1]), "width": int(batch.shape[2])}
    return Frames(images=images, indices=list(wanted), timestamps=[round(float(times[i]), 6) for i in wanted],
                  info=info)


def _probe(path: str, max_pixels: int | None) -> str | None:
    """The video codec, from the header; frames larger than max_pixels are refused before decoding."""
    import av

    try:
        with av.open(path) as container:
            if not container.streams.video:
                raise DecodeError(Status.NO_VIDEO_STREAM, "the file has no video stream")
            stream = container.streams.video[0]
            pixels = (stream.width or 0) * (stream.height or 0)
            codec = stream.codec_context.name
    except av.error.FFmpegError as e:
        raise DecodeError(Status.DECODE_ERROR, f"cannot open: {e}") from None
    if max_pixels and pixels > max_pixels:
        raise DecodeError(Status.TOO_LARGE, f"frames of {stream.width}×{stream.height} exceed {max_pixels} pixels "
                                       "(raise --max-image-pixels to allow them)")
    return codec


# decoder threads per video: 1 while every worker is busy; the pool raises it for a run's last
# files, when fewer files than workers remain and their cores would idle
THREADS = 1

# decoders whose packets carry their frame's pts and that drop non-reference frames on request
SKIPS_NONREF = {"h264", "hevc"}

DECORD_CHUNK = 4  # frames fetched per get_batch call: memory holds a few full-size frames, not 32

# decord returns off-by-one frames after seeks in HEVC (open GOP): PyAV is exact there
DECORD_INEXACT = {"hevc", "h265"}


def decode_video(path: str, sampling: Sampling, backend: str = "auto", max_pixels: int | None = None,
                 transform=_same, seek: str = "exact") -> Frames:
    """--video-backend auto|decord|pyav; auto takes PyAV, and decord where PyAV cannot read a file.

    PyAV first: it skips the frames no sample needs (SKIPS_NONREF), which decord cannot, is exact
    on open-GOP HEVC, and its RGB frames equal decord's bit for bit (same FFmpeg conversion).
    `transform` is applied to each frame as it is decoded (the pipeline passes patchify), so
    only a few full-size frames are ever held at once. seek="keyframe" (--seek): each sample
    snapped to the nearest keyframe; `indices` says which frames were taken.
    """
    codec = _guard(_probe, path, max_pixels)
    if not isinstance(path, str):  # a file object (a URL's, a tar member's): PyAV reads it, decord takes names
        path.seek(0)
        return _guard(decode_video_pyav, path, sampling, transform, seek)
    if backend == "decord":
        return _guard(decode_video_decord, path, sampling, transform, seek)
    try:
        return _guard(decode_video_pyav, path, sampling, transform, seek)
    except DecodeError as first:
        if backend == "pyav" or codec in DECORD_INEXACT:
            raise
        try:
            return _guard(decode_video_decord, path, sampling, transform, seek)
        except DecodeError:
            raise first from None


def _guard(fn, *args):
    """Library exceptions → DecodeError, so nothing but DecodeError leaves this module."""
    import av

    try:
        return fn(*args)
    except DecodeError:
        raise
    except av.error.FFmpegError as e:
        raise DecodeError(Status.DECODE_ERROR, f"pyav: {e}") from None
    except ImportError as e:  # decord has no wheel for every platform: auto then goes on with PyAV
        raise DecodeError(Status.DECODE_ERROR, f"{e.name or e} is not installed") from None
    except (RuntimeError, ValueError, OSError, IndexError) as e:
        raise DecodeError(Status.DECODE_ERROR, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}") from None


def decode(path: str, kind: str, sampling: Sampling, backend: str = "auto", max_pixels: int | None = None,
           transform=_same, fit: int | None = None, seek: str = "exact") -> Frames:
    """One file's frames, each passed through `transform` as soon as it is decoded.

    fit: images only, the soft-token budget to decode straight to (--resize fast; see decode_image).
    seek: videos, exact (every sample as asked) or keyframe (each snapped to the nearest keyframe).
    """
    if kind == "image":
        frames = decode_image(path, max_pixels, fit)
        frames.images = [transform(image) for image in frames.images]
        return frames
    if kind == "video":
        return decode_video(path, sampling, backend, max_pixels, transform, seek)
    raise DecodeError(Status.UNSUPPORTED, "not an image or video format we know")
