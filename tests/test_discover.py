"""Finding files on its own: the sniff of a file's first bytes (media/kinds.py), the walk of a folder
and the file lists (media/discover.py).

No model, no decode: when one of these fails, the stage that broke is finding files."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
from PIL import Image

from gemma4enc.dev.demo import write_video
from gemma4enc.errors import UsageError
from gemma4enc.media.discover import discover, look, walk
from gemma4enc.media.kinds import SNIFF_BYTES, kind_of, sniff

from .helpers import photo

ASF = bytes.fromhex("3026b2758e66cf11a6d900aa0062ce6c")  # the ASF header object's GUID (WMV)

# first bytes as each format's specification writes them → the kind they say
HEADS = {
    "jpeg-jfif": (b"\xff\xd8\xff\xe0\x00\x10JFIF\x00", "image"),
    "jpeg-exif": (b"\xff\xd8\xff\xe1\x1c\x45Exif\x00\x00", "image"),
    "png": (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "image"),
    "gif87a": (b"GIF87a\x01\x00\x01\x00", "image"),
    "gif89a": (b"GIF89a\x01\x00\x01\x00", "image"),
    "bmp": (b"BM\x36\x00\x0c\x00\x00\x00\x00\x00", "image"),
    "tiff-le": (b"II*\x00\x08\x00\x00\x00", "image"),
    "tiff-be": (b"MM\x00*\x00\x00\x00\x08", "image"),
    "ico": (b"\x00\x00\x01\x00\x01\x00\x10\x10", "image"),
    "webp": (b"RIFF\x24\x00\x00\x00WEBPVP8 ", "image"),
    "heic": (b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00", "image"),
    "avif": (b"\x00\x00\x00\x1cftypavif\x00\x00\x00\x00", "image"),
    "heif-mif1": (b"\x00\x00\x00\x18ftypmif1\x00\x00\x00\x00", "image"),
    "avi": (b"RIFF\x24\x00\x00\x00AVI LIST", "video"),
    "mp4-isom": (b"\x00\x00\x00\x20ftypisom\x00\x00\x02\x00", "video"),
    "mp4-mp42": (b"\x00\x00\x00\x18ftypmp42\x00\x00\x00\x00", "video"),
    "mov": (b"\x00\x00\x00\x14ftypqt  \x00\x00\x00\x00", "video"),
    "3gp": (b"\x00\x00\x00\x14ftyp3gp4\x00\x00\x00\x00", "video"),
    "matroska-webm": (b"\x1a\x45\xdf\xa3\x9f\x42\x86\x81\x01", "video"),
    "flv": (b"FLV\x01\x05\x00\x00\x00\x09", "video"),
    "mpeg-ps": (b"\x00\x00\x01\xba\x44\x00\x04\x00", "video"),
    "mpeg-es": (b"\x00\x00\x01\xb3\x14\x00\xf0\x13", "video"),
    "ogg": (b"OggS\x00\x02\x00\x00\x00\x00", "video"),
    "asf-wmv": (ASF + b"\x00" * 8, "video"),
    "wav": (b"RIFF\x24\x00\x00\x00WAVEfmt ", None),  # RIFF, but sound
    "html": (b"<!doctype html><html>", None),
    "pdf": (b"%PDF-1.7\n", None),
    "zip": (b"PK\x03\x04\x14\x00\x00\x00", None),
    "text": (b"just some notes\n", None),
    "empty": (b"", None),
    "half-a-jpeg-magic": (b"\xff\xd8", None),
}


@pytest.mark.parametrize("head, kind", HEADS.values(), ids=HEADS.keys())
def test_sniff_reads_the_kind_from_the_first_bytes(head, kind):
    assert sniff(head) == kind


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "GIF", "BMP", "TIFF", "WEBP", "ICO", "PPM"])
def test_what_pillow_writes_sniffs_as_an_image(fmt):
    buf = io.BytesIO()
    photo(32, 48).save(buf, fmt)
    head = buf.getvalue()[:SNIFF_BYTES]
    # PPM has no magic we sniff ("P6"): only its extension says image
    assert kind_of("x.ppm" if fmt == "PPM" else "x.bin", head) == "image"
    assert sniff(head) == (None if fmt == "PPM" else "image")


@pytest.mark.parametrize("name, codec", [("a.mp4", "libx264"), ("b.webm", "libvpx-vp9")])
def test_what_ffmpeg_writes_sniffs_as_a_video(tmp_path, name, codec):
    write_video(tmp_path / name, frames=2, codec=codec)
    assert sniff((tmp_path / name).read_bytes()[:SNIFF_BYTES]) == "video"


@pytest.mark.parametrize("path, head, kind", [
    ("holiday.mp4", HEADS["jpeg-jfif"][0], "image"),  # the bytes win over the name
    ("clip.jpg", HEADS["matroska-webm"][0], "video"),
    ("scan.PNG", b"garbage", "image"),  # unknown bytes: the extension, any case, is the hint
    ("film.MkV", b"garbage", "video"),
    ("notes.txt", b"garbage", "unknown"),
    ("README", b"garbage", "unknown"),
    ("page.jpg", HEADS["html"][0], "image"),  # a web page saved as .jpg: the decoder says unsupported later
])
def test_kind_of_prefers_bytes_then_the_extension(path, head, kind):
    assert kind_of(path, head) == kind


def test_look_stats_and_sniffs_and_never_raises(tmp_path):
    png = tmp_path / "named.mp4"
    photo(10, 10).save(png, "PNG")
    item = look(str(png))
    st = png.stat()
    assert (item.path, item.kind, item.size, item.mtime_ns, item.error) == (str(png), "image", st.st_size,
                                                                          st.st_mtime_ns, None)
    (tmp_path / "gone.jpg").symlink_to(tmp_path / "nowhere.jpg")
    broken = look(str(tmp_path / "gone.jpg"))
    assert (broken.kind, broken.size, broken.error) == ("image", 0, "broken symlink")
    assert look(str(tmp_path / "never.mp4")).error == "file not found"
    os.mkfifo(tmp_path / "pipe.jpg")  # opening it would block: it must not be opened
    assert look(str(tmp_path / "pipe.jpg")).error == "not a regular file"
    assert look(str(tmp_path)).error == "not a regular file"


def test_a_known_file_is_stated_not_opened(tmp_path):
    png = tmp_path / "p.png"
    photo(10, 10).save(png)
    st = png.stat()
    asked = []

    def known(path, size, mtime_ns):
        asked.append((path, size, mtime_ns))
        return "video"  # what its manifest row says: believed without reading the bytes (which say image)

    assert look(str(png), known).kind == "video"
    assert asked == [(str(png), st.st_size, st.st_mtime_ns)]
    assert look(str(png), lambda *a: None).kind == "image"  # not known: sniffed


@pytest.fixture
def tree(tmp_path):
    """root/ with hidden files and folders, a link out of the tree, a link back up it, and OUT inside."""
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    for rel in ("a.jpg", ".hidden.jpg", ".cache/b.jpg", "sub/c.png", "sub/deeper/d.gif", "out/shard.bin"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"x")
    (elsewhere / "e.jpg").parent.mkdir(parents=True)
    (elsewhere / "e.jpg").write_bytes(b"x")
    (root / "linked").symlink_to(elsewhere)  # followed: the user pointed it there
    (root / "sub" / "up").symlink_to(root)  # a loop: walked once
    return root


def rels(root: Path, paths) -> list[str]:
    return sorted(os.path.relpath(p, root) for p in paths)


def test_walk_skips_hidden_follows_links_once_and_skips_out(tree):
    visible = ["a.jpg", "linked/e.jpg", "out/shard.bin", "sub/c.png", "sub/deeper/d.gif"]
    assert rels(tree, walk(str(tree))) == visible
    assert rels(tree, walk(str(tree), hidden=True)) == sorted([*visible, ".cache/b.jpg", ".hidden.jpg"])
    assert rels(tree, walk(str(tree), skip=str(tree / "out"))) == [p for p in visible if not p.startswith("out/")]
    assert list(walk(str(tree / "a.jpg"))) == [str(tree / "a.jpg")]  # a root that is a file is itself


def media_tree(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    photo(8, 8).save(root / "a.jpg")
    photo(8, 8).save(root / "sub" / "b.png")
    photo(8, 8).save(root / "sub" / "c.png")
    (root / "notes.txt").write_text("not media")
    return root


def test_discover_sorts_keeps_media_and_counts_the_rest(tmp_path):
    root = media_tree(tmp_path / "m")
    items, skipped = discover([str(root)])
    assert [(i.path, i.kind, i.root, i.rel) for i in items] == [
        (str(root / "a.jpg"), "image", str(root), "a.jpg"),
        (str(root / "sub" / "b.png"), "image", str(root), "sub/b.png"),
        (str(root / "sub" / "c.png"), "image", str(root), "sub/c.png")]
    assert skipped == 1  # notes.txt, found by walking
    named, skipped = discover([str(root / "notes.txt")])  # named on the command line: kept, to get its row
    assert [(i.kind, i.root, i.rel) for i in named] == [("unknown", None, None)] and skipped == 0
    with pytest.raises(UsageError, match="no such file or folder"):
        discover([str(tmp_path / "mistyped")])


def test_globs_match_the_path_below_the_root_or_the_name(tmp_path):
    root = media_tree(tmp_path / "m")
    names = lambda **kw: [os.path.relpath(i.path, root) for i in discover([str(root)], **kw)[0]]  # noqa: E731
    assert names(include=["sub/*"]) == ["sub/b.png", "sub/c.png"]
    assert names(include=["*.png"], exclude=["c.*"]) == ["sub/b.png"]
    assert names(exclude=["sub/*"]) == ["a.jpg"]


def test_out_inside_a_root_is_not_walked(tmp_path):
    root = media_tree(tmp_path / "m")
    (root / "emb").mkdir()
    photo(8, 8).save(root / "emb" / "x.png")
    inside = discover([str(root)])[0]
    assert str(root / "emb" / "x.png") in [i.path for i in inside]
    assert str(root / "emb" / "x.png") not in [i.path for i in discover([str(root)], out=str(root / "emb"))[0]]


def test_file_lists_one_a_line_or_null_separated(tmp_path, monkeypatch):
    root = media_tree(tmp_path / "m")
    odd = root / "two\nlines.png"
    photo(8, 8).save(odd)
    latin1 = os.fsencode(root) + b"/caf\xe9.png"  # not UTF-8: only a NUL list can carry it
    with open(latin1, "wb") as f:
        photo(8, 8).save(f, "PNG")
    listing = tmp_path / "list"
    listing.write_text(f"{root / 'a.jpg'}\n\n{root / 'notes.txt'}\n")
    items, _ = discover([], files_from=str(listing))
    assert [(os.path.basename(i.path), i.kind) for i in items] == [("a.jpg", "image"), ("notes.txt", "unknown")]
    listing.write_bytes(os.fsencode(odd) + b"\0" + latin1 + b"\0" + os.fsencode(root / "sub") + b"\0")
    items, _ = discover([], files_from=str(listing), null=True)
    assert [i.path for i in items] == sorted([str(odd), os.fsdecode(latin1), str(root / "sub" / "b.png"),
                                              str(root / "sub" / "c.png")])  # the listed folder is walked
    assert all(i.kind == "image" and not i.error for i in items)
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(os.fsencode(odd) + b"\0"), encoding="utf-8"))
    assert [i.path for i in discover([], files_from="-", null=True)[0]] == [str(odd)]
    with pytest.raises(UsageError, match="--files-from"):
        discover([], files_from=str(tmp_path / "no-list"))


def test_a_file_cut_after_its_magic_is_still_what_it_claims(tmp_path):
    """The sniff reads SNIFF_BYTES bytes: a file cut after its magic is still seen as what it claims."""
    buf = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buf, "PNG")
    (tmp_path / "cut.bin").write_bytes(buf.getvalue()[:SNIFF_BYTES])
    assert look(str(tmp_path / "cut.bin")).kind == "image"


def test_globs_ignore_case_and_exclude_takes_a_folder_by_name(tmp_path):
    root = tmp_path / "m"
    for rel in ("IMG_0001.JPG", "img_0002.jpg", "cache/x.jpg", "a/cache/y.png", "a/Tmp/z.png", "a/keep.png"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        photo(8, 8).save(root / rel, "JPEG" if rel.lower().endswith("jpg") else "PNG")
    names = lambda **kw: [os.path.relpath(i.path, root) for i in discover([str(root)], **kw)[0]]  # noqa: E731
    assert names(include=["*.jpg"]) == ["IMG_0001.JPG", "cache/x.jpg", "img_0002.jpg"]
    assert names(include=["*.JPG"], exclude=["cache"]) == ["IMG_0001.JPG", "img_0002.jpg"]
    assert names(exclude=["cache/", "tmp"]) == ["IMG_0001.JPG", "a/keep.png", "img_0002.jpg"]
    assert names(exclude=["a/cache"]) == ["IMG_0001.JPG", "a/Tmp/z.png", "a/keep.png", "cache/x.jpg", "img_0002.jpg"]


def test_a_root_and_a_symlink_to_it_give_each_file_once(tmp_path):
    root = media_tree(tmp_path / "m")
    (tmp_path / "link").symlink_to(root)
    once = discover([str(root)])[0]
    both = discover([str(root), str(tmp_path / "link")])[0]
    assert [i.path for i in both] == [i.path for i in once]
    nested = discover([str(root), str(root / "sub")])[0]  # a root inside another: also once
    assert [i.path for i in nested] == [i.path for i in once]


def test_a_file_list_that_is_not_utf8_is_read_as_names(tmp_path, monkeypatch):
    root = media_tree(tmp_path / "m")
    latin1 = os.fsencode(root) + b"/caf\xe9.png"
    with open(latin1, "wb") as f:
        photo(8, 8).save(f, "PNG")
    listing = tmp_path / "list"
    listing.write_bytes(latin1 + b"\n" + os.fsencode(root / "a.jpg") + b"\n")
    items, _ = discover([], files_from=str(listing))
    assert [i.path for i in items] == sorted([os.fsdecode(latin1), str(root / "a.jpg")])
    assert all(not i.error and i.kind == "image" for i in items)
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(listing.read_bytes()), encoding="utf-8"))
    assert [i.path for i in discover([], files_from="-")[0]] == [i.path for i in items]


def test_heif_is_told_by_its_compatible_brands_too():
    """A HEIF whose major brand is blank, mif3 or jpeg (JPEG-coded) is an image, not a one-frame
    video; an MP4 or a QuickTime file is still a video (issue 46)."""
    from gemma4enc.media.kinds import SNIFF_BYTES, sniff

    assert SNIFF_BYTES >= 48
    for head in (b"\x00\x00\x00\x1cftyp\x00\x00\x00\x00\x00\x00\x00\x00mif1heicmiaf",
                 b"\x00\x00\x00\x18ftypmif3\x00\x00\x00\x00mif3miaf",
                 b"\x00\x00\x00\x18ftypjpeg\x00\x00\x00\x00jpegmif1",
                 b"\x00\x00\x00\x20ftypheic\x00\x00\x00\x00mif1miafMiHBheic"):
        assert sniff(head) == "image", head
    for head in (b"\x00\x00\x00\x20ftypisom\x00\x00\x02\x00isomiso2avc1mp41",
                 b"\x00\x00\x00\x14ftypqt  \x00\x00\x02\x00qt  ", b"\x00\x00\x00\x18ftyp3gp5\x00\x00\x00\x003gp5isom"):
        assert sniff(head) == "video", head
