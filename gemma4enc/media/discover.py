"""Roots or a file list → one sorted list of media files, kind sniffed from the bytes."""

from __future__ import annotations

import fnmatch
import itertools
import logging
import os
import stat
import sys
from typing import Iterable

from ..errors import UsageError, no_credentials
from ..rows import Status
from . import remote, webdataset
from .kinds import DONE, SNIFF_BYTES, Item, Known, ext_kind, kind_of
from .sources import look_remote, ranged, tar_members, url_files


def look(
    path: str, known: Known | None = None, root: str | None = None, rel: str | None = None
) -> Item | None:
    """stat + sniff one path; failures become an Item with `error`, never an exception.

    A file `known` recognises (same size and mtime as its row) is only stat'ed: a re-run over
    a million known files costs a million stats, not a million opens; one it calls DONE gives
    None: ten million of them cost no Item each. `root`/`rel`: where a walk found it, kept on
    the Item (also on a failed one). A URL or a tar's member is looked at through look_remote."""
    if (path[:1] != "/" or root is not None and root.endswith(".tar")) and (
        remote.is_url(path) or webdataset.member_of(path, root, rel)
    ):
        return look_remote(path, known, root, rel)
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):  # a FIFO or device is never opened: reading one could hang
            return Item(path, ext_kind(path), 0, 0, "not a regular file", root, rel, Status.UNSUPPORTED)
        kind = known(path, st.st_size, st.st_mtime_ns) if known else None
        if kind is DONE:
            return None
        if kind:
            return Item(path, kind, st.st_size, st.st_mtime_ns, None, root, rel)
        with open(path, "rb") as f:
            head = f.read(SNIFF_BYTES)
    except FileNotFoundError:
        reason = "broken symlink" if os.path.islink(path) else "file not found"
        return Item(path, ext_kind(path), 0, 0, reason, root, rel, Status.NOT_FOUND)
    except OSError as e:
        return Item(
            path, ext_kind(path), 0, 0, f"cannot read: {e.strerror or e}", root, rel, Status.UNREADABLE
        )
    return Item(path, kind_of(path, head), st.st_size, st.st_mtime_ns, None, root, rel)


def _matches(rel: str, include: list[str], exclude: list[str]) -> bool:
    """Globs on the path below its root or on the name, ignoring case (`*.jpg` takes `IMG_0001.JPG`);
    an --exclude also drops everything under a folder it names (`--exclude cache`, `a/tmp`)."""
    rel = rel.lower()
    name = os.path.basename(rel)
    hit = lambda pats: any(fnmatch.fnmatchcase(rel, p) or fnmatch.fnmatchcase(name, p) for p in pats)  # noqa: E731
    if include and not hit([p.lower() for p in include]):
        return False
    if not exclude:
        return True
    folders = rel.split(os.sep)[:-1]
    for p in (p.lower().rstrip(os.sep) for p in exclude):
        if (
            fnmatch.fnmatchcase(rel, p)
            or fnmatch.fnmatchcase(name, p)
            or fnmatch.fnmatchcase(rel, p + os.sep + "*")
            or any(fnmatch.fnmatchcase(folder, p) for folder in folders)
        ):
            return False
    return True


def walk(
    root: str,
    hidden: bool = False,
    errors: list[tuple[str, str]] | None = None,
    skip: str | None = None,
    seen: set[tuple[int, int]] | None = None,
) -> Iterable[str]:
    """Every file under root (root itself if a file), following symlinks without loops.

    Folders that cannot be listed go to `errors` as (path, reason) instead of vanishing;
    the folder `skip` (OUT, when it lies inside a root) is not entered. `seen`: the folders
    (device, inode) already walked, shared by the roots of one run, so that a root and a
    symlink to it (or a root inside another) give each file once.
    """
    if not os.path.isdir(root):
        yield root
        return
    seen = set() if seen is None else seen
    if skip and os.path.isdir(skip):
        st = os.stat(skip)
        seen.add((st.st_dev, st.st_ino))
    on_error = (
        (lambda e: errors.append((e.filename, e.strerror or str(e)))) if errors is not None else None
    )
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
    try:  # bytes: no newline translation, and names that are not UTF-8 survive (as os.listdir's do)
        if files_from == "-":
            raw = sys.stdin.buffer.read()
        elif remote.is_url(files_from):  # a list kept beside the data, in its store
            raw = remote.read_bytes(files_from)
        else:
            with open(files_from, "rb") as f:
                raw = f.read()
        if null:
            if raw.strip() and b"\0" not in raw and b"\n" in raw.strip():
                logging.getLogger("gemma4enc.discover").warning(
                    f"gemma4enc: warning: --files-from {files_from} with -0 holds no NUL byte but "
                    "several lines: read as ONE name; leave out -0 for one path a line"
                )
            return [os.fsdecode(name) for name in raw.split(b"\0") if name]
        return [os.fsdecode(line) for line in raw.split(b"\n") if line.strip()]
    except OSError as e:
        raise UsageError(f"--files-from {files_from}: {getattr(e, 'strerror', None) or e}") from None


def _below(root: str, paths: Iterable[str]) -> Iterable[tuple[str, str, str]]:
    """(path, its part past root, root) for walked paths, one at a time."""
    cut = len(root) if root.endswith(os.sep) else len(root) + 1  # each path is root + sep + rel
    return ((p, p[cut:], root) for p in paths)


