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
