"""Videos → sampled RGB frames with PyAV (decord where PyAV cannot read a file): frames no sample
needs are skipped, containers without a keyframe index seek through videoindex, --seek keyframe
and nearest[:SECONDS] snap samples to keyframes, large frames are pre-fitted as they come."""

from __future__ import annotations

import bisect
import math
import struct
from collections import deque

import numpy as np
from PIL import Image

from ..options import Sampling, seek_bound
from ..rows import Status
from . import videoindex
from .frames import DecodeError, Frames, guard, same
from .patches import target_size

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


# the turns of FFmpeg's `transpose` filter on an (H, W, C) array
_TRANSPOSE = {
    "clock": lambda a: np.rot90(a, k=-1),
    "cclock": lambda a: np.rot90(a, k=1),
    "cclock_flip": lambda a: a.transpose(1, 0, 2),  # 90° counter-clockwise, then upside down
    "clock_flip": lambda a: a[::-1, ::-1].transpose(1, 0, 2),  # 90° clockwise, then upside down
}


def display_matrix(frame) -> tuple[int, ...] | None:
    """The frame's display matrix (FFmpeg's 9 int32s, 16.16 fixed point but the last column), or None."""
    for data in getattr(frame, "side_data", None) or ():  # a frame without side data has none
        if str(data.type).rsplit(".", 1)[-1] == "DISPLAYMATRIX" and len(bytes(data)) == 36:
            return struct.unpack("=9i", bytes(data))
    return None


def upright(array: np.ndarray, frame) -> np.ndarray:
    """The frame as FFmpeg's autorotate shows it: its display matrix applied whole, reflections
    included (fftools' rule: a 90° or 270° turn with or without a flip by transpose, 180° as hflip
    and / or vflip, 0° with a vflip where the matrix mirrors). A matrix that mirrors was applied as
    a turn from `frame.rotation` alone before: every frame the mirror image of FFmpeg's. An angle
    off the right angles keeps the nearest quarter turns below it, as before."""
    m = display_matrix(frame)
    if m is None:
        return _apply_rotation(array, frame.rotation)
    s0, s1 = math.hypot(m[0], m[3]), math.hypot(m[1], m[4])
    if not s0 or not s1:
        return array  # a degenerate matrix: FFmpeg applies none
    theta = float(round(math.degrees(math.atan2(m[1] / s1, m[0] / s0))))  # fftools' get_rotation
    theta -= 360 * math.floor(theta / 360 + 0.9 / 360)
    if abs(theta - 90) < 1:
        out = _TRANSPOSE["cclock_flip" if m[3] > 0 else "clock"](array)
    elif abs(theta - 180) < 1:
        out = array[:, ::-1] if m[0] < 0 else array
        out = out[::-1] if m[4] < 0 else out
    elif abs(theta - 270) < 1:
        out = _TRANSPOSE["clock_flip" if m[3] < 0 else "cclock"](array)
    elif abs(theta) < 1:
        out = array[::-1] if m[4] < 0 else array
    else:
        return _apply_rotation(array, frame.rotation)
    return np.ascontiguousarray(out)


class Renumber(Exception):
    """The decoder does not output the frames the packets promised (a packet that fails to
    decode, stamps out of output order, a frame no packet named): number the clip by its output."""


