"""Broken, hostile and odd inputs, made on the spot, with the status each must get."""

from __future__ import annotations

import io
import os
import shutil
import struct
import zlib
from pathlib import Path

import numpy as np
from PIL import Image
from pillow_heif import register_heif_opener

from gemma4enc.dev.demo import write_video

from .helpers import photo


def good_media(root: Path) -> Path:
    """A few valid photos and clips: what the bad files sit beside."""
    root.mkdir(parents=True, exist_ok=True)
    for i, (h, w) in enumerate([(240, 320), (200, 200), (90, 400), (300, 120)]):
        photo(h, w, seed=i).save(root / f"photo{i}.jpg", quality=92)
    photo(64, 48, seed=9).save(root / "small.png")
    write_video(root / "clip.mp4", frames=24)
    return root


def png_bomb(width: int, height: int) -> bytes:
    """A few hundred bytes whose header claims width × height pixels."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * (width + 1) * 4))
            + chunk(b"IEND", b""))


def audio_only_mp4(path: Path) -> None:
    import av

    with av.open(str(path), "w") as c:
        s = c.add_stream("aac", rate=16000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        frame.sample_rate = 16000
        for p in [*s.encode(frame), *s.encode()]:
            c.mux(p)


# every file of the corpus → the status its row must get (None: no row, it is a folder)
EXPECTED: dict[str, str | None] = {
    "zero.jpg": "empty", "cut.jpg": "decode_error", "cut.png": "decode_error", "cut.mp4": "decode_error",
    "noise.jpg": "unsupported", "noise.mp4": "decode_error", "page.jpg": "unsupported",
    "bomb.png": "too_large", "folder.jpg": None, "gone.png": "not_found", "loop.jpg": "unreadable",
    "pipe.jpg": "unsupported", "sound.mp4": "no_video_stream", "dot.png": "ok", "sliver.png": "ok",
    "deep.png": "ok", "cmyk.jpg": "ok", "anim.gif": "ok", "photo-named.mp4": "ok",
    os.fsdecode(b"latin1-\xe9t\xe9.jpg"): "ok", "new\nline.png": "ok", "phone.heic": "ok", "modern.avif": "ok",
}
# the containers, codecs and stills cameras, camcorders and downloads make (tests/test_camera_files.py
# checks their frames one by one; here each must get its status beside the hostile files)
CAMERA: dict[str, str] = {
    "cam-h264.mp4": "ok", "cam-hevc.mov": "ok", "cam-hevc10.mp4": "ok", "cam-h264.m4v": "ok", "cam-vp9.webm": "ok",
    "cam-av1.mkv": "ok", "cam-mpeg4.avi": "ok", "cam-mjpeg.avi": "ok", "cam-h264.ts": "ok", "cam-avchd.m2ts": "ok",
    "cam-hevc.mts": "ok", "cam-mpeg2.mpg": "ok", "cam-dvd.vob": "ok", "cam-phone.3gp": "ok", "cam-flash.flv": "ok",
    "cam-cut-faststart.mp4": "ok", "cam-cut.mkv": "ok",  # cut downloads: ok, sampled from what is there, truncated
    "cam-anim.webp": "ok", "cam-anim.png": "ok",  # animated WebP/APNG are images (their first frame), as GIF
    "cam-turned.tif": "ok", "cam-raw.ppm": "ok", "cam-screen.bmp": "ok",
}
EXPECTED |= CAMERA
TRUNCATED = {"cam-cut-faststart.mp4", "cam-cut.mkv"}  # ok rows that must say `truncated`


def camera_media(root: Path) -> None:
    """Write CAMERA's files into root: tiny clips (12 frames), stills of a few hundred pixels."""
    import av

    def clip(name, codec, fmt=None, pix_fmt="yuv420p", frames=12, options=None, size=(96, 64)):
        with av.open(str(root / name), "w", format=fmt, options=options or {}) as c:
            s = c.add_stream(codec, rate=12)
            s.width, s.height, s.pix_fmt = *size, pix_fmt
            if codec == "libx265":
                s.options = {"x265-params": "log-level=error"}
            if codec == "libsvtav1":
                s.options = {"preset": "12"}
            for i in range(frames):
                frame = av.VideoFrame.from_ndarray(np.asarray(photo(size[1], size[0], seed=i)), format="rgb24")
                for p in s.encode(frame.reformat(format=pix_fmt)):
                    c.mux(p)
            for p in s.encode():
                c.mux(p)

    clip("cam-h264.mp4", "libx264")
    clip("cam-hevc.mov", "libx265")
    clip("cam-hevc10.mp4", "libx265", pix_fmt="yuv420p10le")
    clip("cam-h264.m4v", "libx264", fmt="mp4")
    clip("cam-vp9.webm", "libvpx-vp9")
    clip("cam-av1.mkv", "libsvtav1", size=(128, 64))
    clip("cam-mpeg4.avi", "mpeg4")
    clip("cam-mjpeg.avi", "mjpeg", pix_fmt="yuvj420p")
    clip("cam-h264.ts", "libx264")
    clip("cam-avchd.m2ts", "libx264", fmt="mpegts")
    clip("cam-hevc.mts", "libx265", fmt="mpegts")
    clip("cam-mpeg2.mpg", "mpeg2video", fmt="mpeg")
    clip("cam-dvd.vob", "mpeg2video", fmt="vob")
    clip("cam-phone.3gp", "libx264", fmt="3gp")
    clip("cam-flash.flv", "libx264", fmt="flv")
    for name, fmt, options in (("cam-cut-faststart.mp4", "mp4", {"movflags": "faststart"}), ("cam-cut.mkv", None, None)):
        clip(name, "libx264", fmt=fmt, frames=40, options=options)
        data = (root / name).read_bytes()
        (root / name).write_bytes(data[: len(data) * 6 // 10])
    frames = [photo(40, 60, seed=i) for i in range(3)]
    frames[0].save(root / "cam-anim.webp", save_all=True, append_images=frames[1:], duration=100)
    frames[0].save(root / "cam-anim.png", save_all=True, append_images=frames[1:], duration=100)
    photo(60, 90).save(root / "cam-turned.tif", tiffinfo={274: 6})
    photo(60, 90).save(root / "cam-raw.ppm")
    photo(60, 90).save(root / "cam-screen.bmp")


# what a failed row's error must also say, where the status alone does not tell the cause
ERROR_SAYS = {"gone.png": "symlink", "pipe.jpg": "not a regular file", "bomb.png": "--max-image-pixels"}


def bad_media(root: Path, good: Path) -> dict[str, str | None]:
    """Write the corpus into root; return EXPECTED (file name → expected status)."""
    root.mkdir(parents=True, exist_ok=True)
    jpeg, png = io.BytesIO(), io.BytesIO()
    photo(200, 300).save(jpeg, "JPEG")
    photo(200, 300).save(png, "PNG")
    mp4 = (good / "clip.mp4").read_bytes()
    noise = np.random.default_rng(0)
    files = {
        "zero.jpg": b"",
        "cut.jpg": jpeg.getvalue()[: len(jpeg.getvalue()) // 2],
        "cut.png": png.getvalue()[: len(png.getvalue()) // 2],
        "cut.mp4": mp4[: len(mp4) // 2],
        "noise.jpg": noise.bytes(5000),
        "noise.mp4": noise.bytes(5000),
        "page.jpg": b"<!doctype html><html><body>Not found</body></html>",
        "bomb.png": png_bomb(100_000, 100_000),
    }
    for name, data in files.items():
        (root / name).write_bytes(data)
    (root / "folder.jpg").mkdir()
    (root / "gone.png").symlink_to(root / "nowhere.png")
    (root / "loop.jpg").symlink_to(root / "loop.jpg")
    os.mkfifo(root / "pipe.jpg")  # opening it would block forever
    audio_only_mp4(root / "sound.mp4")
    Image.new("RGB", (1, 1), (200, 10, 10)).save(root / "dot.png")
    Image.new("RGB", (20000, 1), (10, 200, 10)).save(root / "sliver.png")
    Image.fromarray((np.arange(96 * 64).reshape(64, 96) * 10).astype(np.uint16)).save(root / "deep.png")
    Image.new("CMYK", (120, 90), (10, 200, 30, 0)).save(root / "cmyk.jpg")
    frames = [Image.new("RGB", (40, 30), c) for c in ((255, 0, 0), (0, 255, 0))]
    frames[0].save(root / "anim.gif", save_all=True, append_images=frames[1:], duration=100, loop=0)
    shutil.copy(good / "photo0.jpg", root / "photo-named.mp4")  # a JPEG with a video's name
    shutil.copy(good / "photo1.jpg", os.fsencode(root) + b"/latin1-\xe9t\xe9.jpg")  # a name that is not UTF-8
    shutil.copy(good / "small.png", root / "new\nline.png")
    register_heif_opener()  # to write HEIC here (gemma4enc adds it to Pillow only once it decodes)
    photo(90, 160).save(root / "phone.heic")
    photo(90, 160).save(root / "modern.avif")
    camera_media(root)
    assert {os.fsdecode(n) for n in os.listdir(root)} == set(EXPECTED), "EXPECTED names every file"
    return EXPECTED
