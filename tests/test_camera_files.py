"""The files cameras, camcorders and downloads make, generated here with PyAV and Pillow: every
container's sampled frames are the ones asked for (each frame shows its own number as a bar
code), a cut file says so, and nothing is silently short."""

from __future__ import annotations

import fractions
from pathlib import Path

import numpy as np
import pytest

from gemma4enc.dev.demo import barcode_frame, read_barcode
from gemma4enc.media.decode import DecodeError, decode_video, snap_to_keyframes
from gemma4enc.media.discover import discover
from gemma4enc.media.prepare import prepare
from gemma4enc.options import Options, Sampling

FRAMES = 96
SIZE = (192, 144)


def write_clip(path: Path, codec: str, frames: int = FRAMES, gop: int = 24, bframes: int = 2,
               container_options: dict | None = None, pix_fmt: str = "yuv420p") -> Path:
    """A clip whose frame i shows i, in the container its name says (.ts, .m2ts, .mpg, .vob, …)."""
    import av

    formats = {".mts": "mpegts", ".m2ts": "mpegts", ".mpg": "mpeg", ".vob": "vob"}
    with av.open(str(path), "w", format=formats.get(path.suffix), options=container_options or {}) as container:
        stream = container.add_stream(codec, rate=25)
        stream.width, stream.height, stream.pix_fmt = *SIZE, pix_fmt
        if codec in ("libx264", "libx265"):
            stream.options = {"g": str(gop), "bf": str(bframes), "sc_threshold": "0"} if codec == "libx264" else {
                "x265-params": f"keyint={gop}:min-keyint={gop}:bframes={bframes}:log-level=error"}
        elif codec in ("mpeg2video", "mpeg4"):
            stream.codec_context.gop_size = gop
            stream.codec_context.max_b_frames = bframes
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(barcode_frame(i, *SIZE), format="rgb24")
            for packet in stream.encode(frame.reformat(format=pix_fmt)):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def read(frames) -> list[int]:
    return [read_barcode(image) for image in frames.images]


CAMCORDER = {  # name -> codec: MPEG-TS as camcorders, DVB and HLS write it; MPEG-PS as DVDs
    "h264.ts": "libx264", "hevc.mts": "libx265", "avchd.m2ts": "libx264", "dvb.ts": "mpeg2video",
    "dvd.mpg": "mpeg2video", "dvd.vob": "mpeg2video", "long-gop.ts": "libx264", "mpeg4.avi": "mpeg4",
}


@pytest.fixture(scope="module")
def camcorder(tmp_path_factory):
    d = tmp_path_factory.mktemp("camcorder")
    for name, codec in CAMCORDER.items():
        write_clip(d / name, codec, gop=250 if name.startswith("long") else 24)
    return d


@pytest.mark.parametrize("name", sorted(CAMCORDER))
@pytest.mark.parametrize("frames", [8, 32])
def test_every_sampled_frame_of_a_camcorder_file_is_the_one_asked_for(camcorder, name, frames):
    got = decode_video(str(camcorder / name), Sampling(frames=frames), "pyav")
    asked = Sampling(frames=frames).indices(FRAMES)
    assert got.info["total_frames"] == FRAMES
    assert got.indices == asked and read(got) == asked
    assert not got.info["missing"] and not got.info["truncated"]


@pytest.mark.parametrize("name", ["h264.ts", "hevc.mts", "dvb.ts"])
def test_keyframe_seek_in_mpeg_ts(camcorder, name):
    import av

    with av.open(str(camcorder / name)) as container:
        packets = [p for p in container.demux(video=0) if p.pts is not None and p.size]
    order = sorted(p.pts for p in packets)
    keys = sorted(order.index(p.pts) for p in packets if p.is_keyframe)
    got = decode_video(str(camcorder / name), Sampling(frames=8), "pyav", seek="keyframe")
    assert got.indices == snap_to_keyframes(Sampling(frames=8).indices(FRAMES), keys)
    assert read(got) == got.indices


def test_camcorder_containers_are_walked(camcorder):
    items, skipped = discover([str(camcorder)])
    assert sorted(Path(i.path).name for i in items) == sorted(CAMCORDER) and skipped == 0
    assert {i.kind for i in items} == {"video"}


def test_a_seek_that_cannot_land_still_delivers_every_frame(camcorder, monkeypatch):
    """Where no seek reaches a keyframe, one pass from the start finds the frames (no row short)."""
    from gemma4enc.media import videoindex

    monkeypatch.setattr(videoindex, "packets_from", lambda *args: iter(()))
    got = decode_video(str(camcorder / "h264.ts"), Sampling(frames=8), "pyav")
    assert read(got) == got.indices == Sampling(frames=8).indices(FRAMES) and not got.info["missing"]


