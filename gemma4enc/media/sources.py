"""Inputs that are not a local folder's files: URLs (remote.py) and WebDataset tars' members
(webdataset.py), looked at and listed as discover's candidates; brace patterns expanded; whether
an input is still there, asked of the store it lives in."""

from __future__ import annotations

import os
from typing import Iterable

from ..errors import UsageError
from ..rows import Status
from . import remote, webdataset
from .kinds import DONE, SNIFF_BYTES, Item, Known, ext_kind, kind_of


def look_remote(
    path: str,
    known: Known | None = None,
    root: str | None = None,
    rel: str | None = None,
    info: dict | None = None,
) -> Item | None:
    """look() for a URL (size and mtime from `info`, its listing entry, else asked for) or a tar's
    member (root: the tar, rel: the member); first bytes are read only when `known` does not
    recognise the file."""
    import tarfile  # here: a local run does not pay for its import

    member = webdataset.member_of(path, root, rel)
    try:
        if member:
            entry = webdataset.index_of(root).get(rel)
            if entry is None:
                return Item(
                    path, ext_kind(path), 0, 0, "no such member in the tar", root, rel, Status.NOT_FOUND
                )
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
        return Item(path, ext_kind(path), 0, 0, "file not found", root, rel, Status.NOT_FOUND)
    except UsageError:
        raise
    except (OSError, tarfile.TarError) as e:
        return Item(
            path,
            ext_kind(path),
            0,
            0,
            f"cannot read: {getattr(e, 'strerror', None) or e}",
            root,
            rel,
            Status.UNREADABLE,
        )
    return Item(path, kind_of(path, head), size, mtime, None, root, rel)


def tar_members(tar: str, pattern: str | None = None) -> Iterable[tuple]:
    """discover's candidates for one WebDataset tar: every whole member but the sidecars, sniffed
    through the tar's file object. A tar that is not one is a row saying so; so is a tar cut short
    (its whole members are candidates as usual) and the member the cut falls in, and so is each
    member it does not read (webdataset.TarIndex.refused). A tar missing
    from a brace `pattern` (img2dataset leaves gaps) is a not_found row, not the run's end."""
    import tarfile

    try:
        f, found, index = webdataset.members(tar)
    except FileNotFoundError:
        if pattern is None:
            raise UsageError(f"{tar}: no such file or folder") from None
        reason = f"not found: {pattern} names it; the range's other tars are encoded"
        yield tar, tar, True, None, _whole(tar, 0, 0, reason, Status.NOT_FOUND)
        return
    except (OSError, tarfile.TarError) as e:
        reason = f"cannot read this tar: {getattr(e, 'strerror', None) or e}"
        yield (
            tar,
            tar,
            True,
            None,
            lambda known: Item(tar, "unknown", 0, 0, reason, status=Status.UNREADABLE),
        )
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
        if index.cut:
            stamp = remote.head(tar, 0)[1] if remote.is_url(tar) else os.stat(tar).st_mtime_ns
            yield tar, tar, True, None, _whole(tar, f.seek(0, os.SEEK_END), stamp, index.cut, Status.UNREADABLE)
        for name, size, mtime, reason in index.refused:  # each a row: nothing in a tar vanishes unsaid
            path = f"{tar}/{name}"
            yield path, name, True, tar, _whole(path, size, mtime * 1_000_000_000, reason,
                                                Status.UNSUPPORTED, tar, name)
        if index.partial and not index.partial[0].endswith(webdataset.SIDECARS):
            name, _, held, mtime, size = index.partial
            path = f"{tar}/{name}"
            reason = f"cut short: the tar holds {held:,} of its {size:,} bytes"
            # its size as held: the whole member, once the tar is fetched again, is encoded
            yield path, name, True, tar, _whole(path, held, mtime * 1_000_000_000, reason,
                                                Status.UNREADABLE, tar, name)


def _whole(path, size, mtime_ns, reason, status, root=None, rel=None):
    """make(known) of a row that records why `path` has no tokens (a tar missing or cut short), once:
    a re-run over the same state finds its row and adds none (unless --retry-failed)."""

    def make(known):
        if known and known(path, size, mtime_ns) is DONE:
            return None
        return Item(path, ext_kind(path) if rel else "unknown", size, mtime_ns, reason, root, rel, status)

    return make


def url_files(url: str, hidden: bool, errors: list) -> Iterable[tuple]:
    """discover's candidates under a URL: its listing, one folder at a time."""
    for path, rel, root, info in remote.walk(url, hidden, errors):
        yield (
            path,
            rel,
            root is None,
            root,
            (
                lambda known, path=path, root=root, rel=rel, info=info: look_remote(
                    path, known, root, None if root is None else rel, info
                )
            ),
        )


def expanded(root: str) -> list[str]:
    """A brace pattern (shard-{00000..00099}.tar) as its names; a local name that exists as written
    is taken as written."""
    if "{" not in root or (not remote.is_url(root) and os.path.lexists(root)):
        return [root]
    return webdataset.expand(root)


def ranged(roots: list[str]) -> list[tuple[str, str | None]]:
    """(name, the brace pattern it comes from, or None) of each root, patterns expanded. Of a
    local pattern, a name that is not there is kept (a gap: its row says so) as long as one is;
    a pattern none of whose names exists is a typo, said at once."""
    out = []
    for root in roots:
        names = expanded(root)
        if names == [root]:
            out.append((root, None))
            continue
        if not remote.is_url(root) and not any(os.path.lexists(n) for n in names):
            raise UsageError(f"{root}: no such file or folder (none of its {len(names):,} names)")
        out += [(n, root) for n in names]
    return out


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