def decode_video_pyav(path: str, sampling: Sampling, transform=same, seek: str = "exact") -> Frames:
    """Index the stream by demuxing, then decode forward, seeking only past keyframes.

    Frame n is the n-th frame a plain full decode outputs, in presentation (pts) order. Packets are
    decoded one by one so a corrupt packet loses its frames, not the rest of the file.
    seek="keyframe": each sample moves to the nearest keyframe, and only keyframes are decoded. A
    sampled frame the seeks did not deliver is looked for once more in one pass from the file's
    start, without seeking. Where the decoding shows the packets' count wrong (Renumber), or the
    stamps cannot number the frames (by_count), the clip is counted by a full decode and sampled
    by that count (`_by_output`). A stream that ends before its header says is sampled from the
    frames it has, with info["truncated"].
    """
    import av

    with av.open(path) as container:
        if not container.streams.video:
            raise DecodeError(Status.NO_VIDEO_STREAM, "the file has no video stream")
        stream = _configured(container)
        index = videoindex.scan(container, stream)
        order = index.order
        if not index.packets:
            raise DecodeError(Status.EMPTY, "the video stream has no frames")
        fps = float(stream.average_rate or 0)
        codec = stream.codec_context.name
        if index.by_count:
            return _by_output(path, sampling, transform, index, codec, "no stamps to number the frames by")
        base = stream.start_time if stream.start_time is not None else int(order[0])
        times = (order - base) * float(stream.time_base)
        wanted = sampling.indices(len(times), times)
        asked = len(wanted)  # a seek may fold several onto one keyframe: the row says what was asked
        bound = seek_bound(seek)
        if seek == "keyframe":
            wanted = snap_to_keyframes(wanted, np.searchsorted(order, index.keyframes).tolist())
        elif bound:
            wanted = snap_within(wanted, np.searchsorted(order, index.keyframes).tolist(), times, bound)
        size: list[tuple[int, int]] = []
        whole = seek != "keyframe" and len(order) <= WHOLE_FRAMES
        try:
            got = (
                {}
                if whole
                else _pyav_frames(container, stream, index, wanted, transform, size, seek == "keyframe")
            )
        except Renumber as why:
            return _by_output(path, sampling, transform, index, codec, str(why))
    if whole:  # a short clip: every packet decoded, so the count is the decoder's, checked
        try:
            with av.open(_rewound(path)) as container:
                got = _whole_frames(container, _configured(container), index, wanted, transform, size)
        except Renumber as why:
            return _by_output(path, sampling, transform, index, codec, str(why))
    missing = [i for i in wanted if i not in got]
    if missing:  # the seeks found no way to them: one pass from the start
        try:
            with av.open(_rewound(path)) as container:
                got |= _pyav_frames(
                    container,
                    _configured(container),
                    index,
                    missing,
                    transform,
                    size,
                    seek == "keyframe",
                    sequential=True,
                )
        except Renumber as why:
            return _by_output(path, sampling, transform, index, codec, str(why))
        missing = [i for i in wanted if i not in got]
    return _sampled(
        got, times, size, codec=codec, total_frames=len(times), fps=fps,
        duration=round(index.seconds, 6), missing=missing, truncated=index.truncated, frames_asked=asked,
    )


def _sampled(got: dict, times, size: list, **facts) -> Frames:
    """The frames taken, their times, and what decoding found (Frames.info)."""
    if not got:
        raise DecodeError(Status.DECODE_ERROR, "no sampled frame could be decoded")
    indices = sorted(got)
    return Frames(
        images=[got[i] for i in indices],
        indices=indices,
        timestamps=[round(float(times[i]), 6) for i in indices],
        info={"backend": "pyav", **facts, "height": size[0][0], "width": size[0][1]},
    )


def _rewound(path):
    if not isinstance(path, str):
        path.seek(0)
    return path


def _by_output(path, sampling: Sampling, transform, index, codec: str, why: str) -> Frames:
    """The clip numbered as a plain full decode outputs it: one pass counts the frames (no colour
    conversion), a second takes the sampled ones. The timestamps are the frames' own where they
    rise, else the n-th frame's at the stream's rate (as transformers' video loaders number them).
    Every sample is the frame asked for: there is no keyframe index to snap to here."""
    import av

    with av.open(_rewound(path)) as container:
        stream = _configured(container)
        refused: list[int] = []
        stamps = [frame.pts for frame in _every_frame(container, stream, refused)]
        fps = float(stream.average_rate or 0)
        tb = float(stream.time_base)
        start = stream.start_time
    if not stamps:
        raise DecodeError(Status.DECODE_ERROR, "no frame could be decoded")
    n = len(stamps)
    rising = None not in stamps and all(a < b for a, b in zip(stamps, stamps[1:]))
    if rising:
        times = (np.asarray(stamps, dtype=np.float64) - (start if start is not None else stamps[0])) * tb
        seconds = index.seconds
    else:
        times = np.arange(n) / (fps or 30.0)
        seconds = n / (fps or 30.0)
    wanted = sampling.indices(n, times)
    size: list[tuple[int, int]] = []
    with av.open(_rewound(path)) as container:
        got = _counted_frames(container, _configured(container), wanted, transform, size)
    return _sampled(
        got, times, size, codec=codec, total_frames=n, fps=fps, duration=round(seconds, 6),
        missing=[i for i in wanted if i not in got], truncated=index.truncated,
        frames_asked=len(wanted), numbered=f"by a full decode: {why}", undecodable=len(refused),
    )