def test_a_frame_that_cannot_be_decoded_is_not_a_frame_and_the_row_says_so(tmp_path):
    """MJPEG: every frame its own packet; one sampled frame's bytes zeroed cannot decode. A plain
    decode outputs 39 frames: the clip is numbered and sampled as those (issue 46: it was 40 with
    that one "missing"), and the row counts the packet that did not decode."""
    import av

    path = write_clip(tmp_path / "cam.avi", "mjpeg", frames=40, pix_fmt="yuvj420p")
    with av.open(str(path)) as container:
        packets = [(p.pts, p.pos, p.size) for p in container.demux(video=0) if p.size]
    asked = Sampling(frames=8).indices(40)
    victim = asked[3]
    _, pos, size = sorted(packets)[victim]
    data = bytearray(path.read_bytes())
    data[pos: pos + size] = bytes(size)
    path.write_bytes(bytes(data))
    (item,), _ = discover([str(path)])
    done = prepare(item, Options(sampling=Sampling(frames=8), video_backend="pyav"))
    assert done.status == "ok" and "missing_frames" not in done.video
    assert done.video["undecodable_packets"] == 1 and done.video["total_frames"] == 39
    assert done.video["frame_indices"] == Sampling(frames=8).indices(39) and len(done.patches) == 8


def faststart_mp4(path: Path, frames: int = FRAMES) -> Path:
    return write_clip(path, "libx264", frames, container_options={"movflags": "faststart"})


