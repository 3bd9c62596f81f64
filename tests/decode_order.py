"""Rows of decode_image for files decoded alone and after other files, in processes whose Pillow
has opened nothing before (run in a spawned interpreter: the test process's Pillow has).

Pillow's plugin registry only grows as files are opened, so a process that decoded a `.tga` is
in a different state from one that did not; each "alone" row comes from a fork of the fresh
process, each sequence from another fork.

The forks are made here by hand, from the main thread, two at a time, not by a multiprocessing
Pool: a Pool forks its fresh workers from a handler thread while its other threads run, and a
child forked with a lock held elsewhere waits forever (seen once in CI: the whole run killed at
the test's bound with nothing said). Each child sends its rows one by one, so one that does not
finish within BOUND is killed and named with the file it was decoding."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import time
from multiprocessing.connection import wait

import numpy as np

MAX = 89_478_485
BOUND = 120.0  # seconds for one child; a sequence takes ~0.1 s on an idle machine
AT_ONCE = 2


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


def _send_rows(conn, paths: list[str]) -> None:
    for p in paths:
        conn.send(row(p))
    conn.close()


def in_forks(sequences: list[list[str]]) -> list[list[tuple]]:
    """Each sequence's rows, decoded in a fork of its own; a child that dies or outlives BOUND
    ends this with one line naming the file it had reached."""
    fork = mp.get_context("fork")
    results: list[list[tuple]] = [[] for _ in sequences]
    waiting = list(range(len(sequences)))[::-1]
    running: dict = {}  # reader -> (index, process, deadline)
    while waiting or running:
        while waiting and len(running) < AT_ONCE:
            i = waiting.pop()
            reader, writer = fork.Pipe(duplex=False)
            child = fork.Process(target=_send_rows, args=(writer, sequences[i]), daemon=True)
            child.start()
            writer.close()  # the child's copy is the only writer left: EOF when it ends
            running[reader] = (i, child, time.monotonic() + BOUND)
        soonest = min(deadline for _, _, deadline in running.values())
        for reader in wait(list(running), timeout=max(0.0, soonest - time.monotonic())):
            i, child, _ = running[reader]
            try:
                results[i].append(reader.recv())
            except EOFError:
                child.join()
                del running[reader]
                if len(results[i]) != len(sequences[i]):
                    stuck = sequences[i][len(results[i])]
                    raise SystemExit(f"a child died (exit {child.exitcode}) decoding {stuck}")
        for reader, (i, child, deadline) in list(running.items()):
            if time.monotonic() > deadline and not reader.poll():
                child.kill()
                stuck = sequences[i][len(results[i])]
                raise SystemExit(f"a child still decoding {stuck} after {BOUND:.0f} s "
                                 f"({len(results[i])} of {len(sequences[i])} done): killed")
    return results


def alone_and_after(paths: list[str], firsts: list[str]) -> tuple[list[tuple], dict[str, list[tuple]]]:
    """(each file's row decoded alone; for each of `firsts`: every file's row after it, in order)."""
    import PIL.Image

    assert len(PIL.Image.ID) <= 6, "this process has opened images already"  # preinit's at most
    alone = [rows[0] for rows in in_forks([[p] for p in paths])]
    after = in_forks([[first, *paths] for first in firsts])
    return alone, {first: rows[1:] for first, rows in zip(firsts, after)}


if __name__ == "__main__":  # python -m tests.decode_order < {"paths": [...], "firsts": [...]}
    import json
    import sys

    asked = json.load(sys.stdin)
    alone, after = alone_and_after(asked["paths"], asked["firsts"])
    json.dump({"alone": alone, "after": after}, sys.stdout)
