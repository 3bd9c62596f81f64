"""Every still format Pillow reads: walked, opened as the format its name says whatever the worker
decoded before, composited on white as transformers' convert_to_rgb does (colour keys too),
a corrupt one `decode_error`. Real files from Pillow's own test suite (tests/images/README.md,
files nobody here wrote) and files written here by Pillow's writers."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageOps
from transformers.image_transforms import convert_to_rgb

from gemma4enc.media.decode import DecodeError, decode_image
from gemma4enc.media.discover import discover
from gemma4enc.media.kinds import IMAGE_EXTS, PILLOW_LEFT_OUT
from gemma4enc.media.patches import patchify
from gemma4enc.media.prepare import prepare
from gemma4enc.model.load import load_tower
from gemma4enc.options import Options

from .helpers import close, hf_image_features

SAMPLES = Path(__file__).parent / "images"
CORRUPT = {"unknown_mode.j2k", "hopper_bad_checksum.msp", "timeout-060745d3.blp", "negative_size.ppm"}
COLOUR_KEYS = ["rgb_trns.png", "l_trns.png", "1_trns.png", "p_trns_single.png", "tRNS_null_1x1.png"]
SCALED = ("I;16", "I;16B", "I;16L", "I", "F")  # 16-bit and float: scaled on purpose (docs/commands.md)
MAX = 89_478_485


def as_named(path) -> Image.Image:
    """The file opened by Pillow as the format its extension names, or (a name that lies, as
    courB08.pbm, a PNG) by Pillow's own search."""
    Image.init()
    try:
        return Image.open(path, formats=[Image.registered_extensions()[Path(path).suffix.lower()]])
    except Image.UnidentifiedImageError:
        return Image.open(path)


def processor_pixels(image: Image.Image) -> np.ndarray:
    """What transformers' image processor starts from, given the opened file (convert_to_rgb)."""
    return convert_to_rgb(ImageOps.exif_transpose(image), return_numpy=True)


def ours(path, fit=None) -> np.ndarray:
    image = decode_image(str(path), MAX, fit).images[0]
    return np.asarray(getattr(image, "image", image))


def samples() -> list[Path]:
    return sorted(p for p in SAMPLES.iterdir() if p.name != "README.md")


# ── what is walked ───────────────────────────────────────────────────────────────────────────────


def test_every_format_pillow_opens_here_is_walked_or_left_out_with_a_reason():
    Image.init()
    from gemma4enc.media.image import register_heif

    register_heif()
    exts: dict[str, set[str]] = {}
    for ext, fmt in Image.registered_extensions().items():
        exts.setdefault(fmt, set()).add(ext)
    docs = (Path(__file__).parents[1] / "docs" / "commands.md").read_text()
    for fmt in Image.OPEN:
        if fmt in PILLOW_LEFT_OUT:
            assert not exts.get(fmt, set()) & IMAGE_EXTS, fmt
            assert re.search(rf"\b{fmt}\b", docs), f"{fmt} is left out but docs/commands.md does not say so"
        else:
            assert exts.get(fmt) and exts[fmt] <= IMAGE_EXTS, (fmt, exts.get(fmt, set()) - IMAGE_EXTS)


def test_the_real_samples_are_walked_and_decode_as_the_processor_sees_them():
    """Each of Pillow's test files: walked (none skipped), `ok` on both resize paths with the
    processor's exact pixels, or — the four corrupt ones — `decode_error`, never `unsupported`."""
    items, skipped = discover([str(SAMPLES)])
    assert sorted(Path(i.path).name for i in items) == [p.name for p in samples()] and skipped == 1
    assert {i.kind for i in items} == {"image"}
    compared = 0
    for item in items:
        name = Path(item.path).name
        for resize in ("exact", "fast"):
            done = prepare(item, Options(resize=resize))
            want = "decode_error" if name in CORRUPT else "ok"
            assert done.status == want, (name, resize, done.error)
        if name in CORRUPT:
            continue
        with warnings.catch_warnings(), as_named(item.path) as image:
            warnings.simplefilter("ignore")
            if image.mode in SCALED:
                continue
            theirs = processor_pixels(image)
        assert np.array_equal(ours(item.path), theirs), name
        compared += 1
    assert compared >= 30


