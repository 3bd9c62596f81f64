"""One file made ready for the tower: decoded, patchified, hashed with --hash (`prepare`), or the
reason it cannot be (`Decoded`'s status and error).

This is a worker process's whole job, and the only part of decoding that knows a file's row: every
failure is caught here and kept with its file. It is apart from workers.py, which runs it in
processes, because other callers run it in-process too (`--workers 0`, `bench --e2e`, the tests)
and output/todo.py needs only its hash.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field

from ..options import Options
from ..rows import Status
from . import webdataset
from .decode import DecodeError, decode, prefit
from .frames import Frames
from .kinds import Item
from .patches import DIVIDE, MULTIPLY, Patches, patchify


@dataclass
class Decoded:
    """One file made ready for the tower, or the reason it cannot be (status + error)."""

    item: Item
    patches: list[Patches] = field(default_factory=list)  # one per image / sampled frame
    width: int = 0  # decoded size, after orientation
    height: int = 0
    video: dict = field(default_factory=dict)  # frame_indices, timestamps and stream facts
    sha256: str | None = None
    status: str = Status.OK
    error: str | None = None
    sidecar: dict | None = None  # a tar member's: its sample's .json / .txt (webdataset.sidecars)


REREADS = 2  # --hash: times a local file rewritten while it was read is read again


def prepare(item: Item, options: Options, rereads: int = REREADS) -> Decoded:
    """Decode + patchify one file; every failure is caught and kept with the file.

    With --hash the file is hashed, then decoded: two reads. A local file rewritten between them
    (its ctime moves, whatever its size and mtime say) would pair a hash with other bytes' tokens,
    so it is read again, up to `rereads` times, then given up as unreadable."""
    if item.error:  # discovery could not even look at it, and said why
        return Decoded(item, status=item.status or Status.UNREADABLE, error=item.error)
    if item.kind == "unknown":
        return Decoded(item, status=Status.UNSUPPORTED, error="not an image or video format we know")
    if item.size == 0:
        return Decoded(item, status=Status.EMPTY, error="the file is empty (0 bytes)")
    elsewhere = item.path[:1] != "/" or item.root is not None and item.root.endswith(".tar")
    source = item.path
    try:
        if elsewhere:  # a URL or a tar's member: the decoders read a file object
            source = webdataset.open_source(item.path, item.root, item.rel)
        before = _stamp(item.path) if options.hash and not elsewhere else None
        digest = sha256(item.path, item.root, item.rel) if options.hash else None
        budget = options.image_tokens if item.kind == "image" else options.video_tokens
        shrink = prefit if item.kind == "video" and options.resize == "fast" else lambda image, _: image
        # --resize torchvision: torch's resize, and the image processor's own rescale for images
        resize = "torchvision" if options.resize == "torchvision" else "pil"
        unit = MULTIPLY if resize == "torchvision" and item.kind == "image" else DIVIDE
        frames = decode(
            source,
            item.kind,
            options.sampling,
            options.video_backend,
            options.max_image_pixels,
            transform=lambda image: patchify(shrink(image, budget), budget, resize, unit),
            fit=budget if options.resize == "fast" else None,
            seek=options.seek,
        )
        video = _video_facts(frames) if item.kind == "video" else {}
        if before is not None and _stamp(item.path) != before:  # rewritten while it was read
            if rereads > 0:
                return prepare(item, options, rereads - 1)
            return Decoded(
                item,
                status=Status.UNREADABLE,
                error="the file kept changing while it was read (its hash and its tokens would differ)",
            )
        sidecar = None
        if elsewhere and webdataset.member_of(item.path, item.root, item.rel):
            sidecar = webdataset.sidecars(item.root, item.rel) or None
        return Decoded(
            item,
            frames.images,
            int(frames.info["width"]),
            int(frames.info["height"]),
            video,
            digest,
            sidecar=sidecar,
        )
    except DecodeError as e:
        if not elsewhere and not os.path.exists(
            item.path
        ):  # decoders word a vanished file as a corrupt one
            return Decoded(
                item, status=Status.NOT_FOUND, error="the file vanished before it was decoded"
            )
        return Decoded(item, status=e.status, error=str(e))
    except FileNotFoundError:
        return Decoded(item, status=Status.NOT_FOUND, error="the file vanished before it was decoded")
    except PermissionError as e:
        return Decoded(item, status=Status.UNREADABLE, error=f"cannot read: {e.strerror or e}")
    except MemoryError:
        return Decoded(item, status=Status.TOO_LARGE, error="decoding it ran out of host memory")
    except Exception as e:  # noqa: BLE001 - a decoder's surprise must cost one file, not the run
        return Decoded(item, status=Status.DECODE_ERROR, error=f"{type(e).__name__}: {str(e)[:300]}")
    finally:
        if source is not item.path:
            source.close()


def _video_facts(frames: Frames) -> dict:
    """What a video's row says besides its tokens: the frames sampled, and what decoding found."""
    video = {
        "frame_indices": frames.indices,
        "timestamps": frames.timestamps,
        **{k: frames.info[k] for k in ("fps", "duration", "total_frames", "backend")
           if k in frames.info},
    }
    if frames.info.get("truncated"):  # a cut file: sampled from the frames it has
        video["truncated"] = True
    if frames.info.get("missing"):  # asked for, not decodable: the row says which
        video["missing_frames"] = frames.info["missing"]
    if frames.info.get("undecodable"):  # a damaged file: numbered by the frames that came out
        video["undecodable_packets"] = frames.info["undecodable"]
    if frames.info.get("frames_asked", 0) > len(frames.indices):  # --seek folded some together
        video["frames_asked"] = frames.info["frames_asked"]
    return video


def _stamp(path: str) -> tuple[int, int, int, int]:
    """What any write to a local file moves: ctime cannot be set back as mtime can (os.utime)."""
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def sha256(path: str, root: str | None = None, rel: str | None = None) -> str:
    source = webdataset.open_source(path, root, rel)
    with source if source is not path else open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
