"""HEIC's primary image through FFmpeg's HEVC decoder (PyAV), for --resize fast: the tiles placed
by the file's own grid, cropped, turned, and converted to RGB as libheif does, at the smallest
size that holds the target. Only the plain case is taken (8-bit 4:2:0 HEVC, a known colour
matrix, transforms we know, no alpha plane); anything else returns None and pillow-heif decodes
the file. The primary item is the image, never a thumbnail item beside it.

PyAV exposes each grid tile as its own stream (stream.id is the HEIF item id) but not the grid
that joins them, so the item tree (pitm, iinf, iref/dimg, ipco/ipma) is read here from the meta
box, and the grid's size from pillow-heif's `info["tiling"]`, which libheif gives without decoding.
"""

from __future__ import annotations

import io
import struct
from fractions import Fraction

import numpy as np
from PIL import Image

from .patches import target_size

# properties of the primary item we understand; another one marked essential means "not ours"
KNOWN = {b"hvcC", b"ispe", b"colr", b"pixi", b"irot", b"imir", b"clap", b"auxC", b"rloc"}
# the auxC types of an alpha plane (HEVC's, and MPEG-B's that AVIF and newer libheif write)
ALPHA = {b"urn:mpeg:hevc:2015:auxid:1", b"urn:mpeg:mpegB:cicp:systems:auxiliary:alpha"}
# the nclx matrices we convert (Kr, Kb): BT.709, BT.470BG and BT.601 (the last two are the same)
MATRICES = {1: (0.2126, 0.0722), 5: (0.299, 0.114), 6: (0.299, 0.114)}


def _boxes(data: bytes, start: int, end: int):
    """(type, payload start, box end) of each box in data[start:end]."""
    at = start
    while at + 8 <= end:
        size, kind = struct.unpack_from(">I4s", data, at)
        head = 8
        if size == 1:
            (size,) = struct.unpack_from(">Q", data, at + 8)
            head = 16
        elif size == 0:
            size = end - at
        if size < head or at + size > end:
            raise ValueError("bad box")
        yield kind, at + head, at + size
        at += size


def _child(data, start, end, kind):
    for k, s, e in _boxes(data, start, end):
        if k == kind:
            return s, e
    raise ValueError(f"no {kind!r}")


def items(data: bytes) -> dict:
    """The primary item of a HEIF file: its type, its tiles in dimg order, its properties in
    association order as (type, payload, essential), and whether an alpha plane belongs to it."""
    s, e = _child(data, 0, len(data), b"meta")
    s += 4  # FullBox
    ps, _ = _child(data, s, e, b"pitm")
    primary = struct.unpack_from(">H" if data[ps] == 0 else ">I", data, ps + 4)[0]
    types = {}
    i_s, i_e = _child(data, s, e, b"iinf")
    i_s += 4 + (2 if data[i_s] == 0 else 4)  # FullBox, then the entry count
    for k, bs, _ in _boxes(data, i_s, i_e):
        if k != b"infe":
            continue
        v = data[bs]
        if v < 2:
            continue
        if v == 2:
            item_id, _, kind = struct.unpack_from(">HH4s", data, bs + 4)
        else:
            item_id, _, kind = struct.unpack_from(">IH4s", data, bs + 4)
        types[item_id] = kind
    tiles = []
    aux = set()  # items that are auxiliary images of the primary: alpha, depth, gain maps
    try:
        r_s, r_e = _child(data, s, e, b"iref")
        wide = data[r_s] != 0
        for k, bs, _ in _boxes(data, r_s + 4, r_e):
            fmt = ">I" if wide else ">H"
            n = 4 if wide else 2
            (source,) = struct.unpack_from(fmt, data, bs)
            (count,) = struct.unpack_from(">H", data, bs + n)
            targets = [struct.unpack_from(fmt, data, bs + n + 2 + n * j)[0] for j in range(count)]
            if k == b"dimg" and source == primary:
                tiles = targets
            elif k == b"auxl" and primary in targets:
                aux.add(source)
    except ValueError:
        pass  # no references: a single image
    p_s, p_e = _child(data, s, e, b"iprp")
    c_s, c_e = _child(data, p_s, p_e, b"ipco")
    props = [(k, bs, be) for k, bs, be in _boxes(data, c_s, c_e)]
    a_s, _ = _child(data, p_s, p_e, b"ipma")
    version, flags = data[a_s], int.from_bytes(data[a_s + 1 : a_s + 4], "big")
    (count,) = struct.unpack_from(">I", data, a_s + 4)
    at = a_s + 8
    mine = []
    alpha = False
    for _ in range(count):
        if version < 1:
            (item_id,) = struct.unpack_from(">H", data, at)
            at += 2
        else:
            (item_id,) = struct.unpack_from(">I", data, at)
            at += 4
        n = data[at]
        at += 1
        for _ in range(n):
            if flags & 1:
                (v,) = struct.unpack_from(">H", data, at)
                at += 2
                essential, index = bool(v & 0x8000), v & 0x7FFF
            else:
                v = data[at]
                at += 1
                essential, index = bool(v & 0x80), v & 0x7F
            if item_id == primary and index:
                k, bs, be = props[index - 1]
                mine.append((k, data[bs:be], essential))
            elif item_id in aux and index:
                k, bs, be = props[index - 1]
                alpha |= k == b"auxC" and data[bs + 4 : be].split(b"\0")[0] in ALPHA
    return {"id": primary, "type": types.get(primary), "tiles": tiles, "props": mine, "alpha": alpha}