def test_a_psd_is_its_composite_even_with_a_broken_layer_table():
    """Pillow numbers PSD layers from 1 (seek(0) failed); the image as opened is the composite,
    which is what the processor sees; a layer table that cannot be read must not cost it."""
    for name in ("rgba.psd", "five_channels.psd", "negative_layer_count.psd", "psd-oob-write-overflow.psd"):
        with as_named(SAMPLES / name) as image:
            theirs = processor_pixels(image)
        got = decode_image(str(SAMPLES / name), MAX)
        assert np.array_equal(np.asarray(got.images[0]), theirs) and got.info["source_frames"] == 1, name


# ── colour keys ──────────────────────────────────────────────────────────────────────────────────


def written_colour_keys(folder: Path) -> list[Path]:
    """PNGs and a GIF whose transparency is a colour (tRNS), written by Pillow: RGB, grey, paletted."""
    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)
    rgb[10:30, 5:40] = (12, 34, 56)  # the key colour
    grey = rgb[..., 0].copy()
    grey[10:30, 5:40] = 77
    paths = []
    Image.fromarray(rgb).save(p := folder / "key-rgb.png", transparency=(12, 34, 56))
    paths.append(p)
    Image.fromarray(grey).save(p := folder / "key-grey.png", transparency=77)
    paths.append(p)
    pal = Image.fromarray(rgb).quantize(16)
    key = int(np.asarray(pal)[15, 10])  # the key area's palette index
    pal.save(p := folder / "key-pal.png", transparency=key)
    paths.append(p)
    pal.save(p := folder / "key-pal.gif", transparency=key)
    paths.append(p)
    return paths


def test_a_colour_key_is_composited_on_white_as_the_processor_does(tmp_path):
    for path in written_colour_keys(tmp_path):
        with Image.open(path) as image:
            assert image.info.get("transparency") is not None, path.name
            theirs = processor_pixels(image)
        got = ours(path)
        assert np.array_equal(got, theirs), path.name
        assert (theirs == 255).all(-1).sum() >= 600, path.name  # the key area is white, not its colour
    rgb = ours(tmp_path / "key-rgb.png")
    assert (rgb[10:30, 5:40] == 255).all()


def test_a_colour_key_is_white_on_the_fast_path_too(tmp_path):
    Image.new("RGB", (900, 700), (12, 34, 56)).save(tmp_path / "all-key.png", transparency=(12, 34, 56))
    Image.new("L", (900, 700), 9).save(tmp_path / "all-key-grey.png", transparency=9)
    for name in ("all-key.png", "all-key-grey.png"):
        fast = ours(tmp_path / name, fit=280)
        assert fast.shape[0] < 700 and (fast == 255).all(), name


def test_a_16_bit_grey_png_with_a_key_is_scaled_and_white_there():
    raw = np.asarray(Image.open(SAMPLES / "i_trns.png"))
    got = ours(SAMPLES / "i_trns.png")
    key = Image.open(SAMPLES / "i_trns.png").info["transparency"]
    assert (got[raw == key] == 255).all() and (raw == key).any() and got[raw != key].max() <= 1


@pytest.fixture(scope="module")
def tower32(ckpt_sharded):
    return load_tower(str(ckpt_sharded), "float32", "cpu")


def test_colour_keyed_files_give_get_image_features_tokens(tower32, ref_sharded, tmp_path):
    """The whole chain on files with a colour key: decode → patchify → our tower, against
    transformers' processor + get_image_features on the file as opened (float32, 1e-4 × max)."""
    paths = written_colour_keys(tmp_path) + [SAMPLES / n for n in COLOUR_KEYS]
    for path in paths:
        mine = tower32.encode([patchify(decode_image(str(path), MAX).images[0], 280)])[0]
        with Image.open(path) as image:
            image.load()
            want = hf_image_features(ref_sharded, image)
        assert mine.shape == want.shape and close(mine, want, 1e-4), (path.name, (mine - want).abs().max())