def discover(
    roots: list[str],
    files_from: str | None = None,
    include: list[str] = (),
    exclude: list[str] = (),
    hidden: bool = False,
    null: bool = False,
    out: str | None = None,
    known: Known | None = None,
) -> tuple[list[Item], int]:
    """(media items in one stable sorted order, count of files skipped as not media).

    Files named explicitly (a root that is a file, or a --files-from line) are always kept,
    so an unsupported one gets a row saying so; files found by walking are kept only when
    they look like media. A listed folder is walked like a root; OUT is never walked.
    With `null` the list's names end in NUL bytes (find -print0): a name may hold a newline.
    `known`: see look(); the files it calls DONE are left out of the list.
    """
    counts = {}
    (items,) = discover_chunks(
        roots, files_from, include, exclude, hidden, null, out, known, None, counts
    )
    return items, counts["skipped"]


CHUNK = 50_000  # Items a streamed discovery holds at a time (~430 bytes each with their strings)


def discover_chunks(
    roots: list[str],
    files_from: str | None = None,
    include: list[str] = (),
    exclude: list[str] = (),
    hidden: bool = False,
    null: bool = False,
    out: str | None = None,
    known: Known | None = None,
    chunk: int | None = 0,
    counts: dict | None = None,
):
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
    listed = _listed(files_from, null) if files_from else []
    unlisted: list[tuple[str, str]] = []  # (folder, why it could not be listed), filled as walked
    for name in [*roots, *listed]:
        no_credentials(name, "--files-from" if name in listed else "input")
    roots, listed = ranged(roots), ranged(listed)  # (name, its brace pattern or None)
    _no_typos(roots)
    _reach([name for name, _ in [*roots, *listed]])
    named, walked, elsewhere, streamed = _sources([*roots, *listed], hidden, out, unlisted)
    if chunk is not None and (named or listed or _nested(streamed)):
        chunk = None  # a path may come twice: one list, deduplicated, as ever
    items: dict[str, Item] = {}
    # generators, not lists: at a million files each list of them costs ~100 MB
    candidates = itertools.chain(
        ((os.path.abspath(p), p, True, None, None) for p in named),
        ((p, rel, False, root, None) for p, rel, root in itertools.chain(*walked)),
        *elsewhere,
    )
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
        error = f"cannot list this folder: {reason}"
        items.setdefault(path, Item(path, "unknown", 0, 0, error=error, status=Status.UNREADABLE))
    counts["last"] = True  # what follows is the last chunk: a caller need not stream
    yield sorted(items.values(), key=lambda i: i.path)


def _no_typos(roots: list[tuple[str, str | None]]) -> None:
    """A root named on the command line that is not there is a typo, not a file that vanished:
    said now, before anything is read (a brace range's gaps and URLs are looked at later)."""
    for root, pattern in roots:
        if pattern is None and not remote.is_url(root) and not os.path.lexists(root):
            hint = " (to read the paths from stdin: --files-from -)" if root == "-" else ""
            raise UsageError(f"{root}: no such file or folder{hint}")


def _sources(roots: list[tuple[str, str | None]], hidden: bool, out: str | None, unlisted: list):
    """Each root sorted by what reads it, nothing read yet: → (the files named, per walked folder
    its (path, path relative to it: what globs see, root), per URL or tar root its (path, rel,
    explicit, root, make(known) → Item), the roots that stream). A folder that cannot be listed is
    added to `unlisted` as the walk reaches it."""
    named: list[str] = []
    walked, elsewhere, streamed = [], [], []
    seen: set[tuple[int, int]] = set()  # one for all roots: a folder reached twice is walked once
    for root, pattern in roots:
        url = remote.is_url(root)
        gap = pattern is not None and not url and not os.path.lexists(root)  # a tar missing from a range
        if webdataset.is_tar(root) and (url or gap or os.path.isfile(root)):
            streamed.append(root if url else os.path.abspath(root))
            elsewhere.append(tar_members(streamed[-1], pattern))
        elif url:
            streamed.append(root)
            elsewhere.append(url_files(root, hidden, unlisted))
        elif os.path.isdir(root):
            root = os.path.abspath(root)  # walked paths come out absolute and normalised
            streamed.append(root)
            walked.append(_below(root, walk(root, hidden, unlisted, skip=out, seen=seen)))
        else:
            named.append(root)
    return named, walked, elsewhere, streamed


def _reach(paths: list[str]) -> None:
    """One request to each store the URLs name (per bucket) before anything starts: missing or
    refused credentials, or an endpoint that does not answer, is one line and exit 2, not a row
    per file or a traceback."""
    asked = set()
    for path in paths:
        if remote.is_url(path):
            store = path.split("/", 3)[:3]  # protocol, '', bucket
            if tuple(store) not in asked:
                asked.add(tuple(store))
                remote.reach(path)


def _nested(roots: list[str]) -> bool:
    """Whether one root lies inside another (or is given twice): its files would come twice."""
    ordered = sorted(r.rstrip("/") + "/" for r in roots)
    return any(b.startswith(a) for a, b in zip(ordered, ordered[1:]))