def _uint(data: bytes, at: int, size: int) -> int:
    return int.from_bytes(data[at : at + size], "big")


def extents_present(data: bytes, wanted: list[int]) -> bool:
    """Whether every byte the iloc box gives these items lies inside the file: a cut file's last
    tiles would otherwise reach FFmpeg short, and it conceals what is missing without a word."""
    s, e = _child(data, 0, len(data), b"meta")
    at, _ = _child(data, s + 4, e, b"iloc")
    version = data[at]
    at += 4
    offset_size, length_size = data[at] >> 4, data[at] & 15
    base_size, index_size = data[at + 1] >> 4, (data[at + 1] & 15 if version in (1, 2) else 0)
    at += 2
    wide = version >= 2
    count = _uint(data, at, 4 if wide else 2)
    at += 4 if wide else 2
    found = set()
    for _ in range(count):
        item = _uint(data, at, 4 if wide else 2)
        at += 4 if wide else 2
        method = 0
        if version in (1, 2):
            method = _uint(data, at, 2) & 15
            at += 2
        at += 2  # data_reference_index
        base = _uint(data, at, base_size)
        at += base_size
        extents = _uint(data, at, 2)
        at += 2
        for _ in range(extents):
            at += index_size
            offset = _uint(data, at, offset_size)
            length = _uint(data, at + offset_size, length_size)
            at += offset_size + length_size
            if item in wanted and (method != 0 or base + offset + length > len(data)):
                return False
        found.add(item)
    return all(i in found for i in wanted)


def _planes(frame):
    """A decoded yuv420p frame's Y, U, V as uint8 arrays (line padding dropped)."""
    out = []
    for i, plane in enumerate(frame.planes):
        w = frame.width if i == 0 else (frame.width + 1) // 2
        h = frame.height if i == 0 else (frame.height + 1) // 2
        out.append(np.frombuffer(plane, np.uint8).reshape(-1, plane.line_size)[:h, :w])
    return out


