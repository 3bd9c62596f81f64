"""Whether a row still describes the file it names: the one rule every consumer that acts on
files uses before it acts (duplicates, drop lists, the quarantine move).

A row records its input's path, size and mtime_ns at its encode. Now, on disk, that path is:
  live       a regular file of the same size and mtime (the row describes it);
  gone       nothing (moved, renamed, deleted, a remount elsewhere);
  changed    another size or mtime (overwritten or edited since its encode: its vector is stale);
  alias      the same file as a live row's path that is named more directly (a symlinked folder,
             a bind mount, a hard link, ./a/../a): one file, never both kept and dropped;
  elsewhere  inside a tar or at a URL: nothing here to check, so never dropped nor moved.
Only `live` rows may be grouped, kept or dropped. A file whose name changes how a list is split
(a newline) is live like any other: list outputs are NUL-separated with -0 (docs/search.md).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from typing import Iterable

from ..media.remote import is_url

LIVE, GONE, CHANGED, ALIAS, ELSEWHERE = "live", "gone", "changed", "alias", "elsewhere"


@dataclass(frozen=True)
class Seen:
    """A row as recorded: what to compare the disk with."""

    path: str
    size: int
    mtime_ns: int


def look(row: Seen) -> tuple[str, tuple[int, int] | None]:
    """(state, (st_dev, st_ino) of a live file) of one row, aliases not yet told apart."""
    if is_url(row.path):
        return ELSEWHERE, None
    try:
        st = os.stat(row.path)
    except NotADirectoryError:  # a member of a tar: TAR/MEMBER
        return ELSEWHERE, None
    except OSError:
        return GONE, None
    if not stat.S_ISREG(st.st_mode):
        return GONE, None
    if st.st_size != row.size or st.st_mtime_ns != row.mtime_ns:
        return CHANGED, None
    return LIVE, (st.st_dev, st.st_ino)


def judge(rows: dict[int, Seen]) -> dict[int, str]:
    """The state of each row (by id). Of the live rows that name one file (the same device and
    inode), one is that file's row: the one whose path is its own real path, else the first id;
    the others are aliases."""
    states: dict[int, str] = {}
    files: dict[tuple[int, int], list[int]] = {}  # (device, inode) -> the ids of its rows
    for i, row in sorted(rows.items()):
        states[i], key = look(row)
        if key is not None:
            files.setdefault(key, []).append(i)
    for ids in files.values():
        if len(ids) > 1:
            direct = [i for i in ids if os.path.realpath(rows[i].path) == rows[i].path]
            owner = (direct or ids)[0]
            for i in ids:
                if i != owner:
                    states[i] = ALIAS
    return states


def unchanged(row: Seen) -> bool:
    """Whether the row still describes its file, checked now (before a move or a delete)."""
    return look(row)[0] == LIVE


def stale_note(states: Iterable[str]) -> str:
    """'3 rows describe no file on disk now (2 gone, 1 changed): …', or '' where none."""
    counts: dict[str, int] = {}
    for s in states:
        if s not in (LIVE, ELSEWHERE):
            counts[s] = counts.get(s, 0) + 1
    if not counts:
        return ""
    total = sum(counts.values())
    parts = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    return (
        f"{total} row(s) describe no file on disk now ({parts}): left out of every group, never kept "
        "nor dropped; `gemma4enc compact OUT --prune` removes the rows of gone files, and a re-run of "
        "encode brings changed ones up to date"
    )