@pytest.mark.parametrize("name", ["clip.mp4", "clip.mov", "clip.mkv", "clip.webm"])
def test_a_video_cut_at_60_percent_is_flagged_and_sampled_from_what_is_there(tmp_path, name):
    codec = "libvpx-vp9" if name.endswith("webm") else "libx264"
    whole = write_clip(tmp_path / name, codec, container_options={"movflags": "faststart"}
                       if name.endswith(("mp4", "mov")) else None)
    cut = tmp_path / f"cut-{name}"
    data = whole.read_bytes()
    cut.write_bytes(data[: len(data) * 6 // 10])
    (full_item,), _ = discover([str(whole)])
    (cut_item,), _ = discover([str(cut)])
    full = prepare(full_item, Options(sampling=Sampling(frames=8), video_backend="pyav"))
    short = prepare(cut_item, Options(sampling=Sampling(frames=8), video_backend="pyav"))
    assert full.status == short.status == "ok"
    assert "truncated" not in full.video and full.video["total_frames"] == FRAMES
    assert short.video["truncated"] is True
    there = short.video["total_frames"]
    assert FRAMES * 0.3 < there < FRAMES * 0.7
    assert short.video["frame_indices"] == Sampling(frames=8).indices(there) and "missing_frames" not in short.video
    assert short.video["duration"] < full.video["duration"] * 0.7


def test_an_mp4_cut_before_its_index_is_a_decode_error(tmp_path):
    whole = write_clip(tmp_path / "clip.mp4", "libx264")  # moov at the end, as cameras write it
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size * 6 // 10])
    with pytest.raises(DecodeError) as e:
        decode_video(str(cut), Sampling(frames=8), "auto")
    assert e.value.status == "decode_error"


def test_an_audio_track_longer_than_the_video_is_not_a_cut(tmp_path):
    """MKV states the file's length, not the video's: a longer audio track must not read as a cut."""
    import av

    path = tmp_path / "talk.mkv"
    with av.open(str(path), "w") as container:
        video = container.add_stream("libx264", rate=25)
        video.width, video.height, video.pix_fmt = *SIZE, "yuv420p"
        audio = container.add_stream("aac", rate=16000)
        for i in range(25):
            for p in video.encode(av.VideoFrame.from_ndarray(barcode_frame(i, *SIZE), format="rgb24")):
                container.mux(p)
        for p in video.encode():
            container.mux(p)
        for k in range(16000 * 3 // 1024):  # three seconds of silence beside one second of video
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
            frame.sample_rate, frame.pts, frame.time_base = 16000, k * 1024, fractions.Fraction(1, 16000)
            for p in audio.encode(frame):
                container.mux(p)
        for p in audio.encode():
            container.mux(p)
    got = decode_video(str(path), Sampling(frames=4), "pyav")
    assert read(got) == got.indices == [0, 6, 12, 18] and not got.info["truncated"]


INVERSE = {2: 2, 3: 3, 4: 4, 5: 5, 6: 8, 7: 7, 8: 6}  # the orientation whose turn undoes this one's


@pytest.mark.parametrize("fmt", ["TIFF", "JPEG", "PNG", "WEBP"])
@pytest.mark.parametrize("orientation", range(1, 9))
def test_a_photo_stored_turned_comes_out_upright_on_both_resize_paths(tmp_path, fmt, orientation):
    """Stored as a camera does (the sensor's way up plus an EXIF orientation): upright, and the row says the upright size."""
    from PIL import Image

    from gemma4enc.media.decode import UPRIGHT

    upright = np.zeros((240, 400, 3), np.uint8)
    upright[:120, :200] = (250, 250, 250)  # a white top-left quarter and a red bottom edge tell every turn apart
    upright[200:, :, 0] = 250
    shown = Image.fromarray(upright)
    stored = shown.transpose(UPRIGHT[INVERSE[orientation]]) if orientation > 1 else shown
    path = tmp_path / f"o{orientation}.{fmt.lower()}"
    if fmt == "TIFF":
        stored.save(path, tiffinfo={274: orientation})
    else:
        exif = Image.Exif()
        exif[0x0112] = orientation
        stored.save(path, exif=exif, **({"quality": 95} if fmt != "PNG" else {}))
    (item,), _ = discover([str(path)])
    for resize in ("fast", "exact"):
        done = prepare(item, Options(resize=resize, image_tokens=70))
        assert done.status == "ok" and (done.width, done.height) == (400, 240), (resize, done.width, done.height)
    from gemma4enc.media.decode import decode_image

    fitted = decode_image(str(path), None, 70).images[0].image
    want = np.asarray(shown.resize(fitted.size, Image.Resampling.BICUBIC), np.float64)
    assert np.abs(np.asarray(fitted, np.float64) - want).mean() < 6


def _keyframes(path) -> list[int]:
    import av

    with av.open(str(path)) as container:
        packets = [p for p in container.demux(video=0) if p.pts is not None and p.size]
    order = sorted(p.pts for p in packets)
    return sorted(order.index(p.pts) for p in packets if p.is_keyframe)


@pytest.mark.parametrize("backend", ["pyav", "decord"])
def test_nearest_seek_moves_only_the_samples_near_a_keyframe(tmp_path, backend):
    """A phone-like clip (1.2 s GOP at 25 fps, no B-frames), 8 samples 1.5 s apart: the bound is
    min(0.5 s, 1.5 s / 4) = 0.375 s, 9.4 frames. Sample by sample: 0, 150 are keyframes; 37 → 30
    (-7 frames), 112 → 120 (+8), 187 → 180 (-7), 262 → 270 (+8) move; 75 and 225 lie 15 frames
    (0.6 s) from both neighbours and stay as asked."""
    if backend == "decord":
        pytest.importorskip("decord")
    path = write_clip(tmp_path / "phone.mp4", "libx264", frames=300, gop=30, bframes=0)
    assert _keyframes(path) == list(range(0, 300, 30))
    asked = Sampling(frames=8).indices(300)
    assert asked == [0, 37, 75, 112, 150, 187, 225, 262]
    got = decode_video(str(path), Sampling(frames=8), backend, seek="nearest")
    assert got.indices == [0, 30, 75, 120, 150, 180, 225, 270]
    assert read(got) == got.indices and got.timestamps == [i / 25 for i in got.indices]
    shifts = [abs(t - a) for t, a in zip(got.indices, asked)]
    assert max(shifts) * (1 / 25) <= 0.375  # no sample moved further than the bound
    tight = decode_video(str(path), Sampling(frames=8), backend, seek="nearest:0.2")  # 5 frames: none moves
    assert tight.indices == asked and read(tight) == asked


def test_nearest_seek_keeps_samples_apart_on_a_short_clip(tmp_path):
    """32 samples of 96 frames: a quarter spacing is under a frame, so every sample is the one asked."""
    path = write_clip(tmp_path / "short.mp4", "libx264", gop=12, bframes=2)
    got = decode_video(str(path), Sampling(frames=32), "pyav", seek="nearest")
    assert got.indices == Sampling(frames=32).indices(FRAMES) and read(got) == got.indices


def test_nearest_seek_reaches_the_row_and_the_settings(tmp_path):
    path = write_clip(tmp_path / "phone.mp4", "libx264", frames=300, gop=30, bframes=0)
    (item,), _ = discover([str(path)])
    done = prepare(item, Options(sampling=Sampling(frames=8), seek="nearest:0.5", video_backend="pyav"))
    assert done.video["frame_indices"] == [0, 30, 75, 120, 150, 180, 225, 270] and len(done.patches) == 8
    assert Options(seek="nearest:0.5").fingerprint()["seek"] == "nearest:0.5"
    for bad in ("nearest:0", "nearest:-1", "nearest:x", "near"):
        with pytest.raises(Exception, match="--seek"):
            Options(seek=bad)


def _stream_seconds(path) -> float:
    """The video stream's length as PyAV gives it: the stream's duration, or (MKV/WebM, which keep
    it per track as a tag) the DURATION tag FFmpeg's Matroska demuxer reads."""
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        if stream.duration:
            return float(stream.duration * stream.time_base)
        h, m, s = stream.metadata["DURATION"].split(":")
        return int(h) * 3600 + int(m) * 60 + float(s)


@pytest.mark.parametrize("name", ["clip.mp4", "clip.mov", "clip.mkv", "clip.webm", "clip.ts", "mpeg4.avi",
                                  "dvd.mpg"])
@pytest.mark.parametrize("backend", ["pyav", "decord"])
def test_duration_is_the_streams_not_the_last_frames_start(tmp_path, name, backend):
    """132 frames at 25 fps last 5.28 s; the last one starts at 5.24 s."""
    if backend == "decord":
        pytest.importorskip("decord")
    codec = {"webm": "libvpx-vp9", "avi": "mpeg4", "mpg": "mpeg2video"}.get(name.rsplit(".", 1)[1], "libx264")
    path = write_clip(tmp_path / name, codec, frames=132)
    expected = _stream_seconds(path)
    if name.endswith(".mpg"):  # MPEG-PS states no length: FFmpeg's estimate from sampled stamps is short
        assert expected < 5.24
        expected = 5.28
    assert expected == pytest.approx(5.28, abs=1e-6)
    got = decode_video(str(path), Sampling(frames=4), backend)
    assert got.info["duration"] == pytest.approx(expected, abs=1e-6)
    assert got.info["total_frames"] == 132  # the last starts at 5.24 s, what the row said before


def test_a_cut_file_s_duration_is_what_is_there(tmp_path):
    whole = write_clip(tmp_path / "clip.mkv", "libx264")
    cut = tmp_path / "cut.mkv"
    data = whole.read_bytes()
    cut.write_bytes(data[: len(data) * 6 // 10])
    got = decode_video(str(cut), Sampling(frames=4), "pyav")
    assert got.info["truncated"] and got.info["duration"] == pytest.approx(got.info["total_frames"] / 25, abs=1e-6)


def test_a_long_clip_that_seeks_is_renumbered_where_a_packet_fails(tmp_path):
    """Past video.WHOLE_FRAMES a clip seeks, decoding only what its samples need. A sampled MJPEG
    frame zeroed: the seek meets the refused packet, and the clip is numbered as a full decode
    outputs it (1,099 frames), not by its 1,100 packets."""
    import av

    from gemma4enc.media import video

    frames = video.WHOLE_FRAMES + 140
    path = write_clip(tmp_path / "long.avi", "mjpeg", frames=frames, pix_fmt="yuvj420p")
    with av.open(str(path)) as container:
        packets = [(p.pts, p.pos, p.size) for p in container.demux(video=0) if p.size]
    victim = Sampling(frames=8).indices(frames)[5]
    _, pos, size = sorted(packets)[victim]
    data = bytearray(path.read_bytes())
    data[pos: pos + size] = bytes(size)
    path.write_bytes(bytes(data))
    got = decode_video(str(path), Sampling(frames=8), "pyav")
    assert got.info["total_frames"] == frames - 1 and got.info["undecodable"] == 1
    expected = [i if i < victim else i + 1 for i in Sampling(frames=8).indices(frames - 1)]
    assert read(got) == expected  # each sample the frame a plain decode numbers so (its bar code)
    assert got.indices == Sampling(frames=8).indices(frames - 1)


def test_keyframe_seek_in_hevc_with_long_gops_gives_every_keyframe(tmp_path):
    """HEVC as x265 writes it by default (open GOPs, B-frames), keyframes 250 apart: with only
    keyframes decoded, the decoder held the first and dropped it unshown at the next keyframe (its
    sample "missing": 1 frame of 2); each wanted keyframe is now drained as it decodes."""
    import av

    frames, path = 300, tmp_path / "long-gop.mp4"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx265", rate=30)
        stream.width, stream.height, stream.pix_fmt = *SIZE, "yuv420p"
        stream.options = {"x265-params": "keyint=250:bframes=3:log-level=error", "preset": "ultrafast"}
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(barcode_frame(i, *SIZE), format="rgb24")
            for packet in stream.encode(frame.reformat(format="yuv420p")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    keys = _keyframes(path)
    assert keys == [0, 250]
    got = decode_video(str(path), Sampling(frames=8), "pyav", seek="keyframe")
    assert got.indices == keys == snap_to_keyframes(Sampling(frames=8).indices(frames), keys)
    assert read(got) == keys and not got.info["missing"]