# ── Pillow's writers: every format it can write and read ────────────────────────────────────────


def written_by_pillow(folder: Path) -> list[Path]:
    """One small file per format Pillow both writes and reads here (left-out ones aside)."""
    from gemma4enc.media.image import register_heif

    register_heif()
    Image.init()
    rng = np.random.default_rng(1)
    yy, xx = np.mgrid[0:40, 0:56]
    picture = np.stack([xx * 4, yy * 6, (xx + yy) * 2], -1) + rng.integers(0, 20, (40, 56, 3))
    picture = Image.fromarray(picture.clip(0, 255).astype(np.uint8))
    tried = {"RGB": picture, "RGBA": picture.convert("RGBA"), "L": picture.convert("L"), "1": picture.convert("1"),
             "P": picture.quantize(64)}  # BLP writes only paletted
    by_format = {}
    for ext, fmt in sorted(Image.registered_extensions().items()):
        by_format.setdefault(fmt, ext)
    paths = []
    for fmt, ext in sorted(by_format.items()):
        if fmt in PILLOW_LEFT_OUT or fmt not in Image.OPEN or fmt not in Image.SAVE:
            continue
        for mode, image in tried.items():
            path = folder / f"{fmt.lower()}-{mode}{ext}"
            try:
                image.save(path, fmt, **({"sizes": [(40, 40)]} if fmt in ("ICO", "ICNS") else {}))
                with Image.open(path) as back:
                    back.load()
                paths.append(path)
                break
            except (OSError, ValueError, KeyError, TypeError):
                path.unlink(missing_ok=True)
    paths.append(folder / "pfm-F.pfm")
    picture.convert("F").save(paths[-1])
    return paths


def test_every_format_pillow_writes_is_walked_and_decoded_as_the_processor_sees_it(tmp_path):
    paths = written_by_pillow(tmp_path)
    formats = {p.name.split("-")[0] for p in paths}
    assert {"jpeg2000", "qoi", "dds", "sgi", "pcx", "icns", "blp", "ppm", "tga", "msp", "xbm"} <= formats
    items, skipped = discover([str(tmp_path)])
    assert sorted(Path(i.path).name for i in items) == sorted(p.name for p in paths) and skipped == 0
    for item in items:
        done = prepare(item, Options(resize="exact"))
        assert done.status == "ok", (item.path, done.error)
        with as_named(item.path) as image:
            if image.mode in SCALED:
                continue
            theirs = processor_pixels(image)
        assert np.array_equal(ours(item.path), theirs), item.path


# ── the same row whatever came before ───────────────────────────────────────────────────────────


def tga_lookalike_ico(path: Path) -> Path:
    """An ICO whose header also parses as a TGA header (a 128×128 BMP entry: its size's third byte
    is 1, a TGA depth): Pillow's TGA reader, which checks no magic, takes it when asked first."""
    Image.new("RGBA", (128, 128), (10, 200, 30, 255)).save(path, sizes=[(128, 128)], bitmap_format="bmp")
    with Image.open(path, formats=["TGA"]) as trap:
        assert trap.format == "TGA"  # the trap is real: first come, first served
    return path


@pytest.mark.slow
def test_a_file_decodes_the_same_whatever_the_worker_decoded_before(tmp_path):
    ico = tga_lookalike_ico(tmp_path / "icon.ico")
    written = written_by_pillow(tmp_path)
    slow = {"blp1_jpeg2.blp", "timeout-060745d3.blp"}  # ~1 s each: decoded alone, not 40 times over
    paths = [str(p) for p in [ico, *samples(), *written] if p.name not in slow]
    firsts = [str(SAMPLES / "la.tga"), str(SAMPLES / "rgba16.tga")]  # TGA ahead of everything
    seen = set()
    for p in paths:  # and one of each other kind
        if Path(p).suffix not in seen:
            seen.add(Path(p).suffix)
            firsts.append(p)
    fresh = subprocess.run(  # a new interpreter: this one's Pillow has opened files already
        [sys.executable, "-m", "tests.decode_order"], input=json.dumps({"paths": paths, "firsts": firsts}),
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[1],
    )
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    got = json.loads(fresh.stdout)
    alone, after = got["alone"], got["after"]
    assert alone[0][0] == "ok"  # the ICO alone
    for first, rows in after.items():
        for path, a, b in zip(paths, alone, rows):
            assert a == b, f"{Path(path).name} after {Path(first).name}: {b} (alone: {a})"