def _configured(container):
    stream = container.streams.video[0]
    stream.thread_count = THREADS  # 1: workers decode in parallel, threads inside them only contend
    if THREADS > 1:  # the tail of a run: cores are idle (workers.py sets THREADS)
        stream.thread_type = "AUTO"
    return stream


def _pyav_frames(
    container, stream, index, wanted, transform, size, keys_only=False, sequential=False
) -> dict[int, object]:
    """Frame number -> transform(RGB array) for each wanted frame that decodes; size gets (h, w).

    keys_only: every wanted frame is a keyframe, so every other packet may be skipped.
    sequential: one pass from where the container stands, never seeking.
    """
    order, keyframes = index.order, index.keyframes
    index_of = {int(p): i for i, p in enumerate(order)}
    pending = deque(int(order[i]) for i in wanted)  # target pts, rising
    targets = set(pending)
    skip = None
    skipped: set[int] = set()  # pts of frames the decoder was told it may drop
    if keys_only or stream.codec_context.name in SKIPS_NONREF:
        skip = lambda packet: _droppable(packet, targets, skipped)
    skip_mode = "NONKEY" if keys_only else "NONREF"
    got: dict[int, object] = {}
    frames, position = None, None  # the decoding run in progress and the pts it reached
    # Seeks only ever go forward: each starts at a keyframe later than the last one's, so there are
    # at most as many decoding runs as keyframes, whatever the decoder gives back. A keyframe that
    # outputs frames before itself (an open GOP's leading pictures, or a first keyframe flagged
    # after frame 0) once sent this loop back to the same keyframe without end (issue 46).
    seeked, shown = None, None  # the keyframe the run in progress started at, the last pts it output
    lost: set[int] = set()  # pts of packets the decoder refused

    def onward(key: int) -> bool:  # a seek to `key` would go forward, past where decoding stands
        ahead = position is not None and key > position
        return not sequential and ahead and (seeked is None or key > seeked)

    while pending:
        key = _keyframe_before(keyframes, pending[0])
        if frames is None or onward(key):  # next target lies past the next keyframe
            seeked, shown = key, None  # shown: the last pts this run output
            packets = (
                None
                if sequential or key not in index.rank
                else videoindex.packets_from(container, stream, index, key)
            )
            frames = _decoded(container, stream, skip, skip_mode, packets, lost)
        for frame in frames:
            position = frame.pts
            # what the packets said is checked against what the decoder does: a frame they do not
            # know, frames out of order, a frame of theirs refused or passed over (issue 46)
            if position not in index_of or (shown is not None and position <= shown):
                raise Renumber(f"the decoder output pts {position} after {shown}")
            if lost and any(p in index_of for p in lost):
                raise Renumber(f"packets that did not decode: pts {sorted(lost)[:3]}")
            while pending[0] < position:
                if not keys_only:
                    raise Renumber(f"pts {pending[0]} was not output before {position}")
                # only keyframes decoded: HEVC drops a held frame at the next IRAP; it is missing
                pending.popleft()
                if not pending:
                    return got
            if not keys_only and shown is not None and any(
                int(order[j]) not in skipped for j in range(index_of[shown] + 1, index_of[position])
            ):
                raise Renumber(f"a frame between pts {shown} and {position} was not output")
            shown = position
            if pending[0] == position:
                rgb = upright(frame.to_ndarray(format="rgb24"), frame)
                size.append(rgb.shape[:2])
                got[index_of[position]] = transform(rgb)  # one full-size frame in memory at a time
                pending.popleft()
            if not pending or onward(_keyframe_before(keyframes, pending[0])):
                break
        else:
            if sequential and not keys_only:  # a pass from the start ended and these never came out
                raise Renumber(f"pts {pending[0]} never output")
            break  # end of stream: the seek found no way to the rest (a pass from the start follows)
    return got


