"""The cosine of pooled vectors between a photo and its near copies, against distinct photos: what
`search --duplicates --threshold` should be (issue 37, docs/search.md).

    python benchmarks/thresholds.py --photos ~/Pictures/sample --videos ~/Videos/sample \
        --model google/gemma-4-e2b-it --json t.json
    python benchmarks/thresholds.py --demo        # the mechanism only: a tiny RANDOM checkpoint
    python benchmarks/thresholds.py --demo --photos tests/data/real/*.jpg --n-videos 0  # random tower

For each photo (up to --n), it writes four near copies: resized to half, re-compressed as JPEG
quality 60, cropped by 5 % (2.5 % off each side), flipped left-right. For each video (up to
--n-videos), it writes one re-encoded copy: every frame decoded, scaled to half size and encoded
again with another codec at a low quality (VP9 at crf 45 where PyAV has libvpx-vp9, else MPEG-4
Part 2, else H.264 at crf 35). Originals and copies go into one output folder through
`gemma4enc encode` (the model's settings, on --device; --encode-args adds options, e.g.
`--frames 8`), then it reports per transformation the cosines of original vs copy (min, 5th
percentile, median), over every pair of distinct photos and of distinct videos (median, 99th
percentile, max), and the threshold halfway between the lowest copy and the highest distinct pair.

--demo makes the checkpoint gemma4enc's tiny random one; the photos and videos are generated
scenes unless --photos / --videos name real ones. With --demo the numbers say nothing about
Gemma 4, only how the mechanism behaves.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

TRANSFORMS = ("resized 50%", "jpeg q60", "cropped 5%", "flipped")
SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff", ".heic", ".mpo"}
VIDEO_SUFFIXES = {".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi", ".mts", ".3gp"}


def scene(seed: int, size=(640, 480)):
    """A generated stand-in photo: a gradient sky, ellipses and boxes of random colours, noise."""
    from PIL import Image, ImageDraw, ImageFilter

    rng = np.random.default_rng(seed)
    w, h = size
    top, bottom = rng.integers(0, 256, 3), rng.integers(0, 256, 3)
    t = np.linspace(0, 1, h)[:, None, None]
    sky = (top * (1 - t) + bottom * t).repeat(w, 1)
    image = Image.fromarray(sky.astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(rng.integers(4, 12)):
        x0, y0 = rng.integers(0, w), rng.integers(0, h)
        x1, y1 = x0 + rng.integers(20, w // 2), y0 + rng.integers(20, h // 2)
        shape = draw.ellipse if rng.random() < 0.5 else draw.rectangle
        shape((x0, y0, x1, y1), fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
    image = image.filter(ImageFilter.GaussianBlur(1.5))
    noisy = np.asarray(image).astype(int) + rng.integers(-12, 12, (h, w, 3))
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))


def copies(image):
    """The four near copies of a PIL image, by transformation name."""
    import io

    from PIL import Image, ImageOps

    w, h = image.size
    buf = io.BytesIO()
    image.convert("RGB").save(buf, "JPEG", quality=60)
    dx, dy = round(w * 0.025), round(h * 0.025)
    return {
        "resized 50%": image.resize((max(1, w // 2), max(1, h // 2)), Image.LANCZOS),
        "jpeg q60": Image.open(io.BytesIO(buf.getvalue())).convert("RGB"),
        "cropped 5%": image.crop((dx, dy, w - dx, h - dy)),
        "flipped": ImageOps.mirror(image),
    }


def scene_video(path: Path, seed: int, frames: int = 48, fps: int = 24, size=(320, 240)) -> None:
    """A generated stand-in video: a window panning across a scene twice its width while a disc
    crosses it, H.264 yuv420p; distinct seeds give distinct scenes."""
    import av
    from PIL import ImageDraw

    w, h = size
    canvas = scene(10_000 + seed, (2 * w, h))
    rng = np.random.default_rng(seed)
    colour = tuple(int(c) for c in rng.integers(0, 256, 3))
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        for i in range(frames):
            x = round(i * w / max(1, frames - 1))
            frame = canvas.crop((x, 0, x + w, h))
            cx, cy = round(i * w / frames), round(h / 2 + h / 4 * np.sin(i / 6))
            ImageDraw.Draw(frame).ellipse((cx - 20, cy - 20, cx + 20, cy + 20), fill=colour)
            for packet in stream.encode(av.VideoFrame.from_image(frame)):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def recode_codec() -> tuple[str, str, dict]:
    """(codec, suffix, options) of the copy: a codec other than the usual H.264 where PyAV has one."""
    import av

    if "libvpx-vp9" in av.codecs_available:
        return "libvpx-vp9", ".webm", {"crf": "45", "b": "0", "deadline": "realtime", "cpu-used": "8"}
    if "mpeg4" in av.codecs_available:
        return "mpeg4", ".avi", {"b": "150k"}  # a low bitrate for half-size video: a coarse copy
    return "libx264", ".mp4", {"crf": "35", "preset": "veryfast"}


def reencode(src: Path, dst_stem: Path) -> Path:
    """A re-encoded copy of a video's first video stream: every frame scaled to half (even sides)
    and encoded with recode_codec() at the source's average frame rate; audio is dropped."""
    import fractions

    import av

    codec, suffix, options = recode_codec()
    dst = dst_stem.with_suffix(suffix)
    with av.open(str(src)) as inp, av.open(str(dst), "w") as out:
        vin = inp.streams.video[0]
        w, h = max(2, vin.codec_context.width // 4 * 2), max(2, vin.codec_context.height // 4 * 2)
        rate = vin.average_rate or vin.guessed_rate or fractions.Fraction(25)
        stream = out.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt, stream.options = w, h, "yuv420p", options
        for i, frame in enumerate(inp.decode(vin)):
            small = frame.reformat(width=w, height=h, format="yuv420p")
            # renumbered at the average rate, as a constant-rate transcode would
            small.pts, small.time_base = i, 1 / fractions.Fraction(rate)
            for packet in stream.encode(small):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return dst


def listed(paths, suffixes) -> list[Path]:
    """The files named, and the files (not walked deeper) of the folders named, with a suffix."""
    found = []
    for p in paths:
        found += sorted(q for q in p.iterdir() if q.is_file()) if p.is_dir() else [p]
    return [p for p in found if p.suffix.lower() in suffixes]


def stats(values, lows: bool) -> dict:
    v = np.asarray(values, np.float64)
    if lows:
        return {"n": len(v), "min": round(float(v.min()), 4), "p5": round(float(np.percentile(v, 5)), 4),
                "median": round(float(np.median(v)), 4)}
    return {"n": len(v), "median": round(float(np.median(v)), 4), "p99": round(float(np.percentile(v, 99)), 4),
            "max": round(float(v.max()), 4)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--photos", type=Path, nargs="+", help="real photos: files, or folders' files")
    parser.add_argument("--videos", type=Path, nargs="+", help="real videos: files, or folders' files")
    parser.add_argument("--model", help="the checkpoint encode uses (a hub id or a folder)")
    parser.add_argument("--demo", action="store_true",
                        help="tiny random checkpoint; generated scenes unless --photos / --videos")
    parser.add_argument("--n", type=int, default=50, help="photos at most (0: none)")
    parser.add_argument("--n-videos", type=int, default=5, help="videos at most (0: none)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--encode-args", default="", help="more `gemma4enc encode` options, one string")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not args.demo and not ((args.photos or args.videos) and args.model):
        parser.error("give --photos and/or --videos, and --model (a real checkpoint); or --demo")
    if args.demo and args.model:
        parser.error("--demo builds its own checkpoint: leave out --model")
    from PIL import Image

    with tempfile.TemporaryDirectory(prefix="gemma4enc-thresholds-") as tmp:
        tmp = Path(tmp)
        media = tmp / "media"
        media.mkdir()
        if args.demo:
            from gemma4enc.dev.demo import build

            model = tmp / "tiny-gemma4"
            build(model, seed=0)
        else:
            model = args.model
        if args.photos:
            files = listed(args.photos, SUFFIXES)[: args.n]
            sources = [(p.stem, Image.open(p).convert("RGB")) for p in files]
        else:
            sources = [(f"scene{i:03d}", scene(i)) for i in range(args.n if args.demo else 0)]
        names = []
        for stem, image in sources:
            image.save(media / f"{stem}.png")
            for t, copy in copies(image).items():
                copy.save(media / f"{stem}~{t.replace(' ', '_').replace('%', 'pc')}.png")
            names.append(stem)
        if args.videos:
            clips = listed(args.videos, VIDEO_SUFFIXES)[: args.n_videos]
        else:
            clips = []
            for i in range(args.n_videos if args.demo else 0):
                scene_video(tmp / f"clip{i:03d}.mp4", seed=i)
                clips.append(tmp / f"clip{i:03d}.mp4")
        videos = []  # (original's name, copy's name) in media
        for i, clip in enumerate(clips):
            original = media / f"v{i:03d}-{clip.name}"
            original.write_bytes(clip.read_bytes())
            videos.append((original.name, reencode(original, media / f"v{i:03d}~reencoded").name))
        out = tmp / "out"
        cmd = [sys.executable, "-m", "gemma4enc", "encode", str(media), "-o", str(out), "--model", str(model),
               "--device", args.device, "-q", *args.encode_args.split()]
        subprocess.run(cmd, check=True)
        import gemma4enc

        emb = gemma4enc.open(out, "numpy")
        unit = {}
        for path in emb:
            v = np.asarray(emb.pooled(path), np.float32)
            unit[Path(path).name] = v / np.linalg.norm(v)
    table, copied, distinct = {}, [], []
    if names:
        for t in TRANSFORMS:
            tag = t.replace(" ", "_").replace("%", "pc")
            table[t] = stats([unit[f"{s}.png"] @ unit[f"{s}~{tag}.png"] for s in names], lows=True)
        copied += list(TRANSFORMS)
    if videos:
        table["re-encoded video"] = stats([unit[a] @ unit[b] for a, b in videos], lows=True)
        copied.append("re-encoded video")
    originals = {"distinct photos": [f"{s}.png" for s in names],
                 "distinct videos": [a for a, _ in videos]}
    for row, keys in originals.items():
        if len(keys) > 1:
            pairs = itertools.combinations(keys, 2)
            table[row] = stats([unit[a] @ unit[b] for a, b in pairs], lows=False)
            distinct.append(row)
    if not copied:
        sys.exit("thresholds: no photos and no videos to compare")
    lowest = min(table[t]["min"] for t in copied)
    highest = max((table[d]["max"] for d in distinct), default=None)
    report = {"model": "tiny random demo checkpoint (NOT Gemma 4)" if args.demo else str(args.model),
              "photos": list(map(str, files)) if args.photos else "generated scenes" if names else None,
              "videos": list(map(str, clips)) if args.videos else "generated clips" if videos else None,
              "video_copy": "half size, " + recode_codec()[0] if videos else None,
              "n": len(names), "n_videos": len(videos), "table": table,
              "separable": None if highest is None else bool(lowest > highest),
              "threshold": None if highest is None else round((lowest + highest) / 2, 4)}
    print("| pair | n | min | p5 | median | p99 | max |\n|---|---|---|---|---|---|---|")
    for name, row in table.items():
        print(f"| {name} | {row['n']} | {row.get('min', '')} | {row.get('p5', '')} | {row['median']} | "
              f"{row.get('p99', '')} | {row.get('max', '')} |")
    print(json.dumps({k: v for k, v in report.items() if k != "table"}))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