def _canvas(data: bytes, tree: dict, tiling: dict | None):
    """The primary image's Y, U, V planes, tiles placed and cropped to the grid's size, and the
    stream's (matrix, full range); or None."""
    import av

    if tree["type"] == b"grid":
        if not tiling or len(tree["tiles"]) != tiling["num_columns"] * tiling["num_rows"]:
            return None
        order = tree["tiles"]
    elif tree["type"] == b"hvc1":
        order = [tree["id"]]
    else:
        return None
    if not extents_present(data, order):
        return None  # truncated (pillow-heif then says what it says), or data not in the file
    with av.open(io.BytesIO(data), "r") as container:
        streams = {s.id: s for s in container.streams.video}
        if any(i not in streams for i in order):
            return None
        wanted = [streams[i] for i in order]
        for s in wanted:
            s.codec_context.thread_count = 1  # one worker per core: its threads would only compete
        frames = {}
        for packet in container.demux(wanted):
            for frame in packet.decode():
                frames.setdefault(packet.stream.id, frame)
        if len(frames) != len(order) or any(
            f.format.name not in ("yuv420p", "yuvj420p") for f in frames.values()
        ):
            return None
        first = frames[order[0]]
        # the stream's VUI colour: AVColorSpace numbers are nclx's; AVColorRange 1 limited, 2 full
        vui = (first.colorspace, {1: False, 2: True}.get(first.color_range))
        if tree["type"] == b"hvc1":
            return (*_planes(first), vui)
        cols, rows = tiling["num_columns"], tiling["num_rows"]
        tw, th = tiling["tile_width"], tiling["tile_height"]
        if tw % 2 or th % 2:
            return None
        y = np.empty((rows * th, cols * tw), np.uint8)
        u = np.empty((rows * th // 2, cols * tw // 2), np.uint8)
        v = np.empty_like(u)
        for n, item in enumerate(order):
            f = frames[item]
            if (f.width, f.height) != (tw, th):
                return None
            r, c = divmod(n, cols)
            py, pu, pv = _planes(f)
            y[r * th : (r + 1) * th, c * tw : (c + 1) * tw] = py
            u[r * th // 2 : (r + 1) * th // 2, c * tw // 2 : (c + 1) * tw // 2] = pu
            v[r * th // 2 : (r + 1) * th // 2, c * tw // 2 : (c + 1) * tw // 2] = pv
    w, h = tiling["image_width"], tiling["image_height"]
    return y[:h, :w], u[: (h + 1) // 2, : (w + 1) // 2], v[: (h + 1) // 2, : (w + 1) // 2], vui


def _clap(payload: bytes, width: int, height: int):
    """A clean aperture as (left, top, width, height) in whole pixels, as libheif rounds it."""
    wn, wd, hn, hd, xn, xd, yn, yd = struct.unpack(">IIIIiIiI", payload[:32])
    cw, ch = Fraction(wn, wd), Fraction(hn, hd)
    left = Fraction(width - 1, 2) + Fraction(xn, xd) - (cw - 1) / 2
    top = Fraction(height - 1, 2) + Fraction(yn, yd) - (ch - 1) / 2
    box = [round(left), round(top), round(cw), round(ch)]
    if box[0] < 0 or box[1] < 0 or box[0] + box[2] > width or box[1] + box[3] > height:
        raise ValueError("clap outside the image")
    return box


def _to_rgb(y: Image.Image, u: Image.Image, v: Image.Image, matrix: int, full: bool) -> Image.Image:
    """YCbCr planes of one size → RGB: Pillow's JPEG conversion where it is the file's (BT.601
    full range, what phones write), else the nclx matrix and range in numpy."""
    if full and matrix in (5, 6):
        return Image.merge("YCbCr", (y, u, v)).convert("RGB")
    kr, kb = MATRICES[matrix]
    kg = 1 - kr - kb
    Y = np.asarray(y, np.float32)
    Cb = np.asarray(u, np.float32) - 128
    Cr = np.asarray(v, np.float32) - 128
    if not full:
        Y, Cb, Cr = (Y - 16) * (255 / 219), Cb * (255 / 224), Cr * (255 / 224)
    r = Y + 2 * (1 - kr) * Cr
    b = Y + 2 * (1 - kb) * Cb
    g = (Y - kr * r - kb * b) / kg
    rgb = np.stack([r, g, b], -1)
    return Image.fromarray(np.clip(rgb + 0.5, 0, 255).astype(np.uint8), "RGB")


# reduce by k only while the image stays this many times its target: phones' photos, not the
# hard-edged scans image.py's REDUCE_MARGIN (3.5) is sized for; 13 real phone HEICs held 46.1 dB or
# more of exact at every budget with it (docs/benchmarks.md, 2026-12-03)
REDUCE_MARGIN = 2.0


def fitted(data: bytes, image: Image.Image, budget: int):
    """The primary image at its target size after irot/imir/clap, or None where this path does
    not apply: (rgb, the EXIF orientation still to apply, upright (height, width), decoded size).

    image: the file opened by pillow-heif (its size is the upright one after irot and clap, and
    its EXIF orientation is what the exact path turns by afterwards, so the caller does too).
    """
    info = image.info
    nclx = info.get("nclx_profile")
    if info.get("bit_depth") != 8 or info.get("chroma") != 420:
        return None
    if nclx:
        matrix, full = nclx.get("matrix_coefficients"), bool(nclx.get("full_range_flag"))
        if matrix not in MATRICES:
            return None
    tree = items(data)
    if tree["alpha"] or "A" in image.mode:
        return None  # an alpha plane: pillow-heif decodes it with the colour, composited on white as exact
    turns = _transforms(tree)
    if turns is None:
        return None
    swap = sum(p[0] & 1 for k, p in turns if k == b"irot") % 2 == 1
    tiling = info.get("tiling")
    if tiling and swap:  # libheif gives the grid turned, as it shows it; the tiles are stored unturned
        tiling = _unturned(tiling)
    planes = _canvas(data, tree, tiling)
    if planes is None:
        return None
    y, u, v, vui = planes
    if not nclx:  # no colr nclx: libheif takes the HEVC stream's own (its VUI), as FFmpeg read it
        matrix, full = vui
        if matrix not in MATRICES or full is None:
            return None
    if turns and turns[0][0] == b"clap":
        planes = _cropped(y, u, v, turns[0][1])
        if planes is None:
            return None
        y, u, v = planes
        turns = turns[1:]
    height, width = y.shape
    if (height, width)[:: -1 if swap else 1] != (image.height, image.width):
        return None  # not the image libheif describes
    orientation = image.getexif().get(0x0112, 1)
    exif_swap = orientation in (5, 6, 7, 8)
    up_w, up_h = (image.height, image.width) if exif_swap else image.size
    th, tw = target_size(up_h, up_w, budget)
    want = (th, tw) if swap != exif_swap else (tw, th)  # the target as stored: (width, height)
    rgb = _turned(_scaled(y, u, v, want, bool(turns), matrix, full), turns)
    return rgb, orientation, (up_h, up_w), (width, height)


def _transforms(tree: dict) -> list | None:
    """The primary item's irot/imir/clap as (type, payload) in association order, or None where an
    essential property is one we do not know, or a crop comes after a turn (rare, left to libheif)."""
    turns = []
    for kind, payload, essential in tree["props"]:
        if kind in (b"irot", b"imir", b"clap"):
            turns.append((kind, payload))
        elif essential and kind not in KNOWN:
            return None
    if any(k == b"clap" for k, _ in turns[1:]):
        return None
    return turns


def _unturned(tiling: dict) -> dict:
    """pillow-heif's grid (as libheif shows it, turned by an odd irot) as its tiles are stored."""
    return {
        "num_columns": tiling["num_rows"],
        "num_rows": tiling["num_columns"],
        "tile_width": tiling["tile_height"],
        "tile_height": tiling["tile_width"],
        "image_width": tiling["image_height"],
        "image_height": tiling["image_width"],
    }


def _cropped(y, u, v, clap: bytes):
    """The planes cut to the clean aperture, or None where it starts on an odd pixel (the 4:2:0
    chroma would be cut between samples)."""
    height, width = y.shape
    left, top, cw, ch = _clap(clap, width, height)
    if left % 2 or top % 2:
        return None
    y = y[top : top + ch, left : left + cw]
    u = u[top // 2 : (top + ch + 1) // 2, left // 2 : (left + cw + 1) // 2]
    v = v[top // 2 : (top + ch + 1) // 2, left // 2 : (left + cw + 1) // 2]
    return y, u, v


def _scaled(y, u, v, want: tuple[int, int], turned: bool, matrix: int, full: bool) -> Image.Image:
    """The stored (unturned) planes → RGB at `want` (width, height): luma reduced by a whole
    factor while it stays REDUCE_MARGIN times the target, chroma brought to its size, then resized."""
    height, width = y.shape
    k = int(min(width / (REDUCE_MARGIN * want[0]), height / (REDUCE_MARGIN * want[1])))
    k = max(k, 1)
    Y = Image.fromarray(np.ascontiguousarray(y), "L")
    if k >= 2:
        Y = Y.reduce(k)
    # each reduced luma pixel spans k stored pixels, k/2 chroma ones. libheif upsamples chroma by
    # nearest neighbour (so reduced: the chroma's area average, BOX) on an unturned image, but
    # bilinearly once irot/imir turned its planes (measured against pillow-heif: 51 dB each way,
    # 40 dB crossed); at k = 2 the chroma is already the size and neither is needed
    spread = Image.Resampling.BILINEAR if turned else Image.Resampling.BOX
    cbox = (0, 0, Y.width * k / 2, Y.height * k / 2)
    U, V = (Image.fromarray(np.ascontiguousarray(c), "L") for c in (u, v))
    if U.size != Y.size or cbox != (0, 0, *U.size):
        U, V = (c.resize(Y.size, spread, box=cbox) for c in (U, V))
    rgb = _to_rgb(Y, U, V, matrix, full)
    box = (0, 0, width / k, height / k)
    if rgb.size != want or box != (0, 0, *rgb.size):
        rgb = rgb.resize(want, resample=Image.Resampling.BICUBIC, box=box)
    return rgb


def _turned(rgb: Image.Image, turns: list) -> Image.Image:
    """irot and imir applied in their association order."""
    for kind, payload in turns:
        if kind == b"irot":
            angle = payload[0] & 3  # anticlockwise quarter turns
            if angle:
                rgb = rgb.transpose(
                    (Image.Transpose.ROTATE_90, Image.Transpose.ROTATE_180, Image.Transpose.ROTATE_270)[
                        angle - 1
                    ]
                )
        else:  # imir: axis 0 turns the image upside down, 1 left to right (as libheif reads it)
            rgb = rgb.transpose(
                Image.Transpose.FLIP_LEFT_RIGHT if payload[0] & 1 else Image.Transpose.FLIP_TOP_BOTTOM
            )
    return rgb