def _whole_frames(container, stream, index, wanted, transform, size) -> dict[int, object]:
    """One pass over every packet from the start to the end: each frame the decoder outputs must be
    the next one the index lists, or follow frames it was told it may drop (non-reference ones no
    sample needs, as the seeking path skips them); every other frame must come out (else Renumber)."""
    order = index.order
    index_of = {int(p): i for i, p in enumerate(order)}
    targets, got, n = set(wanted), {}, 0
    skipped: set[int] = set()
    lost: set[int] = set()
    skip = None
    if stream.codec_context.name in SKIPS_NONREF:
        skip = lambda packet: _droppable(packet, targets, skipped, index_of)
    for frame in _decoded(container, stream, skip, "NONREF", None, lost):
        at = index_of.get(frame.pts)
        if at is None or at < n or any(int(order[j]) not in skipped for j in range(n, at)):
            raise Renumber(f"the decoder output pts {frame.pts} as frame {n}")
        if at in targets:
            rgb = upright(frame.to_ndarray(format="rgb24"), frame)
            size.append(rgb.shape[:2])
            got[at] = transform(rgb)
        n = at + 1
    if any(p in index_of for p in lost):
        raise Renumber(f"packets that did not decode: pts {sorted(lost)[:3]}")
    if any(int(order[j]) not in skipped for j in range(n, len(order))):
        raise Renumber(f"{n} frames output where the packets name {len(order)}")
    return got


def _droppable(packet, targets: set, skipped: set, index_of: dict | None = None) -> bool:
    """Whether the decoder may drop this packet's frame (no sample needs it); noted in `skipped`.
    `targets`: the wanted pts, or with `index_of` the wanted frame numbers."""
    if (packet.pts if index_of is None else index_of.get(packet.pts)) in targets:
        return False
    skipped.add(packet.pts)
    return True


def _every_frame(container, stream, refused: list | None = None):
    """Every frame a plain decode outputs, in output order; a packet that fails to decode is passed
    over, and counted in `refused` (the flush packet at the end gives the last frames)."""
    import av

    for packet in container.demux(stream):
        try:
            yield from packet.decode()
        except av.error.InvalidDataError:
            if refused is not None:
                refused.append(packet.pts)


def _counted_frames(container, stream, wanted, transform, size) -> dict[int, object]:
    """Frame number -> transform(RGB array), numbering the frames as the decoder gives them, from the start."""
    pending, got = set(wanted), {}
    last = max(wanted, default=-1)
    for n, frame in enumerate(_every_frame(container, stream)):
        if n in pending:
            rgb = upright(frame.to_ndarray(format="rgb24"), frame)
            size.append(rgb.shape[:2])
            got[n] = transform(rgb)
        if n >= last:
            break
    return got


def snap_within(wanted: list[int], keys: list[int], times, bound: float) -> list[int]:
    """--seek nearest: each sample moved to its nearest keyframe where that is at most `bound`
    seconds away and a quarter of the spacing between samples (so samples stay apart and in
    order), and not taken by another sample; every other sample stays the frame asked for."""
    if not keys or not wanted:
        return list(wanted)
    spacing = (float(times[wanted[-1]]) - float(times[wanted[0]])) / max(len(wanted) - 1, 1)
    tau = min(bound, spacing / 4) if len(wanted) > 1 else bound
    key_times = [float(times[k]) for k in keys]
    taken, out = set(), []
    for i in wanted:
        t = float(times[i])
        at = bisect.bisect_left(key_times, t)
        near = min(
            (j for j in (at - 1, at) if 0 <= j < len(keys)), key=lambda j: (abs(key_times[j] - t), j)
        )
        k = keys[near]
        if abs(key_times[near] - t) <= tau + 1e-9 and k not in taken and k not in wanted:
            out.append(k)
            taken.add(k)
        else:
            out.append(i)
    return sorted(set(out))


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


