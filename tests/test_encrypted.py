"""An encrypted (CENC) MP4 track is refused with a row, never embedded as flat grey (issue 46).
The file is a real H.264 MP4 whose sample entry is marked encrypted (`encv`), as a packager
does; a plain copy of it still decodes."""

from __future__ import annotations

import io

import pytest

from gemma4enc.dev.demo import write_video
from gemma4enc.media import isobmff
from gemma4enc.media.video import decode_video
from gemma4enc.media.frames import DecodeError
from gemma4enc.options import Sampling


def test_an_encv_sample_entry_is_refused_and_a_plain_one_decodes(tmp_path):
    plain = tmp_path / "plain.mp4"
    write_video(plain, frames=6)
    data = plain.read_bytes()
    assert data.count(b"avc1") >= 1 and isobmff.encrypted(io.BytesIO(data)) is False
    at = data.index(b"stsd")
    locked = tmp_path / "locked.mp4"
    locked.write_bytes(data[:at] + data[at:].replace(b"avc1", b"encv", 1))
    assert isobmff.encrypted(io.BytesIO(locked.read_bytes())) is True
    assert len(decode_video(str(plain), Sampling(frames=2)).images) == 2
    with pytest.raises(DecodeError) as e:
        decode_video(str(locked), Sampling(frames=2))
    assert e.value.status == "unsupported" and "encrypted" in str(e.value)
    with open(locked, "rb") as f:  # a file object (a URL's or a tar member's) too
        with pytest.raises(DecodeError):
            decode_video(f, Sampling(frames=2))


def test_not_an_iso_file_or_a_lying_box_is_not_encrypted():
    assert isobmff.encrypted(io.BytesIO(b"\x1aE\xdf\xa3 webm")) is False
    assert isobmff.encrypted(io.BytesIO(b"\x00\x00\x00\x18ftypisom" + b"\xff\xff\xff\xffmoov")) is False
    assert isobmff.encrypted(io.BytesIO(b"")) is False


def _ts(path, frames: int = 24):
    """An H.264 MPEG-TS as a camcorder writes it (PyAV), in clear."""
    import av
    import numpy as np

    with av.open(str(path), "w", format="mpegts") as container:
        stream = container.add_stream("libx264", rate=25)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), i * 9, np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


@pytest.mark.parametrize("where", ["file", "file object"])
def test_a_scrambled_mpegts_video_is_refused_and_a_clear_one_decodes(tmp_path, where):
    """A transport stream whose video packets say scrambled (transport_scrambling_control, as a
    pay-TV recording's do): FFmpeg decodes the payload as if it were clear (noise, from a real
    recording); it is refused as encrypted, by path and as a file object. The clear original
    decodes, and the scan finds no scrambled packet in it."""
    from gemma4enc.media import mpegts

    clear = _ts(tmp_path / "clear.ts")
    data = bytearray(clear.read_bytes())
    assert mpegts.is_ts(bytes(data)) and mpegts.scrambled(io.BytesIO(bytes(data))) is False
    marked = 0
    for at in range(0, len(data), mpegts.PACKET):
        pid = (data[at + 1] & 0x1F) << 8 | data[at + 2]
        if pid not in (0, 0x11, 0x1000) and data[at + 3] >> 4 & 1:  # not PAT, SDT, PMT: the video's
            data[at + 3] |= 0x80  # scrambled with the even key
            marked += 1
    assert marked > 10
    locked = tmp_path / "locked.ts"
    locked.write_bytes(bytes(data))
    assert mpegts.scrambled(io.BytesIO(bytes(data))) is True
    assert len(decode_video(str(clear), Sampling(frames=2)).images) == 2
    source = str(locked) if where == "file" else io.BytesIO(bytes(data))
    with pytest.raises(DecodeError) as e:
        decode_video(source, Sampling(frames=2))
    assert e.value.status == "unsupported" and "encrypted" in str(e.value)
