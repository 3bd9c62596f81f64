"""WebDataset shards as inputs: a .tar (local or by URL, brace patterns such as
shard-{00000..00099}.tar) read as the files it holds, without unpacking.

Each image or video member is one item keyed TAR_PATH/MEMBER; its sample's sidecars (the
members with the same key ending .json or .txt, as img2dataset writes them) go into its row.
A tar cut short (a download that stopped) gives its whole members; the cut is a row of its own.
Decoding reads a member's bytes in place: the tar's headers are indexed once per process
(tarfile, seeking header to header) and a member is a window on the tar's file object.
"""

from __future__ import annotations

import io
import os
import re
from collections import OrderedDict

from . import remote

SIDECARS = (".json", ".txt")
_RANGE = re.compile(r"\{(\d+)\.\.(\d+)\}")
_CHOICE = re.compile(r"\{([^{}]*,[^{}]*)\}")


def is_tar(path: str) -> bool:
    return path.endswith(".tar")


def expand(pattern: str) -> list[str]:
    """Brace patterns as WebDataset writes them: {00000..00099} (zero padding kept) and {a,b}."""
    found = [m for m in (_RANGE.search(pattern), _CHOICE.search(pattern)) if m]
    if not found:
        return [pattern]
    m = min(found, key=lambda m: m.start())  # the leftmost first: names come out in order
    if m.re is _RANGE:
        lo, hi = m.group(1), m.group(2)
        width = len(lo) if lo.startswith("0") or len(lo) == len(hi) else 0
        choices = [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]
    else:
        choices = m.group(1).split(",")
    head, tail = pattern[: m.start()], pattern[m.end() :]
    return [p for c in choices for p in expand(head + c + tail)]


def _open(tar: str):
    return remote.open_url(tar) if remote.is_url(tar) else open(tar, "rb")


def sample_key(name: str) -> str:
    """WebDataset's key of a member: its path up to the first dot of the file name."""
    folder, _, base = name.rpartition("/")
    return (folder + "/" if folder else "") + base.split(".", 1)[0]


class TarIndex(dict):
    """member name → (data offset, size, mtime) of every whole regular member, in the tar's order.

    A tar cut short (a download that stopped) is read up to the cut: `cut` says where it ends and
    why it is taken as cut ("" for a whole tar), `partial` is the member the cut falls in, as
    (name, offset, bytes the tar holds of it, mtime, its size), or None. `refused`: the members
    that are not read, each (the row's member name, size, mtime, why): names that climb out of
    the tar or hold control characters, links, devices and FIFOs, and a member that a later one
    of the same name replaces (tar -x keeps the later: it is the one encoded, under the name)."""

    cut = ""
    partial: tuple[str, int, int, int, int] | None = None

    def __init__(self):
        super().__init__()
        self.refused: list[tuple[str, int, int, str]] = []


_KINDS = {"issym": "a symbolic link", "islnk": "a hard link", "ischr": "a character device",
          "isblk": "a block device", "isfifo": "a FIFO"}


def escaped(name: str) -> str:
    """A member name that cannot be read as a path outside the tar or steer a terminal: control
    characters, undecodable bytes, '%' and '/' as %XX (so `../x` is one harmless component), and a
    name of dots only with its dots escaped. Used for refused members' rows and messages."""
    out = []
    for c in name:
        if c.isprintable() and c not in "%/":
            out.append(c)
        else:
            out += [f"%{b:02X}" for b in c.encode("utf-8", "surrogateescape")]
    text = "".join(out)
    return text.replace(".", "%2E") if set(text) <= {"."} else text


def _refusal(m) -> str | None:
    """Why member `m` is not read, or None for a regular member with a plain name (folders: "")."""
    name = m.name
    parts = name.split("/")
    if not name or name.startswith("/") or ".." in parts:
        return f"refused: the member's name '{escaped(name)}' reaches outside the tar (absolute or '..')"
    if not all(c.isprintable() for c in name):
        return f"refused: the member's name '{escaped(name)}' holds control characters"
    if m.isdir():
        return ""
    for test, said in _KINDS.items():
        if getattr(m, test)():
            target = f" to '{escaped(m.linkname)}'" if m.issym() or m.islnk() else ""
            return f"unsupported: {said}{target}; gemma4enc reads only a tar's regular members"
    if not m.isreg():
        return "unsupported: not a regular member; gemma4enc reads only a tar's regular members"
    return None


