"""What a found file is: an `Item` (path, kind, size, mtime, where the walk found it, or why it
cannot be read) and its kind, sniffed from its first bytes, else told by its extension."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

IMAGE_EXTS = {  # every extension of a still format Pillow reads (PILLOW_LEFT_OUT: those it does not)
    *(".jpg", ".jpeg", ".jpe", ".jfif", ".mpo", ".png", ".apng", ".gif", ".webp", ".bmp", ".dib"),
    *(".tif", ".tiff", ".avif", ".avifs", ".heic", ".heif", ".hif", ".heics", ".heifs", ".jxl"),
    *(".ico", ".cur"),
    *(".ppm", ".pgm", ".pbm", ".pnm", ".pfm", ".tga", ".icb", ".vda", ".vst", ".psd", ".dds"),
    *(".jp2", ".j2k", ".jpc", ".jpf", ".jpx", ".j2c", ".qoi", ".pcx", ".dcx", ".icns", ".blp"),
    *(".sgi", ".bw", ".rgb", ".rgba", ".fit", ".fits", ".xpm", ".xbm", ".im", ".msp", ".ras"),
    *(".pxr", ".pcd", ".ftc", ".ftu", ".gbr", ".fli", ".flc"),
}

# Formats Pillow registers that are neither walked nor tried (docs/commands.md lists them too);
# tests/test_formats.py checks this against the installed Pillow, so a new one is a decision
PILLOW_LEFT_OUT = {
    "EPS": "PostScript: Pillow reads it by running Ghostscript, an interpreter, on the file",
    "WMF": "WMF/EMF vector drawings: Pillow renders them only on Windows",
    "MPEG": "a video: Pillow reads only its header (.mpg/.mpeg go to the video decoders)",
    "BUFR": "a stub: Pillow reads nothing without a handler the application registers",
    "GRIB": "a stub: Pillow reads nothing without a handler the application registers",
    "HDF5": "a stub: Pillow reads nothing without a handler the application registers",
    "IPTC": "IPTC/NAA records (.iim): a newsroom wrapper with no sample or writer to test it",
    "FPX": "FlashPix: needs olefile, not a dependency",
    "MIC": "Microsoft Image Composer: needs olefile, not a dependency",
    "IMT": "no extension of its own and no magic bytes: nothing to know such a file by",
    "SPIDER": "no extension of its own and no magic bytes: nothing to know such a file by",
    "MCIDAS": "no extension of its own: a walk cannot tell it from any other file",
    "XVTHUMB": "no extension of its own: a walk cannot tell it from any other file",
}


# MPEG-TS has no magic bytes in its first 32 (a sync byte every 188 or, in .m2ts, 192): the name tells
VIDEO_EXTS = {
    ".mp4",
    ".m4v",
    ".mov",
    ".mkv",
    ".webm",
    ".avi",
    ".mpg",
    ".mpeg",
    ".ts",
    ".mts",
    ".flv",
    ".wmv",
    ".3gp",
    ".ogv",
    ".m2ts",
    ".m2t",
    ".vob",
    ".mod",
    ".tod",
    ".3g2",
    ".f4v",
    ".asf",
    ".mxf",
    ".dv",
    ".divx",
}


SNIFF_BYTES = 64  # enough for an ftyp box's compatible brands

ICO_CUR = (b"\x00\x00\x01\x00", b"\x00\x00\x02\x00")
JP2 = b"\x00\x00\x00\x0cjP  \r\n\x87\n"  # the JPEG 2000 file signature box
# the first bytes of PSD, DDS, QOI, ICNS, BLP (2 versions), JPEG 2000 codestreams, Sun raster,
# DCX, SGI (magic + storage + bytes per channel); formats whose magic is a short or textual
# (PNM's "P6", MSP, PCX, TGA: none) are known by their extension only, so no text file is taken
STILL_MAGIC = (
    *(b"8BPS\x00\x01", b"DDS |\x00\x00\x00", b"qoif", b"icns", b"BLP1", b"BLP2", b"\xffO\xffQ"),
    *(b"Y\xa6j\x95", b":\xdeh\xb1", *(b"\x01\xda" + bytes([s, c]) for s in (0, 1) for c in (1, 2))),
)


@dataclass(frozen=True, slots=True)  # slots: a million of them fit in ~100 MB
class Item:
    path: str  # absolute path, symlinks not resolved: the name the user knows
    kind: str  # "image" | "video" | "unknown"
    size: int  # bytes
    mtime_ns: int
    error: str | None = None  # set when the file could not even be looked at (broken link, no access)
    root: str | None = None  # the root folder it was found under (absolute), when found by walking
    rel: str | None = None  # its path relative to that root: how a moved or remounted root is recognised
    status: str | None = (
        None  # with `error`: the row's Status (discovery knows why, the worker does not guess)
    )


# ISO base media brands of still images and image sequences (HEIF, AVIF, JPEG-in-HEIF): an ftyp whose
# major brand, or one of its compatible brands, is one of these holds images, whatever else it lists
# (a HEIF with a blank or a `mif3` major brand, or `jpeg`, once went to the video decoder)
HEIF_BRANDS = {b"avif", b"avis", b"heic", b"heix", b"heim", b"heis", b"hevc", b"hevx", b"mif1", b"mif2",
               b"mif3", b"msf1", b"miaf", b"jpeg"}


def _heif(head: bytes) -> bool:
    """Whether an ftyp box (head[4:8] == b"ftyp") names an image brand, major or compatible."""
    size = int.from_bytes(head[:4], "big")
    end = min(len(head), size if size >= 16 else len(head))
    brands = [head[8:12]] + [head[i: i + 4] for i in range(16, end - 3, 4)]
    return any(b in HEIF_BRANDS for b in brands)


def sniff(head: bytes) -> str | None:
    """The kind a file's first bytes say, or None when they say nothing we know."""
    if head[:3] == b"\xff\xd8\xff" or head[:8] == b"\x89PNG\r\n\x1a\n" or head[:4] in (b"GIF8",):
        return "image"
    if head[:2] == b"BM" or head[:4] in (b"II*\x00", b"MM\x00*") or head[:4] in ICO_CUR:
        return "image"
    if head.startswith(STILL_MAGIC) or head[:12] == JP2 or head[:9] in (b"SIMPLE  =", b"/* XPM */"):
        return "image"
    if head[:4] == b"RIFF":
        return {b"WEBP": "image", b"AVI ": "video"}.get(head[8:12])
    if head[4:8] == b"ftyp":
        return "image" if _heif(head) else "video"
    if (
        head[:4] == b"\x1a\x45\xdf\xa3"
        or head[:3] == b"FLV"
        or head[:4] in (b"\x00\x00\x01\xba", b"\x00\x00\x01\xb3")
    ):
        return "video"
    if (
        head[:4] == b"OggS"
        or head[:16] == b"\x30\x26\xb2\x75\x8e\x66\xcf\x11\xa6\xd9\x00\xaa\x00\x62\xce\x6c"
    ):
        return "video"
    return None


def kind_of(path: str, head: bytes) -> str:
    """Bytes first; the extension is only a hint when the bytes are not recognised."""
    kind = sniff(head)
    if kind:
        return kind
    ext = os.path.splitext(path)[1].lower()
    if ext in IMAGE_EXTS:
        return "image"
    if ext in VIDEO_EXTS:
        return "video"
    return "unknown"


# (path, size, mtime_ns) → the kind its manifest row records, or None: such a file is not opened;
# or DONE: nothing is left to do for it, and it is not even kept (outdir.Unchanged counts it)
Known = Callable[[str, int, int], "str | None"]


DONE = object()  # a marker, compared by identity (no kind string can be it)


def ext_kind(path: str) -> str:
    ext = os.path.splitext(path)[1].lower()
    return "image" if ext in IMAGE_EXTS else "video" if ext in VIDEO_EXTS else "unknown"
