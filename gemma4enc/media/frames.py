"""What decoding a file gives (`Frames`) and how it fails: a `DecodeError` with a status (the
manifest's error class) and a message naming the reason; `guard` turns the libraries' own
exceptions into one, so nothing else leaves the decoders."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..rows import Status


class DecodeError(Exception):
    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status  # e.g. "decode_error", "unsupported", "too_large", "empty"


@dataclass
class Frames:
    """What decoding one file gives: one image, or a video's sampled frames."""

    images: list  # PIL RGB images or (H, W, 3) uint8 arrays, in rising frame order
    indices: list[int] = field(
        default_factory=lambda: [0]
    )  # frame numbers in the source (presentation order)
    timestamps: list[float] = field(default_factory=lambda: [0.0])  # seconds from the stream start
    info: dict = field(default_factory=dict)  # width, height, fps, total_frames, backend, …


def same(frame):
    return frame


def guard(fn, *args):
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
        raise DecodeError(
            Status.DECODE_ERROR, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        ) from None