def _index(f) -> TarIndex:
    """The members of the tar `f`, and where it is cut if it is. A tar ends with a block of zeros
    (its end-of-archive marker); one that stops before it, in a member's data or in a header, is
    cut short. A file with no whole first header is no tar (tarfile.ReadError)."""
    import tarfile  # imported by a tar's first use: a local run does not pay for it

    total = f.seek(0, io.SEEK_END)
    f.seek(0)
    index, last = TarIndex(), None
    try:
        with tarfile.open(fileobj=f, mode="r:") as t:
            for m in t:
                last = m
                why = _refusal(m)
                if why:
                    index.refused.append((escaped(m.name), m.size, int(m.mtime), why))
                elif why is None:
                    if m.name in index:  # a later member of the same name replaces it, as in tar -x
                        offset, size, mtime = index.pop(m.name)
                        index.refused.append((f"{m.name}@{offset}", size, mtime,
                                              f"replaced: a later member of the tar has the same name "
                                              f"(at byte {m.offset_data:,}); that one is encoded under it"))
                    index[m.name] = (m.offset_data, m.size, int(m.mtime))
            f.seek(t.offset)  # where tarfile stopped: the end-of-archive marker, in a whole tar
            whole = f.read(512) == bytes(512)
    except tarfile.ReadError:
        if last is None:
            raise  # not a tar
        whole = False  # tarfile found the data of `last` (or its padding) cut short
    if whole:
        return index
    if last is not None and last.name in index and last.offset_data + last.size > total:
        held = max(0, total - last.offset_data)
        del index[last.name]
        index.partial = (last.name, last.offset_data, held, int(last.mtime), last.size)
        index.cut = (f"the tar ends at byte {total:,}, {held:,} bytes into the {last.size:,} of "
                     f"{last.name}: cut short (a download that stopped?)")
    else:
        index.cut = (f"the tar ends at byte {total:,}, after {last.name if last else 'no member'}, "
                     "without its end-of-archive marker: cut short (a download that stopped?) or damaged")
    return index


def members(tar: str) -> tuple[object, dict, TarIndex]:
    """(the tar's open file, member name → (offset, size, mtime) of its samples' media candidates,
    the whole index): every whole regular member but the sidecars, which travel with their
    sample's row. The caller closes the file (it reads first bytes through it)."""
    f = _open(tar)
    try:
        index = _index(f)
    except BaseException:
        f.close()
        raise
    _remember(tar, index)  # this run's index, not one an earlier run in this process read
    return f, {name: entry for name, entry in index.items() if not name.endswith(SIDECARS)}, index


def member_of(path: str, root: str | None, rel: str | None) -> bool:
    """Whether an item is a tar's member: its root is the tar (a file), its rel the member."""
    return (
        root is not None
        and rel is not None
        and is_tar(root)
        and path == f"{root}/{rel}"
        and (remote.is_url(root) or not os.path.isdir(root))
    )


def open_source(path: str, root: str | None, rel: str | None):
    """What a decoder reads an item from: its local path (a str, as before), or a file object for
    a URL or a tar's member."""
    if member_of(path, root, rel):
        return open_member(root, rel)
    if remote.is_url(path):
        return remote.open_url(path)
    return path


# the last few tars' indexes in this process: a worker decodes a tar's members one after another
_INDEXES: OrderedDict[str, dict] = OrderedDict()


def index_of(tar: str) -> TarIndex:
    if tar not in _INDEXES:
        with _open(tar) as f:
            _remember(tar, _index(f))
    _INDEXES.move_to_end(tar)
    return _INDEXES[tar]


def _remember(tar: str, index: TarIndex) -> None:
    _INDEXES[tar] = index
    _INDEXES.move_to_end(tar)
    while len(_INDEXES) > 4:
        _INDEXES.popitem(last=False)


class _Window(io.RawIOBase):
    """Bytes [offset, offset + size) of a seekable file, as a file of its own."""

    def __init__(self, f, offset: int, size: int):
        self.f, self.offset, self.size, self.pos = f, offset, size, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self.pos

    def seek(self, pos, whence=0):
        self.pos = max(0, {0: pos, 1: self.pos + pos, 2: self.size + pos}[whence])
        return self.pos

    def readinto(self, b):
        n = max(0, min(len(b), self.size - self.pos))
        if not n:
            return 0
        self.f.seek(self.offset + self.pos)
        data = self.f.read(n)
        b[: len(data)] = data
        self.pos += len(data)
        return len(data)

    def close(self):
        if not self.closed:
            self.f.close()
        super().close()


def open_member(tar: str, name: str):
    """A seekable binary file object over one member's bytes."""
    entry = index_of(tar).get(name)
    if entry is None:
        raise FileNotFoundError(2, "no such member in the tar", f"{tar}/{name}")
    offset, size, _ = entry
    return io.BufferedReader(_Window(_open(tar), offset, size), buffer_size=1 << 16)


def sidecars(tar: str, name: str) -> dict:
    """The sample's .json (parsed; its text where it is not JSON) and .txt members, by extension."""
    import json

    index, key, found = index_of(tar), sample_key(name), {}
    for ext in SIDECARS:
        entry = index.get(key + ext)
        if entry is None:
            continue
        offset, size, _ = entry
        with _open(tar) as f:
            f.seek(offset)
            text = f.read(size).decode("utf-8", "replace")
        if ext == ".json":
            try:
                found["json"] = json.loads(text)
                continue
            except ValueError:
                pass
        found[ext[1:]] = text
    return found
