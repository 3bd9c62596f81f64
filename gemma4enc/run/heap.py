"""The process heap: give glibc's free pages back to the OS between windows of a run.

Each window frees large buffers (decoded pixels, the tower's temporaries) that glibc placed on
the heap between small ones that live on (the tokens a shard collects until it is written).
Without a trim the freed holes stay resident (docs/benchmarks/memory.md, "heap holes").
"""

from __future__ import annotations

import ctypes
import ctypes.util


def give_back_free_memory(slack: int = 256 << 20) -> None:
    """Once a window is done: if the heap holds more than `slack` bytes free, hand its free pages
    back to the OS (glibc's malloc_trim).

    The slack keeps a run of large photos from trimming (and re-faulting the tower's pages)
    every window. Nothing happens where there is no glibc."""
    if _LIBC is not None and _LIBC.mallinfo2().fordblks > slack:
        _LIBC.malloc_trim(0)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _libc():
    """glibc with malloc_trim and mallinfo2 (2.33 and later), or None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
        libc.malloc_trim  # noqa: B018 - present, or AttributeError
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc()
