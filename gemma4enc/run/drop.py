"""Acting on duplicate groups: the drop list, and the files moved to a quarantine folder.

What is dropped is re-checked against its row at the moment it is listed or moved (output/
ondisk.py): a file that is gone, changed since its encode, or an alias is never listed nor moved,
and neither is a file whose group's kept file does not stand, unchanged, on this disk. So a drop
list or a move can lose no file that has no live copy kept.

The move (`--move-dropped DIR`) is the safe apply, after fclones' `move`: each file is checked
again just before it moves, moved with rename (never over an existing file; across filesystems,
copied, fsynced and then removed), and recorded in DIR/gemma4enc-moves.jsonl, one line per move,
written before the next one, so that `--undo-moves DIR` puts every file back where it was.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError
from ..output import ondisk

UNDO = "gemma4enc-moves.jsonl"


@dataclass(frozen=True)
class Drop:
    path: str
    seen: ondisk.Seen  # the row of the file to drop
    kept: ondisk.Seen  # the row of its group's kept file


def standing(report: dict) -> tuple[list[Drop], int]:
    """(the drops that stand now, how many of the groups' drops were left out). A drop stands where
    it and its group's kept file are live and unchanged since their encode."""
    seen = {p: ondisk.Seen(p, *v) for p, v in report["seen"].items()}
    drops, left = [], 0
    for g in report["groups"]:
        keep_ok = g["keep"] in seen and ondisk.unchanged(seen[g["keep"]])
        for p in g["drop"]:
            if keep_ok and p in seen and ondisk.unchanged(seen[p]):
                drops.append(Drop(p, seen[p], seen[g["keep"]]))
            else:
                left += 1
    return drops, left


def list_bytes(paths: list[str], null: bool) -> bytes:
    """Paths one a line, or NUL-terminated with -0. A name holding a newline would be read as two
    paths by `xargs -d '\\n'`: without -0 such a list is refused, never written."""
    if not null:
        odd = [p for p in paths if "\n" in p or "\r" in p]
        if odd:
            raise UsageError(
                f"{len(odd)} path(s) to list hold a newline (the first: {odd[0]!r}), which would split "
                "it wrongly: use -0 (NUL-separated; `xargs -0`)"
            )
    end = "\0" if null else "\n"
    return "".join(p + end for p in paths).encode("utf-8", "surrogateescape")


def _mirrored(dest: Path, path: str) -> Path:
    """Where `path` goes under `dest`: its absolute path below it, so no two files meet."""
    return dest / os.path.abspath(path).lstrip("/")


def move(drops: list[Drop], dest: Path, log) -> dict:
    """Each drop re-checked, then moved under `dest` (its absolute path kept below it); an undo line
    for each. Returns counts."""
    dest.mkdir(parents=True, exist_ok=True)
    moved = skipped = 0
    with open(dest / UNDO, "a", encoding="utf-8", errors="surrogateescape") as undo:
        for d in drops:
            target = _mirrored(dest, d.path)
            if not ondisk.unchanged(d.seen) or not ondisk.unchanged(d.kept) or os.path.lexists(target):
                skipped += 1
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            _move_file(d.path, target)
            undo.write(json.dumps({"from": d.path, "to": str(target), "kept": d.kept.path, "size": d.seen.size,
                                   "mtime_ns": d.seen.mtime_ns}) + "\n")
            undo.flush()
            os.fsync(undo.fileno())
            moved += 1
    if skipped:
        log(f"{skipped} file(s) not moved: changed, gone or their kept file changed since the groups were made, "
            "or already in the quarantine folder")
    return {"moved": moved, "not_moved": skipped, "undo": str(dest / UNDO)}


def _move_file(src: str, target: Path) -> None:
    try:
        os.rename(src, target)
    except OSError as e:
        import errno

        if e.errno != errno.EXDEV:
            raise UsageError(f"cannot move {src!r} to {target}: {e.strerror or e}") from None
        shutil.copy2(src, target)  # another filesystem: copy, fsync, then remove the original
        with open(target, "rb") as f:
            os.fsync(f.fileno())
        os.unlink(src)


def undo(dest: Path, log) -> dict:
    """Every move recorded in DEST/gemma4enc-moves.jsonl put back, where its place is free."""
    record = dest / UNDO
    if not record.is_file():
        raise UsageError(f"{record}: no moves recorded here")
    back = blocked = 0
    lines = record.read_text(encoding="utf-8", errors="surrogateescape").splitlines()
    for line in reversed(lines):
        m = json.loads(line)
        if os.path.lexists(m["from"]) or not os.path.lexists(m["to"]):
            blocked += 1
            continue
        Path(m["from"]).parent.mkdir(parents=True, exist_ok=True)
        _move_file(m["to"], Path(m["from"]))
        back += 1
    if blocked:
        log(f"{blocked} file(s) not put back: their place is taken, or they are no longer in {dest}")
    else:
        record.unlink()
    return {"put_back": back, "not_put_back": blocked}