# ── corrupt is not unsupported ──────────────────────────────────────────────────────────────────


def test_a_corrupt_file_of_a_format_pillow_reads_is_a_decode_error(tmp_path):
    """Headers cut short: Pillow's check knows the format, its reader cannot open it (MSP, PCX and
    PNM have no magic of ours: Pillow's own checks tell)."""
    listed = []
    cut_short = ("rgba.psd", "ati1.dds", "op_index.qoi", "rgb_trns_ycbc.jp2", "rgb_trns_ycbc.j2k", "hopper.fits")
    for name in (*cut_short, "hopper.msp", "pil184.pcx", "16_bit_binary.pgm"):
        cut = tmp_path / f"cut-{name}"
        data = (SAMPLES / name).read_bytes()
        cut.write_bytes(data[: min(20, len(data) // 2)])
        listed.append(str(cut))
        with pytest.raises(DecodeError) as e:
            decode_image(str(cut), MAX)
        assert e.value.status == "decode_error", name
    (tmp_path / "notes.psd").write_text("not an image at all\n")
    listed.append(str(tmp_path / "notes.psd"))
    (tmp_path / "list.txt").write_text("\n".join(listed) + "\n")
    items, _ = discover([], files_from=str(tmp_path / "list.txt"))
    statuses = {Path(i.path).name: prepare(i, Options()).status for i in items}
    assert statuses.pop("notes.psd") == "unsupported"
    assert set(statuses.values()) == {"decode_error"} and len(statuses) == 9


def test_a_file_of_these_formats_is_known_by_its_bytes_without_an_extension(tmp_path):
    for name in ("rgba.psd", "ati1.dds", "op_index.qoi", "rgb_trns_ycbc.jp2", "hopper.fits", "hopper.xpm"):
        (tmp_path / name.replace(".", "-")).write_bytes((SAMPLES / name).read_bytes())  # no extension
    (tmp_path / "README").write_text("DDS is a texture format\n")
    items, skipped = discover([str(tmp_path)])
    assert len(items) == 6 and skipped == 1
    for item in items:
        assert prepare(item, Options()).status == "ok", item.path


def test_the_samples_stay_small():
    sizes = [p.stat().st_size for p in samples()]
    assert len(sizes) <= 40 and sum(sizes) < 2_000_000 and max(sizes) < 64_000
    assert all(p.name in (SAMPLES / "README.md").read_text() for p in samples())


def test_io_objects_are_opened_in_the_fixed_order_too():
    """A URL's or tar member's bytes come as a file object: named, its extension still leads."""
    data = io.BytesIO((SAMPLES / "hopper.ico").read_bytes())
    data.name = "hopper.ico"
    assert np.array_equal(np.asarray(decode_image(data, MAX).images[0]), ours(SAMPLES / "hopper.ico"))
    unnamed = io.BytesIO((SAMPLES / "la.tga").read_bytes())
    assert np.array_equal(np.asarray(decode_image(unnamed, MAX).images[0]), ours(SAMPLES / "la.tga"))


def test_a_format_registered_later_joins_the_order():
    """pillow-heif registers HEIF at the first decode: an order asked for before must not freeze
    HEIC out (the order is kept per set of registered formats)."""
    from gemma4enc.media import formats
    from gemma4enc.media.image import register_heif

    Image.init()
    saved = dict(Image.OPEN)
    try:
        Image.OPEN.pop("HEIF", None)
        assert "HEIF" not in formats.formats_for("x.heic")
        register_heif.cache_clear()
        register_heif()
        assert formats.formats_for("x.heic")[0] == "HEIF"
    finally:
        Image.OPEN.update(saved)


def test_a_16bit_grey_png_with_a_colour_key_follows_the_stated_rule(tmp_path):
    """docs/commands.md's rule for a 16-bit grey PNG with a tRNS key: every value scaled by
    255/65535 and rounded (not clipped at 255, as Pillow's convert does), and the pixels equal to
    the 16-bit key white (transparent, on white) — not the pixels whose 8-bit value matches."""
    from gemma4enc.media.image import decode_image

    raw = (np.arange(64 * 80).reshape(64, 80) * 13 % 65536).astype(np.uint16)
    key = int(raw[5, 7])
    Image.fromarray(raw).save(p := tmp_path / "g16-key.png", transparency=key)
    with Image.open(p) as image:
        assert image.mode == "I;16" and image.info["transparency"] == key
    got = np.asarray(decode_image(str(p), MAX).images[0])
    want = np.clip(raw * (255.0 / 65535.0), 0, 255).round().astype(np.uint8)
    want[raw == key] = 255
    assert np.array_equal(got, np.repeat(want[..., None], 3, axis=2))
    assert (raw == key).sum() >= 1 and (want == want[5, 7]).sum() > 0


def refused(path) -> tuple[str, str]:
    """(status, message) of an image decode_image refuses (it must refuse it)."""
    from gemma4enc.media.frames import DecodeError
    from gemma4enc.media.image import decode_image

    with pytest.raises(DecodeError) as e:
        decode_image(str(path), MAX)
    return e.value.status, str(e.value)


def test_a_12bit_jpeg_is_unsupported_not_corrupt(tmp_path):
    """A JPEG whose frame header says 12-bit samples (extended sequential, SOF1, after EXIF) is
    valid but beyond Pillow's 8-bit libjpeg: `unsupported`, saying so; a JPEG cut inside its
    header stays `decode_error`."""
    import io

    buf = io.BytesIO()
    exif = Image.Exif()
    exif[0x010F] = "camera"
    Image.fromarray(np.zeros((32, 48, 3), np.uint8)).save(buf, "JPEG", exif=exif.tobytes())
    data = bytearray(buf.getvalue())
    at = data.find(b"\xff\xc0")
    data[at + 1], data[at + 4] = 0xC1, 12
    (tmp_path / "j12.jpg").write_bytes(bytes(data))
    (tmp_path / "cut.jpg").write_bytes(bytes(data[: at + 3]))
    status, said = refused(tmp_path / "j12.jpg")
    assert status == "unsupported" and "12-bit JPEG" in said
    assert refused(tmp_path / "cut.jpg")[0] == "decode_error"


def test_an_avif_past_libavifs_size_limit_is_unsupported_not_corrupt(tmp_path):
    """An AVIF whose `ispe` states 17000×17000 (more than libavif's 16384×16384 default limit) is
    `unsupported`, saying why (issue 46: it was "corrupt image"); one within the limit decodes, and
    one cut inside its header stays `decode_error`."""
    import struct

    from PIL import features

    from gemma4enc.media.image import decode_image

    if not features.check("avif"):
        pytest.skip("this Pillow build has no AVIF codec")
    Image.new("RGB", (64, 48), (10, 20, 30)).save(tmp_path / "small.avif")
    data = bytearray((tmp_path / "small.avif").read_bytes())
    at = data.index(b"ispe")
    assert struct.unpack_from(">II", data, at + 8) == (64, 48)
    struct.pack_into(">II", data, at + 8, 17000, 17000)
    (tmp_path / "huge.avif").write_bytes(bytes(data))
    (tmp_path / "cut.avif").write_bytes(bytes(data[:40]))
    assert decode_image(str(tmp_path / "small.avif"), MAX).info["width"] == 64
    status, said = refused(tmp_path / "huge.avif")
    assert status == "unsupported" and "17000×17000" in said
    assert refused(tmp_path / "cut.avif")[0] == "decode_error"
