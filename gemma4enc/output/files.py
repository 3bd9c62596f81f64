"""The output folder's files and how they are written: their names, temp names, atomic writes
(temp file, fsync, rename, fsync the folder) and appended manifest rows."""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path

MANIFEST = "manifest.jsonl"


# shard-000012 from a local run; shard-<16 hex of the task's files>-000 from a Ray task
SHARD_RE = re.compile(r"^shard-(\d{6}|[0-9a-f]{16}-\d{3})\.safetensors$")


# our temp files, and only ours (a user's .draft.tmp in OUT is never touched): .gemma4enc-<name>.<pid>.tmp,
# and the names earlier versions used (.<our file>.<pid>.tmp, .write-test-<pid>.tmp)
TEMP_RE = re.compile(
    r"^\.gemma4enc-.+\.\d+\.tmp$|^\.(shard-[0-9a-f-]+\.safetensors|manifest\.jsonl|settings\.json)"
    r"\.\d+\.tmp$|^\.write-test-\d+\.tmp$"
)


def temp_name(name: str) -> str:
    return f".gemma4enc-{name}.{os.getpid()}.tmp"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@functools.cache
def _umask() -> int:
    """The process's umask, read without changing it (/proc), at the first write rather than at
    import; where /proc has no Umask line, set and put back at once."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def atomic_write(path: Path, write) -> None:
    """write(tmp_path), then fsync and rename into place: readers never see half a file."""
    tmp = path.with_name(temp_name(path.name))
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # safetensors writes 0600; others may need to read the shards
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass  # the folder went unwritable; the next run's cleanup removes it


def append_rows(out: Path, rows: list) -> None:
    """Append whole lines and fsync: a kill leaves at most a torn last line, which readers skip."""
    if not rows:
        return
    with open(Path(out) / MANIFEST, "ab") as f:
        f.write(b"".join(map(line_of, rows)))
        f.flush()
        os.fsync(f.fileno())


def line_of(row) -> bytes:
    """A Row (or a row's dict) as one manifest line."""
    if hasattr(row, "to_json"):
        row = row.to_json()
    # a file name that is not UTF-8 holds lone surrogates: written as \udcXX escapes, JSON reads it back
    return (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8", errors="backslashreplace")


def not_an_output(out) -> str:
    """What every command says of a folder without a manifest."""
    return f"{out}: no {MANIFEST}; is this a gemma4enc output folder?"