def _decoded(container, stream, skip=None, skip_mode="NONREF", packets=None, lost=None):
    """Frames in presentation order, packet by packet, skipping packets that fail to decode.

    `skip(packet)` True: its frame is not wanted, so the decoder may drop it unless another
    frame refers to it (skip_frame NONREF); the wanted ones and every reference still decode,
    so each frame that comes out is exactly the one a full decode gives. NONKEY drops every
    frame but keyframes: for when only keyframes are wanted.
    """
    import av

    context = stream.codec_context
    for packet in container.demux(stream) if packets is None else packets:
        if skip is not None:
            context.skip_frame = skip_mode if packet.pts is not None and skip(packet) else "DEFAULT"
        try:
            frames = packet.decode()
            if skip_mode == "NONKEY" and context.skip_frame == "DEFAULT" and packet.size:
                # a wanted keyframe, and only keyframes decode: drain it now, for the decoder would
                # hold it and HEVC drops held frames at the next keyframe (IRAP) unshown
                frames = [*frames, *context.decode(None)]
                context.flush_buffers()
        except av.error.InvalidDataError:
            if lost is not None and packet.pts is not None:
                lost.add(packet.pts)
            continue
        for frame in frames:
            if frame.pts is not None:
                yield frame


def decode_video_decord(path: str, sampling: Sampling, transform=same, seek: str = "exact") -> Frames:
    import decord

    decord.logging.set_level(decord.logging.QUIET)
    try:
        reader = decord.VideoReader(path, ctx=decord.cpu(0), num_threads=THREADS)
    except (RuntimeError, decord.DECORDError) as e:
        raise DecodeError(Status.DECODE_ERROR, f"decord: {str(e).splitlines()[0][:200]}") from None
    total = len(reader)
    if total == 0:
        raise DecodeError(Status.EMPTY, "the video stream has no frames")
    stamps = reader.get_frame_timestamp(np.arange(total))  # (start, end) of each frame, seconds
    times = stamps[:, 0]
    wanted = sampling.indices(total, times)
    asked = len(wanted)
    bound = seek_bound(seek)
    if seek == "keyframe":
        wanted = snap_to_keyframes(wanted, sorted(int(k) for k in reader.get_key_indices()))
    elif bound:
        wanted = snap_within(wanted, sorted(int(k) for k in reader.get_key_indices()), times, bound)
    images = []
    for at in range(0, len(wanted), DECORD_CHUNK):
        try:
            batch = reader.get_batch(wanted[at : at + DECORD_CHUNK]).asnumpy()  # (F, H, W, 3) uint8
        except (RuntimeError, decord.DECORDError) as e:
            raise DecodeError(Status.DECODE_ERROR, f"decord: {str(e).splitlines()[0][:200]}") from None
        if batch.ndim != 4 or batch.shape[-1] != 3:  # seen with rotated clips: let PyAV do it
            raise DecodeError(Status.DECODE_ERROR, f"decord returned frames shaped {batch.shape}")
        images += [transform(frame) for frame in batch]
    info = {
        "backend": "decord",
        "frames_asked": asked,
        "total_frames": total,
        "fps": float(reader.get_avg_fps()),
        "duration": round(_decord_length(stamps, total, float(reader.get_avg_fps())), 6),
        "height": int(batch.shape[1]),
        "width": int(batch.shape[2]),
    }
    return Frames(
        images=images,
        indices=list(wanted),
        timestamps=[round(float(times[i]), 6) for i in wanted],
        info=info,
    )


def _decord_length(stamps: np.ndarray, total: int, fps: float) -> float:
    """Where the last frame ends, as decode_video_pyav's duration; by count at the average rate
    where decord's stamps are not times (MPEG-PS: its first frames come out at -1e14 s)."""
    if (stamps < 0).any() or not np.all(np.diff(stamps[:, 0]) >= 0):
        return total / fps if fps else float(stamps[:, 1].max())
    return float(stamps[:, 1].max())


