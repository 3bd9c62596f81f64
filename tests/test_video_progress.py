"""Seeking never loops (issue 46): a decoding run that gives back frames from before its own
keyframe (an open GOP's leading pictures; a clip whose first flagged keyframe comes after frame 0,
as some VVC muxers write) once sent the sampler back to that same keyframe without end. Here a
stand-in decoder does exactly that on every seek; the sampler must end, with every target found."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

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

    def decoded(container, stream, skip, skip_mode, packets):
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
