"""Rows of decode_image for files decoded alone and after other files, in processes whose Pillow
has opened nothing before (run in a spawned interpreter: the test process's Pillow has).

Pillow's plugin registry only grows as files are opened, so a process that decoded a `.tga` is
in a different state from one that did not; each "alone" row comes from a fork of the fresh
process, each sequence from another fork."""

from __future__ import annotations

import hashlib
import multiprocessing as mp

import numpy as np

MAX = 89_478_485


def row(path: str, fit: int | None = None) -> tuple:
    """What a file's manifest row would hold of its decode: status, size, a hash of the pixels."""
    from gemma4enc.media.frames import DecodeError
    from gemma4enc.media.image import decode_image

    try:
        frames = decode_image(path, MAX, fit)
    except DecodeError as e:
        return (e.status, str(e))
    image = frames.images[0]
    image = getattr(image, "image", image)  # --resize fast hands back a Fitted
    pixels = np.ascontiguousarray(np.asarray(image))
    return ("ok", frames.info["width"], frames.info["height"], hashlib.sha256(pixels.tobytes()).hexdigest())


def _sequence(paths: list[str]) -> list[tuple]:
    return [row(p) for p in paths]


def alone_and_after(paths: list[str], firsts: list[str]) -> tuple[list[tuple], dict[str, list[tuple]]]:
    """(each file's row decoded alone; for each of `firsts`: every file's row after it, in order)."""
    import PIL.Image

    assert len(PIL.Image.ID) <= 6, "this process has opened images already"  # preinit's at most
    fork = mp.get_context("fork")
    with fork.Pool(2, maxtasksperchild=1) as pool:  # one fresh fork per task
        alone = [r[0] for r in pool.map(_sequence, [[p] for p in paths], chunksize=1)]
        after = pool.map(_sequence, [[first, *paths] for first in firsts], chunksize=1)
    return alone, {first: rows[1:] for first, rows in zip(firsts, after)}


if __name__ == "__main__":  # python -m tests.decode_order < {"paths": [...], "firsts": [...]}
    import json
    import sys

    asked = json.load(sys.stdin)
    alone, after = alone_and_after(asked["paths"], asked["firsts"])
    json.dump({"alone": alone, "after": after}, sys.stdout)
