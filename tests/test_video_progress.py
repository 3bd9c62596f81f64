"""Seeking never loops (issue 46): a decoding run that gives back frames from before its own
keyframe (an open GOP's leading pictures; a clip whose first flagged keyframe comes after frame 0,
as some VVC muxers write) once sent the sampler back to that same keyframe without end. Here a
stand-in decoder does exactly that on every seek; the sampler must end, with every target found."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from gemma4enc.media import video, videoindex

N = 120  # frames, pts 0..119
KEYS = [8, 40, 72, 104]  # the first flagged keyframe comes after frame 0


class Frame:
    rotation = 0

    def __init__(self, pts: int):
        self.pts = pts

    def to_ndarray(self, format: str):
        return np.full((4, 6, 3), self.pts % 256, np.uint8)


def test_a_keyframe_that_outputs_earlier_frames_is_not_sought_again(monkeypatch):
    seeks = []

    def packets_from(container, stream, index, key):
        seeks.append(key)
        assert len(seeks) <= len(KEYS), f"sought {seeks}: a loop"
        return key

    def decoded(container, stream, skip, skip_mode, packets, lost=None):
        start = 0 if packets is None else max(0, packets - 8)  # leading pictures: 8 frames before it
        return (Frame(p) for p in range(start, N))

    monkeypatch.setattr(videoindex, "packets_from", packets_from)
    monkeypatch.setattr(video, "_decoded", decoded)
    order = np.arange(N)
    index = SimpleNamespace(order=order, keyframes=KEYS, rank={int(p): int(p) for p in order})
    stream = SimpleNamespace(codec_context=SimpleNamespace(name="h264"))
    wanted = [0, 15, 30, 45, 60, 75, 90, 105]
    size: list = []
    got = video._pyav_frames(None, stream, index, wanted, lambda rgb: int(rgb[0, 0, 0]), size)
    assert got == {i: i for i in wanted}  # every target, each the frame a full decode gives
    assert seeks == sorted(set(seeks))  # forward only


def test_an_edit_lists_preroll_is_not_counted_as_frames(tmp_path):
    """An MP4 whose edit list starts three frames into its first GOP (a trimmed clip): FFmpeg decodes
    those three and outputs none of them. total_frames, the sample's indices, its timestamps and
    every sampled frame are a plain full decode's (they were counted from packets: 40 frames, one
    sample "missing", timestamps shifted)."""
    import struct

    import av

    from gemma4enc.dev.demo import write_video
    from gemma4enc.options import Sampling

    clip = tmp_path / "clip.mp4"
    write_video(clip, frames=40, fps=25)
    data = bytearray(clip.read_bytes())
    at = data.index(b"elst")
    assert data[at + 4] == 0  # version 0: 32-bit duration and media_time
    start = struct.unpack_from(">i", data, at + 16)[0]
    struct.pack_into(">i", data, at + 16, start + 3 * 512)  # 3 frames later (512 ticks a frame)
    trimmed = tmp_path / "trimmed.mp4"
    trimmed.write_bytes(bytes(data))
    with av.open(str(trimmed)) as c:
        plain = sorted(((f.pts, f.time, f.to_ndarray(format="rgb24")) for f in c.decode(video=0)), key=lambda t: t[0])
    assert len(plain) == 37
    got = video.decode_video_pyav(str(trimmed), Sampling(frames=8))
    assert got.info["total_frames"] == 37 and not got.info["missing"]
    assert got.indices[0] == 0 and got.indices[-1] <= 36
    for i, image, t in zip(got.indices, got.images, got.timestamps):
        assert abs(t - plain[i][1]) < 1e-6, (i, t, plain[i][1])
        assert np.array_equal(np.asarray(image), plain[i][2]), i


def _with_matrix(path, matrix):
    """A short lossless H.264 clip of an asymmetric picture, with a display matrix or none."""
    import av

    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264rgb", rate=10)
        s.width, s.height, s.pix_fmt = 64, 48, "rgb24"
        s.options = {"qp": "0"}
        if matrix is not None:
            s.set_display_matrix(matrix)
        img = np.zeros((48, 64, 3), np.uint8)
        img[:8, :16] = (255, 0, 0)  # a red block top left
        img[40:, 50:] = (0, 0, 255)  # a blue one bottom right, smaller
        img[:, 30:33, 1] = 200  # a green bar
        for _ in range(3):
            for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)


def _displayed(img, a, b, c, d):
    """The display matrix's own definition, independent of FFmpeg's filters: source (x, y) shows
    at (a·x + c·y, b·x + d·y), shifted to start at 0."""
    h, w = img.shape[:2]
    y, x = np.mgrid[0:h, 0:w]
    xs, ys = a * x + c * y, b * x + d * y
    xs, ys = xs - xs.min(), ys - ys.min()
    out = np.zeros((ys.max() + 1, xs.max() + 1, 3), img.dtype)
    out[ys, xs] = img[y, x]
    return out


@pytest.mark.parametrize("abcd", [(1, 0, 0, 1), (-1, 0, 0, 1), (1, 0, 0, -1), (-1, 0, 0, -1),
                                  (0, -1, 1, 0), (0, 1, -1, 0), (0, 1, 1, 0), (0, -1, -1, 0)])
def test_the_display_matrix_is_applied_whole_reflections_included(tmp_path, abcd):
    """Every right-angle display matrix, the four turns and the four mirrors: frames come out as the
    matrix's definition shows them (FFmpeg's autorotate), and the row's width and height are the
    displayed ones. A mirror was applied as a turn from `frame.rotation` alone before."""
    from gemma4enc.media.frames import same
    from gemma4enc.media.video import decode_video_pyav
    from gemma4enc.options import Sampling

    a, b, c, d = abcd
    f = 1 << 16
    _with_matrix(tmp_path / "plain.mp4", None)
    _with_matrix(tmp_path / "m.mp4", [a * f, b * f, 0, c * f, d * f, 0, 0, 0, 1 << 30])
    plain = decode_video_pyav(str(tmp_path / "plain.mp4"), Sampling(frames=1), same)
    got = decode_video_pyav(str(tmp_path / "m.mp4"), Sampling(frames=1), same)
    want = _displayed(np.asarray(plain.images[0]), a, b, c, d)
    assert np.array_equal(np.asarray(got.images[0]), want)
    assert (got.info["height"], got.info["width"]) == want.shape[:2]


def test_a_track_ffmpeg_has_no_decoder_for_is_unsupported(tmp_path):
    """A `dav1` (Dolby Vision AV1) sample entry, which this FFmpeg does not decode, failed as
    `AttributeError: 'VideoStream' object has no attribute 'width'`; it is `unsupported`, saying so."""
    from gemma4enc.media.frames import DecodeError
    from gemma4enc.media.video import decode_video
    from gemma4enc.options import Sampling

    _with_matrix(tmp_path / "plain.mp4", None)
    data = (tmp_path / "plain.mp4").read_bytes()
    at = data.rfind(b"avc1")  # the sample entry (the first is ftyp's brand)
    (tmp_path / "dav1.mp4").write_bytes(data[:at] + b"dav1" + data[at + 4:])
    with pytest.raises(DecodeError) as e:
        decode_video(str(tmp_path / "dav1.mp4"), Sampling(frames=2))
    assert e.value.status == "unsupported" and "no decoder" in str(e.value)
