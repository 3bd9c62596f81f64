"""Roots or a file list → one sorted list of media files, kind sniffed from the bytes."""

from __future__ import annotations

import fnmatch
import itertools
import os
import stat
import sys
from dataclasses import dataclass
from typing import Callable, Iterable

from ..errors import UsageError
from ..rows import Status
from . import remote, webdataset

IMAGE_EXTS = {".jpg", ".jpeg", ".png", ".gif", ".webp", ".bmp", ".tif", ".tiff", ".avif", ".jfif", ".ppm",
              ".pgm", ".pbm", ".ico", ".tga"}
VIDEO_EXTS = {".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi", ".mpg", ".mpeg", ".ts", ".mts", ".flv",
              ".wmv", ".3gp", ".ogv"}
SNIFF_BYTES = 32


@dataclass(frozen=True, slots=True)  # slots: a million of them fit in ~100 MB
class Item:
    path: str  # absolute path, symlinks not resolved: the name the user knows
    kind: str  # "image" | "video" | "unknown"
    size: int  # bytes
    mtime_ns: int
    error: str | None = None  # set when the file could not even be looked at (broken link, no access)
    root: str | None = None  # the root folder it was found under (absolute), when found by walking
    rel: str | None = None  # its path relative to that root: how a moved or remounted root is recognised
    status: str | None = None  # with `error`: the row's Status (discovery knows why, the worker does not guess)


def sniff(head: bytes) -> str | None:
    """The kind a file's first bytes say, or None when they say nothing we know."""
    if head[:3] == b"\xff\xd8\xff" or head[:8] == b"\x89PNG\r\n\x1a\n" or head[:4] in (b"GIF8",):
        return "image"
    if head[:2] == b"BM" or head[:4] in (b"II*\x00", b"MM\x00*") or head[:4] == b"\x00\x00\x01\x00":
        return "image"
    if head[:4] == b"RIFF":
        return {b"WEBP": "image", b"AVI ": "video"}.get(head[8:12])
    if head[4:8] == b"ftyp":
        brand = head[8:12]
        return "image" if brand in (b"avif", b"avis", b"heic", b"heix", b"mif1", b"msf1") else "video"
    if head[:4] == b"\x1a\x45\xdf\xa3" or head[:3] == b"FLV" or head[:4] in (b"\x00\x00\x01\xba", b"\x00\x00\x01\xb3"):
        return "video"
    if head[:4] == b"OggS" or head[:16] == b"\x30\x26\xb2\x75\x8e\x66\xcf\x11\xa6\xd9\x00\xaa\x00\x62\xce\x6c":
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


def look(path: str, known: Known | None = None, root: str | None = None, rel: str | None = None) -> Item | None:
    """stat + sniff one path; failures become an Item with `error`, never an exception.

    A file `known` recognises (same size and mtime as its row) is only stat'ed: a re-run over
    a million known files costs a million stats, not a million opens; one it calls DONE gives
    None: ten million of them cost no Item each. `root`/`rel`: where a walk found it, kept on
    the Item (also on a failed one). A URL or a tar's member is looked at through look_remote."""
    if (path[:1] != "/" or root is not None and root.endswith(".tar")) and (
            remote.is_url(path) or webdataset.member_of(path, root, rel)):
        return look_remote(path, known, root, rel)
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):  # a FIFO or device is never opened: reading one could hang
            return Item(path, _ext_kind(path), 0, 0, "not a regular file", root, rel, Status.UNSUPPORTED)
        kind = known(path, st.st_size, st.st_mtime_ns) if known else None
        if kind is DONE:
            return None
        if kind:
            return Item(path, kind, st.st_size, st.st_mtime_ns, None, root, rel)
        with open(path, "rb") as f:
            head = f.read(SNIFF_BYTES)
    except FileNotFoundError:
        reason = "broken symlink" if os.path.islink(path) else "file not found"
        return Item(path, _ext_kind(path), 0, 0, reason, root, rel, Status.NOT_FOUND)
    except OSError as e:
        return Item(path, _ext_kind(path), 0, 0, f"cannot read: {e.strerror or e}", root, rel, Status.UNREADABLE)
    return Item(path, kind_of(path, head), st.st_size, st.st_mtime_ns, None, root, rel)


