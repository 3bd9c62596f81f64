"""How OUT's files are written: atomic writes (temp file, fsync, rename, fsync the folder) and
appended manifest rows. Their names are names.py's."""

from __future__ import annotations

import errno
import fcntl
import functools
import json
import os
import stat
from pathlib import Path

from ..errors import UsageError
from .names import LINE_MAX, MANIFEST, temp_name


SMALL_MAX = 1 << 20  # the most of one of OUT's small files (settings.json: about 1 KB) read


def read_own(path: Path) -> bytes:
    """One of OUT's small files whole (settings.json), through own_opener (no link, no FIFO, no
    device) and bounded: one past SMALL_MAX is no file gemma4enc wrote, refused in one line."""
    with open(path, "rb", opener=own_opener) as f:
        data = f.read(SMALL_MAX + 1)
    if len(data) > SMALL_MAX:
        raise UsageError(f"{path}: larger than {SMALL_MAX >> 20} MiB, not a file gemma4enc writes")
    return data


def own_opener(path, flags: int, mode: int = 0o644) -> int:
    """os.open for one of OUT's own files (the manifest, the lock, the search cache), as `open(...,
    opener=own_opener)`: never through a symbolic link, and only a regular file. A handed-over OUT
    whose manifest.jsonl links to ~/.bashrc must not get rows appended to the user's file, and a
    FIFO planted there must not block the run (O_NONBLOCK until the type is known).
    See docs/security.md."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UsageError(f"{path} is a symbolic link: gemma4enc never opens its own files in OUT "
                             "through a link (docs/security.md); replace it with a regular file") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UsageError(f"{path} is not a regular file (a FIFO, a device, a folder?): gemma4enc opens "
                         "only regular files of its own in OUT (docs/security.md)")
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return fd


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@functools.cache
def umask() -> int:
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
    """write(tmp_path), then fsync and rename into place: readers never see half a file. The temp
    name is unpredictable (names.temp_name), so no link can be planted for it, and the rename
    replaces a link at `path` rather than writing through it."""
    tmp = path.with_name(temp_name(path.name))
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~umask())  # safetensors writes 0600; others may need to read the shards
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
    with open(Path(out) / MANIFEST, "ab", opener=own_opener) as f:
        f.write(b"".join(map(line_of, rows)))
        f.flush()
        os.fsync(f.fileno())


# A manifest line longer than this is no row gemma4enc wrote (a video's row of 8,695 frames is
# ~0.3 MB): it is counted unreadable and read through in chunks, never held (an 800 MB line cost
# 2.5 GB when it was parsed, issue 44)


def bounded_lines(f):
    """(line, its length, whole) of each line from f's position on: `line` is None for a line past
    LINE_MAX (skipped, not held); whole is False for a last line without its newline (a torn tail)."""
    while True:
        line = f.readline(LINE_MAX + 1)
        if not line:
            return
        if line.endswith(b"\n") or len(line) <= LINE_MAX:
            yield line, len(line), line.endswith(b"\n")
            continue
        size, chunk = len(line), line
        while chunk and not chunk.endswith(b"\n"):
            chunk = f.readline(1 << 20)
            size += len(chunk)
        yield None, size, chunk.endswith(b"\n")


def line_of(row) -> bytes:
    """A Row (or a row's dict) as one manifest line."""
    if hasattr(row, "to_json"):
        row = row.to_json()
    # a file name that is not UTF-8 holds lone surrogates: written as \udcXX escapes, JSON reads it back
    return (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8", errors="backslashreplace")


TEMP_MARK = ".gemma4enc-temp"  # inside every temp folder gemma4enc makes: what the sweep looks for


def temp_folder(kind: str) -> str:
    """A new private temp folder `<kind>-<pid>-<random>` with gemma4enc's mark inside: the sweep of
    folders left by killed runs (run/tempsweep.py) takes only marked ones, never a user's folder
    that happens to look alike (`gemma4enc-task-2024-notes`)."""
    import tempfile

    folder = tempfile.mkdtemp(prefix=f"{kind}-{os.getpid()}-")
    fd = os.open(os.path.join(folder, TEMP_MARK), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.close(fd)
    return folder
