"""ISO base media files (MP4, MOV, 3GP, M4V), read just far enough to tell what FFmpeg does not:
whether a track is encrypted (Common Encryption: an `encv`/`enca` sample entry). FFmpeg decodes
such a track without its key into frames of flat grey and says nothing; gemma4enc refuses it with
a row (`unsupported`, "encrypted"), as it refuses an encrypted WebM (issue 46).

Only box headers and the sample descriptions are read, each with a bound: a box that claims more
than the file holds, or nesting past a few levels, ends the look (not encrypted, as far as known).
"""

from __future__ import annotations

import struct

CONTAINERS = {b"moov", b"trak", b"mdia", b"minf", b"stbl"}  # the way down to the sample descriptions
ENCRYPTED = {b"encv", b"enca", b"enct", b"encs"}  # CENC's protected sample entries
MOOV_MAX = 64 << 20  # the most of a moov box read to look
TOP_BOXES = 64  # top-level boxes looked at before giving up on finding moov


def encrypted(f) -> bool:
    """Whether the ISO base media file open in `f` (binary, seekable) holds an encrypted track.
    Leaves `f` at its start. A file that is not one says False."""
    try:
        f.seek(0, 2)
        size = f.tell()
        f.seek(0)
        head = f.read(12)
        if len(head) < 12 or head[4:8] not in (b"ftyp", b"moov", b"free", b"wide", b"mdat", b"skip"):
            return False
        at = 0
        for _ in range(TOP_BOXES):
            box = _box(f, at, size)
            if box is None:
                return False
            kind, start, end = box
            if kind == b"moov":
                if end - start > MOOV_MAX:
                    return False
                f.seek(start)
                return _holds(f.read(end - start), depth=0)
            at = end
        return False
    finally:
        f.seek(0)


def _box(f, at: int, size: int):
    """(type, payload start, end) of the box at `at`, or None past the end or where it lies."""
    if at + 8 > size:
        return None
    f.seek(at)
    head = f.read(16)
    if len(head) < 8:
        return None
    length, kind = struct.unpack(">I4s", head[:8])
    start = at + 8
    if length == 1 and len(head) == 16:
        length, start = struct.unpack(">Q", head[8:16])[0], at + 16
    elif length == 0:
        length = size - at
    if length < start - at or at + length > size:
        return None
    return kind, start, at + length


def _holds(data: bytes, depth: int) -> bool:
    """Whether the boxes in `data` (a container's payload) lead to an encrypted sample entry."""
    at = 0
    while at + 8 <= len(data) and depth < 8:
        length, kind = struct.unpack(">I4s", data[at: at + 8])
        if length < 8 or at + length > len(data):
            return False
        payload = data[at + 8: at + length]
        if kind in CONTAINERS and _holds(payload, depth + 1):
            return True
        if kind == b"stsd" and len(payload) >= 8:  # version, flags, entry count, then the entries
            entries = payload[8:]
            e = 0
            while e + 8 <= len(entries):
                n, entry = struct.unpack(">I4s", entries[e: e + 8])
                if entry in ENCRYPTED:
                    return True
                if n < 8:
                    break
                e += n
        at += length
    return False