def look_remote(path: str, known: Known | None = None, root: str | None = None, rel: str | None = None,
                info: dict | None = None) -> Item | None:
    """look() for a URL (size and mtime from `info`, its listing entry, else asked for) or a tar's
    member (root: the tar, rel: the member); first bytes are read only when `known` does not
    recognise the file."""
    import tarfile  # here: a local run does not pay for its import

    member = webdataset.member_of(path, root, rel)
    try:
        if member:
            entry = webdataset.index_of(root).get(rel)
            if entry is None:
                return Item(path, _ext_kind(path), 0, 0, "no such member in the tar", root, rel, Status.NOT_FOUND)
            size, mtime = entry[1], entry[2] * 1_000_000_000
        elif info is None:
            size, mtime, _ = remote.head(path, 0)
        else:
            size, mtime = int(info.get("size") or 0), remote.stamp(info)
        kind = known(path, size, mtime) if known else None
        if kind is DONE:
            return None
        if kind:
            return Item(path, kind, size, mtime, None, root, rel)
        if member:
            with webdataset.open_member(root, rel) as f:
                head = f.read(SNIFF_BYTES)
        else:
            head = remote.first_bytes(path, SNIFF_BYTES) if size else b""
    except FileNotFoundError:
        return Item(path, _ext_kind(path), 0, 0, "file not found", root, rel, Status.NOT_FOUND)
    except UsageError:
        raise
    except (OSError, tarfile.TarError) as e:
        return Item(path, _ext_kind(path), 0, 0, f"cannot read: {getattr(e, 'strerror', None) or e}", root, rel,
                    Status.UNREADABLE)
    return Item(path, kind_of(path, head), size, mtime, None, root, rel)


def _tar_members(tar: str) -> Iterable[tuple]:
    """discover's candidates for one WebDataset tar: every member but the sidecars, sniffed through
    the tar's file object; a tar that is not one is a row saying so."""
    import tarfile

    try:
        f, found = webdataset.members(tar)
    except FileNotFoundError:
        raise UsageError(f"{tar}: no such file or folder") from None
    except (OSError, tarfile.TarError) as e:
        reason = f"cannot read this tar: {getattr(e, 'strerror', None) or e}"
        yield tar, tar, True, None, lambda known: Item(tar, "unknown", 0, 0, reason, status=Status.UNREADABLE)
        return

    def maker(name, offset, size, mtime):
        def make(known):
            path, mtime_ns = f"{tar}/{name}", mtime * 1_000_000_000
            kind = known(path, size, mtime_ns) if known else None
            if kind is DONE:
                return None
            if not kind:
                f.seek(offset)
                kind = kind_of(name, f.read(min(size, SNIFF_BYTES)))
            return Item(path, kind, size, mtime_ns, None, tar, name)
        return make

    with f:
        for name, (offset, size, mtime) in found.items():
            yield f"{tar}/{name}", name, False, tar, maker(name, offset, size, mtime)


def _url_files(url: str, hidden: bool, errors: list) -> Iterable[tuple]:
    """discover's candidates under a URL: its listing, one folder at a time."""
    for path, rel, root, info in remote.walk(url, hidden, errors):
        yield path, rel, root is None, root, (
            lambda known, path=path, root=root, rel=rel, info=info: look_remote(
                path, known, root, None if root is None else rel, info))


def _ext_kind(path: str) -> str:
    ext = os.path.splitext(path)[1].lower()
    return "image" if ext in IMAGE_EXTS else "video" if ext in VIDEO_EXTS else "unknown"