def _probe(path: str, max_pixels: int | None) -> str | None:
    """The video codec, from the header; frames larger than max_pixels are refused before decoding."""
    import av

    try:
        with av.open(path) as container:
            if not container.streams.video:
                raise DecodeError(Status.NO_VIDEO_STREAM, "the file has no video stream")
            stream = container.streams.video[0]
            if stream.codec_context is None:  # FFmpeg knows no decoder for it (a `dav1` track, say)
                raise DecodeError(Status.UNSUPPORTED, "no decoder for this video codec in this FFmpeg build")
            if "enc_key_id" in stream.metadata:  # Matroska/WebM ContentEncryption (FFmpeg names the key)
                raise DecodeError(Status.UNSUPPORTED, ENCRYPTED)
            pixels = (stream.width or 0) * (stream.height or 0)
            codec = stream.codec_context.name
    except av.error.FFmpegError as e:
        raise DecodeError(Status.DECODE_ERROR, f"cannot open: {e}") from None
    if max_pixels and pixels > max_pixels:
        raise DecodeError(
            Status.TOO_LARGE,
            f"frames of {stream.width}×{stream.height} = {pixels:,} pixels, more than "
            f"--max-image-pixels {max_pixels:,}; raise --max-image-pixels to allow them",
        )
    return codec


# decoder threads per video: 1 while every worker is busy; the pool raises it for a run's last
# files, when fewer files than workers remain and their cores would idle
THREADS = 1


# clips of at most this many frames are decoded whole (every packet, in one pass: each output
# checked, so a packet the decoder refuses is never counted as a frame); longer ones seek, and
# only what they decode is checked (docs/format.md). Below it, seeking saves little: a sample
# every 30 frames or closer, a GOP or less apart.
WHOLE_FRAMES = 32 * 30


# decoders whose packets carry their frame's pts and that drop non-reference frames on request
SKIPS_NONREF = {"h264", "hevc"}


DECORD_CHUNK = 4  # frames fetched per get_batch call: memory holds a few full-size frames, not 32


# decord returns off-by-one frames after seeks in HEVC (open GOP): PyAV is exact there
DECORD_INEXACT = {"hevc", "h265"}


def _refuse_encrypted(path) -> None:
    """A CENC-encrypted MP4 track decodes to flat grey without its key, a scrambled MPEG-TS video
    to noise: refused with a row instead (encrypted WebM: _probe, from FFmpeg's own word)."""
    from . import isobmff, mpegts

    def look(f) -> bool:
        head = f.read(2 * mpegts.PACKET + 1)
        f.seek(0)
        return mpegts.scrambled(f) if mpegts.is_ts(head) else isobmff.encrypted(f)

    try:
        if isinstance(path, str):
            with open(path, "rb") as f:
                found = look(f)
        else:
            found = look(path)
            path.seek(0)
    except OSError:
        return  # unreadable: decoding says why
    if found:
        raise DecodeError(Status.UNSUPPORTED, ENCRYPTED)


ENCRYPTED = "encrypted (CENC in MP4, ContentEncryption in WebM, scrambled MPEG-TS): it cannot be decoded without its key"


def decode_video(
    path: str,
    sampling: Sampling,
    backend: str = "auto",
    max_pixels: int | None = None,
    transform=same,
    seek: str = "exact",
) -> Frames:
    """--video-backend auto|decord|pyav; auto takes PyAV, and decord where PyAV cannot read a file.

    PyAV first: it skips the frames no sample needs (SKIPS_NONREF), which decord cannot, is exact
    on open-GOP HEVC, and its RGB frames equal decord's bit for bit (same FFmpeg conversion).
    `transform` is applied to each frame as it is decoded (the pipeline passes patchify), so
    only a few full-size frames are ever held at once. seek="keyframe" (--seek): each sample
    snapped to the nearest keyframe; "nearest[:SECONDS]": only where one lies within the bound;
    `indices` says which frames were taken.
    """
    _refuse_encrypted(path)
    codec = guard(_probe, path, max_pixels)
    if not isinstance(
        path, str
    ):  # a file object (a URL's, a tar member's): PyAV reads it, decord takes names
        path.seek(0)
        return guard(decode_video_pyav, path, sampling, transform, seek)
    if backend == "decord":
        return guard(decode_video_decord, path, sampling, transform, seek)
    try:
        return guard(decode_video_pyav, path, sampling, transform, seek)
    except DecodeError as first:
        if backend == "pyav" or codec in DECORD_INEXACT:
            raise
        try:
            return guard(decode_video_decord, path, sampling, transform, seek)
        except DecodeError:
            raise first from None
