"""One demux pass over a video's packets: its frames in presentation order, its keyframes, where
the stream really ends, and a seek that lands on a keyframe in every container.

Containers differ in what a seek means. MP4/MKV seek through an index of keyframes; MPEG-TS
and MPEG-PS have none, and FFmpeg bisects the file by the *decode* timestamps of whatever
packets it meets, so a seek to a keyframe's pts lands past the keyframe (its dts is earlier)
and on a frame that cannot be decoded alone. `packets_from` seeks early enough, checks where
it landed against the decode order this pass recorded, and hands the decoder packets from the
keyframe itself. MPEG-PS also splits a frame over several packets with the same pts: frames
are stamped unreliably: a packet without a pts, or two frames stamped alike. Such a stream is
numbered by count (`by_count`): frame n is the n-th frame the decoder gives, read from the start.

A packet is a frame only if the decoder outputs one for it: an edit list's pre-roll (flagged
discard) and VP8/VP9's hidden frames (an alt-ref reference sent on its own, `show_frame` 0 in
its header) are decoded and never shown, so they are seek points but not frames. What packets
cannot tell (one that fails to decode, stamps out of order) the decoding itself checks
(video.Renumber): the clip is then numbered by a full decode's output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

SEEK_TRIES = 6  # each one starts twice as far before the keyframe; then the file's start


@dataclass
class Index:
    order: np.ndarray  # every output frame's pts, rising (frame n is order[n]); not an edit list's pre-roll
    keyframes: list[int]  # keyframe pts, rising
    rank: dict[int, int]  # pts -> its packet's place in decode order
    dts: dict[int, int]  # keyframe pts -> its packet's dts (what TS/PS seeks compare)
    first_dts: int  # the stream's first decode timestamp
    truncated: bool = False  # the stream ends before its header says: a cut file
    by_count: bool = False  # pts do not number the frames (MPEG-PS): count them as decoded
    packets: int = 0  # video packets with data: one frame each (FFmpeg's parsers split frames so)
    header: dict = field(default_factory=dict)  # what the header claimed (frames, seconds)
    seconds: float = 0.0  # the stream's duration (see length)


def scan(container, stream) -> Index:
    """Demux every packet once (all streams: where each ends tells a cut file from a long audio track)."""
    pts: list[int] = []
    rank: dict[int, int] = {}
    dts: dict[int, int] = {}
    keyframes: list[int] = []
    packets, by_count = 0, False
    first_dts = None
    video_end = None  # pts + duration of the last video packet, in the stream's units
    last = None  # the last frame's (pts, duration): where the stream ends when the header does not say
    other_end = 0.0  # seconds, absolute: the furthest any other stream reaches
    codec = stream.codec_context.name
    unshown: set[int] = set()  # hidden frames' pts
    for packet in container.demux():
        if packet.stream.index != stream.index:
            if packet.pts is not None and packet.time_base:
                other_end = max(
                    other_end, float((packet.pts + (packet.duration or 0)) * packet.time_base)
                )
            continue
        if not packet.size:
            continue
        hidden = codec in HIDDEN_FRAMES and not shown(memoryview(packet), codec)
        packets += not hidden
        if hidden:
            if packet.pts is not None and packet.pts not in rank:
                rank[packet.pts] = len(rank)  # decoded (a later frame refers to it), never output
                unshown.add(packet.pts)
            continue
        if packet.pts in unshown:  # a shown frame stamped as the hidden one before it
            unshown.discard(packet.pts)
            del rank[packet.pts]
        if packet.pts is None or packet.pts in rank:  # MPEG-PS: no stamp, or another frame's
            by_count = True
            continue
        rank[packet.pts] = len(rank)
        if not packet.is_discard:  # an edit list's pre-roll: decoded, never output (a seek point still)
            pts.append(packet.pts)
        if packet.dts is not None and first_dts is None:
            first_dts = packet.dts
        if packet.is_keyframe and packet.pts not in dts:
            keyframes.append(packet.pts)
            dts[packet.pts] = packet.dts if packet.dts is not None else packet.pts
        end = packet.pts + (packet.duration or 0)
        video_end = end if video_end is None else max(video_end, end)
        if last is None or packet.pts > last[0]:
            last = (packet.pts, packet.duration)
    order = np.array(sorted(pts), dtype=np.int64)
    index = Index(
        order,
        sorted(keyframes),
        rank,
        dts,
        first_dts if first_dts is not None else (int(order[0]) if len(order) else 0),
    )
    index.by_count, index.packets = by_count, packets
    if len(order):
        assert video_end is not None and last is not None  # set by every frame's packet
        index.truncated, index.header = _cut(container, stream, packets, video_end, other_end)
        index.seconds = length(stream, index, last)
    return index


HIDDEN_FRAMES = {"vp8", "vp9", "libvpx", "libvpx-vp9"}  # codecs whose packets may hold a frame never shown


def shown(data: memoryview, codec: str) -> bool:
    """Whether a VP8/VP9 packet outputs a frame: its header's show_frame bit (VP9: or
    show_existing_frame); a VP9 superframe (several frames in one packet, the index at its end)
    outputs one if any frame in it does. Anything unreadable counts as shown (the decoding checks)."""
    if not len(data):
        return False
    if "9" not in codec:
        return bool(data[0] & 0x10)  # VP8's frame tag: bit 4, show_frame
    last = data[-1]
    if last & 0xE0 == 0xC0:  # a superframe index: 0b110 marker, size bytes, frame count
        count, width = (last & 7) + 1, ((last >> 3) & 3) + 1
        size = 2 + width * count
        if len(data) >= size and data[-size] == last:
            at, frames = len(data) - size + 1, []
            for _ in range(count):
                frames.append(int.from_bytes(bytes(data[at: at + width]), "little"))
                at += width
            start = 0
            for n in frames:
                if n and start < len(data) - size and _vp9_shown(data[start]):
                    return True
                start += n
            return False
    return _vp9_shown(data[0])


def _vp9_shown(first: int) -> bool:
    """VP9's uncompressed header, first byte: frame_marker (2 bits), profile (2, and a reserved
    bit in profile 3), show_existing_frame, then frame_type and show_frame."""
    if first >> 6 != 2:
        return True  # not a VP9 frame header as far as known: counted, the decoding checks
    profile = ((first >> 4) & 1) << 1 | ((first >> 5) & 1)
    bit = 3 if profile < 3 else 2  # the bit after the profile (and the reserved bit)
    if (first >> bit) & 1:  # show_existing_frame: a frame decoded earlier is shown now
        return True
    return bool((first >> (bit - 2)) & 1)  # skip frame_type: show_frame


# containers with no length in a header: FFmpeg's stream duration is its own estimate from the
# stamps it samples, and on MPEG-PS it is short (3.68 s for 96 frames at 25 fps, which end at 3.84)
STAMPED_ONLY = {"mpeg", "mpegts", "mpegvideo", "vob"}


def length(stream, index: Index, last: tuple[int, int | None]) -> float:
    """The stream's duration in seconds, not its last frame's start: the header's (MP4, MOV, AVI)
    unless the stream is cut short; else (MKV/WebM keep it per file, MPEG-TS/PS have none, a cut
    file has lost its end) where the last frame ends; a stream numbered by count, its frames at
    its frame rate."""
    fps = float(stream.average_rate or 0) or 30.0
    if index.by_count:  # no reliable stamps (MPEG-PS): the frames there, at the stream's rate
        return index.packets / fps
    header = stream.container.format.name not in STAMPED_ONLY
    if stream.duration and header and not index.truncated:
        return float(stream.duration * stream.time_base)
    tb = float(stream.time_base)
    start = stream.start_time if stream.start_time is not None else int(index.order[0])
    pts, duration = last
    return (pts - start) * tb + (duration * tb if duration else 1 / fps)  # no duration: one frame


def _cut(container, stream, frames: int, video_end: int, other_end: float) -> tuple[bool, dict]:
    """Whether the frames found fall short of what the header promised (frame count or duration).

    Streaming containers (MPEG-TS, fragmented MP4 without an index) state no length: a cut one
    looks like a shorter recording and is not flagged. A frame's length (two, with rounding) and
    1 % of the duration are allowed: edit lists and timestamp rounding shift a clip's end a little.
    """
    tb = float(stream.time_base)
    fps = float(stream.average_rate or 0) or 30.0
    promised_frames = int(stream.frames or 0)
    start = stream.start_time if stream.start_time is not None else 0
    if stream.duration:  # the stream's own length (MP4, MOV)
        promised = float(stream.duration * tb)
        reached = float((video_end - start) * tb)
    elif container.duration:  # the file's length (MKV/WebM's segment): any stream may reach it
        promised = container.duration / 1e6
        origin = (container.start_time or 0) / 1e6
        reached = max(float(video_end * tb), other_end) - origin
    else:
        promised = reached = 0.0
    slack = 2.0 / fps + 0.01 * promised
    short_count = promised_frames > 0 and frames < promised_frames - 1
    short_time = promised > 0 and reached < promised - slack
    header = {"frames": promised_frames or None, "seconds": round(promised, 6) if promised else None}
    return short_count or short_time, header


def packets_from(container, stream, index: Index, key: int):
    """The stream's packets in decode order, starting at the keyframe whose pts is `key`.

    Seeks to the keyframe's dts (never later than its pts), then further back while the first
    packet read lies past it in decode order; packets before it are read and dropped, not decoded.
    Yields nothing if the keyframe cannot be reached.
    """
    import av

    want = index.rank[key]
    second = max(1, int(round(1 / float(stream.time_base))))
    target, back = index.dts.get(key, key), 0
    for attempt in range(SEEK_TRIES + 1):
        at = max(target - back, index.first_dts) if attempt < SEEK_TRIES else index.first_dts
        try:
            container.seek(int(at), stream=stream, backward=True)
        except av.error.FFmpegError:
            if at == index.first_dts:
                return
            back = max(back * 2, second)
            continue
        packets = container.demux(stream)
        for packet in packets:
            place = index.rank.get(packet.pts) if packet.pts is not None and packet.size else None
            if place is None:
                continue
            if place > want:
                break  # landed past the keyframe: go back further
            if place == want:
                yield packet
                yield from packets
                return
        else:
            return  # the stream ended before the keyframe
        if at == index.first_dts:
            return
        back = max(back * 2, second)
