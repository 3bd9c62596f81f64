"""Files → RGB pixels: a file's kind picks its decoder (image.py: Pillow; video.py: PyAV, decord
where PyAV cannot read a file). Every failure is a `DecodeError` (frames.py) with the manifest's
status and a message naming the reason; callers record it and go on. The names callers use are
here too."""

from __future__ import annotations

from ..options import Sampling
from ..rows import Status
from .frames import DecodeError, Frames, same
from .image import UPRIGHT, decode_image  # noqa: F401 - the decoders' names, for callers
from .video import decode_video, prefit, snap_to_keyframes  # noqa: F401


def decode(
    path: str,
    kind: str,
    sampling: Sampling,
    backend: str = "auto",
    max_pixels: int | None = None,
    transform=same,
    fit: int | None = None,
    seek: str = "exact",
) -> Frames:
    """One file's frames, each passed through `transform` as soon as it is decoded.

    fit: images only, the soft-token budget to decode straight to (--resize fast; see decode_image).
    seek: videos, exact (every sample as asked), keyframe (each snapped to the nearest keyframe) or
    nearest[:SECONDS] (snapped only within the bound, see video.snap_within).
    """
    if kind == "image":
        frames = decode_image(path, max_pixels, fit)
        frames.images = [transform(image) for image in frames.images]
        return frames
    if kind == "video":
        return decode_video(path, sampling, backend, max_pixels, transform, seek)
    raise DecodeError(Status.UNSUPPORTED, "not an image or video format we know")
