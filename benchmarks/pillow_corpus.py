"""Walk + decode over a folder of real image files (Pillow's own Tests/images), against what plain
Pillow reads: rows ok and failed, files Pillow reads that the walk skipped or the decode failed,
and pixels against transformers' convert_to_rgb. Figures go to docs/benchmarks.md.

    python benchmarks/pillow_corpus.py FOLDER [--resize exact|fast]

"Plain Pillow reads it": Image.open + load in a fork of a process that has opened nothing (so
no file's verdict depends on another's). Our rows come from one process, files in walk order,
as a worker decodes them.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import signal
import warnings

import numpy as np


def plain_pillow(path: str) -> str | None:
    """The format plain Pillow loads the file as, or None (fresh registry: a forked child)."""
    signal.alarm(30)
    warnings.simplefilter("ignore")
    try:
        from PIL import Image

        from gemma4enc.media.image import register_heif

        register_heif()
        with Image.open(path) as image:
            image.load()
            return image.format
    except BaseException:  # noqa: BLE001 - any failure: Pillow does not read it
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--resize", default="exact", choices=("exact", "fast"))
    args = parser.parse_args()
    root = os.path.abspath(args.folder)
    files = sorted(os.path.join(d, f) for d, _, names in os.walk(root) for f in names)
    with mp.get_context("fork").Pool(2, maxtasksperchild=1) as pool:
        readable = dict(zip(files, pool.map(plain_pillow, files, chunksize=1)))

    from PIL import Image, ImageOps
    from transformers.image_transforms import convert_to_rgb

    from gemma4enc.media.decode import decode_image
    from gemma4enc.media.discover import discover
    from gemma4enc.media.prepare import prepare
    from gemma4enc.options import Options

    warnings.simplefilter("ignore")
    items, skipped = discover([root])
    statuses, same, differ = collections.Counter(), 0, []
    failed_readable = []
    for item in items:
        done = prepare(item, Options(resize=args.resize))
        statuses[str(done.status)] += 1
        if done.status != "ok":
            if readable.get(item.path):
                failed_readable.append(os.path.relpath(item.path, root))
            continue
        with Image.open(item.path) as image:
            if image.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
                continue  # scaled on purpose, not clipped as the processor does
            theirs = convert_to_rgb(ImageOps.exif_transpose(image), return_numpy=True)
        ours = np.asarray(decode_image(item.path, Options().max_image_pixels).images[0])
        if ours.shape == theirs.shape and (ours == theirs).all():
            same += 1
        else:
            differ.append(os.path.relpath(item.path, root))
    walked = {i.path for i in items}
    left = collections.Counter(f for p, f in readable.items() if f and p not in walked)
    print(json.dumps({
        "files": len(files), "plain_pillow_reads": sum(1 for f in readable.values() if f),
        "walked": len(items), "skipped": skipped, "rows": dict(statuses),
        "pillow_reads_but_failed": failed_readable, "pillow_reads_but_not_walked": dict(left),
        "exact_pixels_equal_convert_to_rgb": same, "differ": differ,
    }, indent=1))


if __name__ == "__main__":
    main()
