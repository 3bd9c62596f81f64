"""Which Pillow format reads a file, asked in an order fixed per extension, not per process.

Image.open tries formats in the order their plugins were imported, and Pillow 13 imports a
plugin when a file of its extension is first opened: after a `.tga` the TGA reader (which has no
magic bytes to check, so it takes whatever header parses) stood ahead of ICO and read an `.ico`
as a broken TGA. Here every plugin is loaded once, and each file is opened with the format its
extension names first, then those that check magic bytes, then those that cannot (last, so they
never take a file another format recognises): a file's row is the same whatever came before it.
"""

from __future__ import annotations

import functools
import os

from PIL import Image

from .kinds import PILLOW_LEFT_OUT


def _order() -> tuple[tuple[str, ...], dict[str, str]]:
    """(every format Pillow can open here, in the fixed order; extension -> its format)."""
    Image.init()  # every plugin: OPEN and EXTENSION no longer grow as files are opened
    return _fixed(tuple(Image.OPEN))  # one a set of formats: one registered later (HEIF) joins


@functools.cache
def _fixed(registered: tuple[str, ...]) -> tuple[tuple[str, ...], dict[str, str]]:
    formats = [f for f in registered if f not in PILLOW_LEFT_OUT]
    # magic-checking formats first, by name; those without a check (TGA, IM, PCD…) after them
    formats.sort(key=lambda f: (Image.OPEN[f][1] is None, f))
    by_ext = {ext: f for ext, f in Image.registered_extensions().items() if f in Image.OPEN}
    by_ext[".mpo"] = "JPEG"  # MPO is read by the JPEG reader (it hands back an MpoImageFile)
    return tuple(formats), by_ext


def formats_for(name: str) -> list[str]:
    """The formats to try for a file called `name`: its extension's first."""
    formats, by_ext = _order()
    first = by_ext.get(os.path.splitext(name)[1].lower())
    return [first, *(f for f in formats if f != first)] if first in formats else list(formats)


def open_image(source) -> Image.Image:
    """Image.open with the fixed order; `source` a path or a file object (named by its .name)."""
    name = source if isinstance(source, str) else getattr(source, "name", None)
    return Image.open(source, formats=formats_for(name if isinstance(name, str) else ""))


def claimed(head: bytes) -> bool:
    """Whether a format Pillow reads recognises these first bytes as its own (its magic check):
    such a file that still cannot be opened is a corrupt image, not an unsupported format."""
    formats, _ = _order()
    for f in formats:
        accept = Image.OPEN[f][1]
        try:
            said = accept(head) if accept is not None else False
        except Exception:  # noqa: BLE001 - a check that trips on a short head says no
            continue
        if said and not isinstance(said, str):  # a str: "recognised, but cannot be read here"
            return True
    return False
