"""The cosine of pooled vectors between a photo and its near copies, against distinct photos: what
`search --duplicates --threshold` should be (issue 37, docs/search.md).

    python benchmarks/thresholds.py --photos ~/Pictures/sample --model google/gemma-4-e2b-it --json t.json
    python benchmarks/thresholds.py --demo        # the mechanism only: a tiny RANDOM checkpoint

For each photo (up to --n), it writes four near copies: resized to half, re-compressed as JPEG
quality 60, cropped by 5 % (2.5 % off each side), flipped left-right; encodes originals and
copies into one output folder with `gemma4enc encode` (the model's settings, on --device), then
reports per transformation the cosines of original vs copy (min, 5th percentile, median) and over
every pair of distinct originals (median, 99th percentile, max), and the threshold halfway
between the lowest copy and the highest distinct pair when they separate.

With --demo the checkpoint is gemma4enc's tiny random one and the photos are generated scenes:
the numbers then say nothing about Gemma 4; they only show the script runs end to end.
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
SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff", ".heic"}


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


def stats(values, lows: bool) -> dict:
    v = np.asarray(values, np.float64)
    if lows:
        return {"n": len(v), "min": round(float(v.min()), 4), "p5": round(float(np.percentile(v, 5)), 4),
                "median": round(float(np.median(v)), 4)}
    return {"n": len(v), "median": round(float(np.median(v)), 4), "p99": round(float(np.percentile(v, 99)), 4),
            "max": round(float(v.max()), 4)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--photos", type=Path, help="a folder of real photos (its files, not walked deeper)")
    parser.add_argument("--model", help="the checkpoint encode uses (a hub id or a folder)")
    parser.add_argument("--demo", action="store_true", help="tiny random checkpoint, generated scenes")
    parser.add_argument("--n", type=int, default=50)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--encode-args", default="", help="more `gemma4enc encode` options, one string")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not args.demo and not (args.photos and args.model):
        parser.error("give --photos and --model (real photos, a real checkpoint), or --demo")
    from PIL import Image

    with tempfile.TemporaryDirectory(prefix="gemma4enc-thresholds-") as tmp:
        tmp = Path(tmp)
        media = tmp / "media"
        media.mkdir()
        if args.demo:
            from gemma4enc.dev.demo import build

            model = tmp / "tiny-gemma4"
            build(model, seed=0)
            sources = [(f"scene{i:03d}", scene(i)) for i in range(args.n)]
        else:
            model = args.model
            files = sorted(p for p in args.photos.iterdir() if p.suffix.lower() in SUFFIXES)[: args.n]
            sources = [(p.stem, Image.open(p).convert("RGB")) for p in files]
        names = []
        for stem, image in sources:
            image.save(media / f"{stem}.png")
            for t, copy in copies(image).items():
                copy.save(media / f"{stem}~{t.replace(' ', '_').replace('%', 'pc')}.png")
            names.append(stem)
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
    table = {}
    for t in TRANSFORMS:
        tag = t.replace(" ", "_").replace("%", "pc")
        table[t] = stats([unit[f"{s}.png"] @ unit[f"{s}~{tag}.png"] for s in names], lows=True)
    distinct = [unit[f"{a}.png"] @ unit[f"{b}.png"] for a, b in itertools.combinations(names, 2)]
    table["distinct photos"] = stats(distinct, lows=False)
    lowest = min(table[t]["min"] for t in TRANSFORMS)
    report = {"model": "tiny random demo checkpoint (NOT Gemma 4)" if args.demo else str(args.model),
              "photos": "generated scenes" if args.demo else str(args.photos), "n": len(names), "table": table,
              "separable": bool(lowest > table["distinct photos"]["max"]),
              "threshold": round((lowest + table["distinct photos"]["max"]) / 2, 4)}
    print("| pair | n | min | p5 | median | p99 | max |\n|---|---|---|---|---|---|---|")
    for name, row in table.items():
        print(f"| {name} | {row['n']} | {row.get('min', '')} | {row.get('p5', '')} | {row['median']} | "
              f"{row.get('p99', '')} | {row.get('max', '')} |")
    print(json.dumps({k: v for k, v in report.items() if k != "table"}))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