def _matches(rel: str, include: list[str], exclude: list[str]) -> bool:
    name = os.path.basename(rel)
    hit = lambda pats: any(fnmatch.fnmatch(rel, p) or fnmatch.fnmatch(name, p) for p in pats)  # noqa: E731
    return (not include or hit(include)) and not hit(exclude)


def walk(root: str, hidden: bool = False, errors: list[tuple[str, str]] | None = None,
         skip: str | None = None) -> Iterable[str]:
    """Every file under root (root itself if a file), following symlinks without loops.

    Folders that cannot be listed go to `errors` as (path, reason) instead of vanishing;
    the folder `skip` (OUT, when it lies inside a root) is not entered.
    """
    if not os.path.isdir(root):
        yield root
        return
    seen: set[tuple[int, int]] = set()
    if skip and os.path.isdir(skip):
        st = os.stat(skip)
        seen.add((st.st_dev, st.st_ino))
    on_error = (lambda e: errors.append((e.filename, e.strerror or str(e)))) if errors is not None else None
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True, onerror=on_error):
        st = os.stat(dirpath)
        if (st.st_dev, st.st_ino) in seen:  # a symlink back up the tree
            dirnames[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        if not hidden:
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            filenames = [f for f in filenames if not f.startswith(".")]
        for name in filenames:
            yield os.path.join(dirpath, name)


def _listed(files_from: str, null: bool = False) -> list[str]:
    """--files-from: one path a line, or NUL-ended names with `null` ('-' = stdin)."""
    try:
        if null:  # bytes: no newline translation, and names that are not UTF-8 survive
            raw = sys.stdin.buffer.read() if files_from == "-" else open(files_from, "rb").read()
            return [os.fsdecode(name) for name in raw.split(b"\0") if name]
        stream = sys.stdin if files_from == "-" else open(files_from, encoding="utf-8")
        with stream:
            return [line.rstrip("\n") for line in stream if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--files-from {files_from}: {getattr(e, 'strerror', None) or e}") from None


def _below(root: str, paths: Iterable[str]) -> Iterable[tuple[str, str, str]]:
    """(path, its part past root, root) for walked paths, one at a time."""
    cut = len(root) if root.endswith(os.sep) else len(root) + 1  # each path is root + sep + rel
    return ((p, p[cut:], root) for p in paths)


def discover(roots: list[str], files_from: str | None = None, include: list[str] = (), exclude: list[str] = (),
             hidden: bool = False, null: bool = False, out: str | None = None,
             known: Known | None = None) -> tuple[list[Item], int]:
    """(media items in one stable sorted order, count of files skipped as not media).

    Files named explicitly (a root that is a file, or a --files-from line) are always kept,
    so an unsupported one gets a row saying so; files found by walking are kept only when
    they look like media. A listed folder is walked like a root; OUT is never walked.
    With `null` the list's names end in NUL bytes (find -print0): a name may hold a newline.
    `known`: see look(); the files it calls DONE are left out of the list.
    """
    counts = {}
    (items,) = discover_chunks(roots, files_from, include, exclude, hidden, null, out, known, None, counts)
    return items, counts["skipped"]


CHUNK = 50_000  # Items a streamed discovery holds at a time (~430 bytes each with their strings)


def discover_chunks(roots: list[str], files_from: str | None = None, include: list[str] = (),
                    exclude: list[str] = (), hidden: bool = False, null: bool = False, out: str | None = None,
                    known: Known | None = None, chunk: int | None = 0, counts: dict | None = None):
    """discover(), as sorted lists of about `chunk` items, found as they are asked for: memory holds a
    chunk, not the folder. Each chunk is sorted; the whole is one list in discover()'s order when
    it fits in one chunk. Only walked roots none of which lies inside another stream: files
    named on the command line or in --files-from could be named twice, and one row a path needs
    the whole list. `counts["skipped"]`: files skipped as not media so far; `counts["last"]`: set
    when the chunk being handed over is the last. At least one chunk
    (maybe empty) is yielded; roots are checked before the first. chunk=0: CHUNK; None: one list.
    """
    chunk = CHUNK if chunk == 0 else chunk
    counts = {} if counts is None else counts
    counts["skipped"] = 0
    named: list[str] = []
    walked = []  # per root: (path, path relative to its root: what globs see, root), walked lazily
    elsewhere = []  # per URL or tar root: (path, rel, explicit, root, make(known) → Item)
    walked_roots, remote_roots = [], []
    listed = _listed(files_from, null) if files_from else []
    unlisted: list[tuple[str, str]] = []
    roots = [p for r in roots for p in _expanded(r)]
    listed = [p for r in listed for p in _expanded(r)]
    for root in roots:
        if not remote.is_url(root) and not os.path.lexists(root):  # a typo, not a file that vanished: say so now
            raise UsageError(f"{root}: no such file or folder")
    for root in [*roots, *listed]:
        url = remote.is_url(root)
        if webdataset.is_tar(root) and (url or os.path.isfile(root)):
            remote_roots.append(root if url else os.path.abspath(root))
            elsewhere.append(_tar_members(remote_roots[-1]))
        elif url:
            remote_roots.append(root)
            elsewhere.append(_url_files(root, hidden, unlisted))
        elif os.path.isdir(root):
            root = os.path.abspath(root)  # walked paths come out absolute and normalised: no abspath each
            walked_roots.append(root)
            walked.append(_below(root, walk(root, hidden, unlisted, skip=out)))
        else:
            named.append(root)
    if chunk is not None and (named or listed or _nested([*walked_roots, *remote_roots])):
        chunk = None  # a path may come twice: one list, deduplicated, as ever
    items: dict[str, Item] = {}
    # generators, not lists: at a million files each list of them costs ~100 MB
    candidates = itertools.chain(((os.path.abspath(p), p, True, None, None) for p in named),
                                 ((p, rel, False, root, None) for p, rel, root in itertools.chain(*walked)),
                                 *elsewhere)
    include, exclude = list(include), list(exclude)
    for path, rel, explicit, root, make in candidates:
        if (include or exclude) and not _matches(rel, include, exclude):
            continue
        item = look(path, known, root, None if root is None else rel) if make is None else make(known)
        if item is None:
            continue  # done already: `known` counted it
        if item.kind == "unknown" and not explicit:
            counts["skipped"] += 1
            continue
        items[item.path] = item
        if chunk is not None and len(items) >= chunk:
            yield sorted(items.values(), key=lambda i: i.path)
            items = {}
    for path, reason in unlisted:  # a row says which folder was not read, and why
        path = path if remote.is_url(path) else os.path.abspath(path)
        items.setdefault(path, Item(path, "unknown", 0, 0, error=f"cannot list this folder: {reason}",
                                    status=Status.UNREADABLE))
    counts["last"] = True  # what follows is the last chunk: a caller need not stream
    yield sorted(items.values(), key=lambda i: i.path)


def _nested(roots: list[str]) -> bool:
    """Whether one root lies inside another (or is given twice): its files would come twice."""
    ordered = sorted(r.rstrip("/") + "/" for r in roots)
    return any(b.startswith(a) for a, b in zip(ordered, ordered[1:]))



def _expanded(root: str) -> list[str]:
    """A brace pattern (shard-{00000..00099}.tar) as its names; a local name that exists as written
    is taken as written."""
    if "{" not in root or (not remote.is_url(root) and os.path.lexists(root)):
        return [root]
    return webdataset.expand(root)


def exists(path: str) -> bool:
    """Whether an input is still there: a local file, a URL (asked of its store), a tar's member (its tar)."""
    tar, sep, _ = path.partition(".tar/")
    if sep and (remote.is_url(path) or os.path.isfile(tar + ".tar")):
        path = tar + ".tar"
    if remote.is_url(path):
        try:
            return remote.exists(path)
        except (OSError, UsageError):
            return True  # cannot tell: nothing is pruned or counted as deleted on a guess
    return os.path.exists(path)
