"""MPEG-TS read just far enough to tell what FFmpeg does not say: whether a video stream's packets
are scrambled (a pay-TV recording, DVB-CSA or AES under conditional access). FFmpeg hands such
payloads to the decoder as they are, and a clip of noise or a few frames comes out; gemma4enc
refuses it with a row (`unsupported`, "encrypted"), as it refuses CENC MP4 and encrypted WebM
(issue 46).

The program map is read from the first packets (PAT on PID 0, then each PMT), then the video PIDs'
`transport_scrambling_control` bits are looked at; at most SCAN_BYTES are read.
"""

from __future__ import annotations

PACKET = 188
SYNC = 0x47
SCAN_BYTES = 4 << 20  # the most read to find the tables and the video's packets
# ISO 13818-1 / ITU-T H.222 stream types that carry video
VIDEO_TYPES = {0x01, 0x02, 0x10, 0x1B, 0x20, 0x24, 0x33, 0x42, 0xD1, 0xEA}


def is_ts(head: bytes) -> bool:
    """Three sync bytes 188 apart at the start: a transport stream (not M2TS's 192-byte packets)."""
    return len(head) >= 2 * PACKET + 1 and all(head[i * PACKET] == SYNC for i in range(3))


def scrambled(f) -> bool:
    """Whether a video stream of the transport stream open in `f` (binary, at its start) carries
    scrambled packets. A stream whose tables are not found in SCAN_BYTES says False."""
    data = f.read(SCAN_BYTES)
    if not is_ts(data):
        return False
    pmts: set[int] = set()
    video: set[int] = set()
    for at in range(0, len(data) - PACKET + 1, PACKET):
        p = data[at: at + PACKET]
        if p[0] != SYNC:
            return False  # lost sync: not a stream this reader follows
        pid = (p[1] & 0x1F) << 8 | p[2]
        control, adaptation = p[3] >> 6, (p[3] >> 4) & 3
        if pid in video and control and adaptation & 1:
            return True  # a payload the decoder cannot read without the key
        if not p[1] & 0x40 or control:  # only a section's first packet (payload_unit_start), in clear
            continue
        start = 4 + (1 + p[4] if adaptation & 2 else 0)
        if adaptation & 1 == 0 or start >= PACKET:
            continue
        section = p[start + 1 + p[start]:]  # past the pointer field
        if pid == 0:
            pmts |= set(_pat(section))
        elif pid in pmts:
            video |= set(_pmt(section))
    return False


def _pat(section: bytes):
    """The PMT PIDs a program association section names (program 0 is the network PID)."""
    if len(section) < 8 or section[0] != 0x00:
        return
    end = min(3 + ((section[1] & 0x0F) << 8 | section[2]) - 4, len(section))  # less the CRC
    for at in range(8, end - 3, 4):
        if section[at] << 8 | section[at + 1]:
            yield (section[at + 2] & 0x1F) << 8 | section[at + 3]


def _pmt(section: bytes):
    """The video elementary PIDs a program map section lists."""
    if len(section) < 12 or section[0] != 0x02:
        return
    end = min(3 + ((section[1] & 0x0F) << 8 | section[2]) - 4, len(section))
    at = 12 + ((section[10] & 0x0F) << 8 | section[11])  # past the program info
    while at + 5 <= end:
        kind, pid = section[at], (section[at + 1] & 0x1F) << 8 | section[at + 2]
        if kind in VIDEO_TYPES:
            yield pid
        at += 5 + ((section[at + 3] & 0x0F) << 8 | section[at + 4])
