"""One run at a time in an output folder: an flock on OUT/gemma4enc.lock that says who holds it."""

from __future__ import annotations

import errno
import json
import os
import socket
import time
from pathlib import Path

from ..errors import UsageError, shown
from .files import own_opener
from .names import LOCK


class Lock:
    """An flock on OUT/gemma4enc.lock, which says who holds it (pid, host, start time).

    The kernel drops the flock when its process dies, however it dies, so a stale lock file
    of a killed run is simply taken over. Where the filesystem has no flock, the pid decides.
    """

    def __init__(self, out: Path):
        self.path = Path(out) / LOCK
        self.fd: int | None = None
        self.previous: dict | None = None  # a stale holder we took over from

    def acquire(self) -> Lock:
        import fcntl

        while True:
            try:
                fd = own_opener(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # never through a link
            except OSError as e:  # read-only, another user's, gone: a folder this run cannot use
                raise UsageError(f"cannot write to {self.path.parent}: {e.strerror or e}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_json(fd)
                os.close(fd)
                raise UsageError(
                    f"{self.path.parent} is in use by another gemma4enc run ({describe(holder)}); "
                    "wait for it to finish or stop it"
                ) from None
            except OSError as e:
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    os.close(fd)
                    raise
                holder = _read_json(fd)  # no flock here: trust a live pid on this host
                if holder and holder.get("host") == socket.gethostname() and alive(holder.get("pid")):
                    os.close(fd)
                    raise UsageError(
                        f"{self.path.parent} is in use by another gemma4enc run ({describe(holder)})"
                    )
            if os.path.exists(self.path) and os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                break
            os.close(fd)  # the holder unlinked it as we opened it: lock the new file instead
        self.previous = _read_json(fd) or None
        me = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.unlink(self.path)  # before unlocking, so a waiter re-checks the inode and retries
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> Lock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read_json(fd: int) -> dict:
    """The holder a lock file names: its first 4 KiB as a JSON object, or {} (a hostile or torn one)."""
    return _holder(os.pread(fd, 4096, 0))


def _holder(body: bytes) -> dict:
    try:
        holder = json.loads(body[:4096] or b"{}")
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


def describe(holder: dict) -> str:
    """pid, host and start of a holder, as printable text (a lock file is input: no escape codes)."""
    said = [shown(str(holder.get(k, "?"))[:64], lines=False) for k in ("pid", "host", "started")]
    return f"pid {said[0]} on {said[1]}, since {said[2]}"


def running(out: Path) -> str | None:
    """The run holding OUT's lock, described, or None. The flock decides where the filesystem has
    one: a lock file nobody holds is a killed run's, whatever pid it names (a pid the system has
    since given to another process made it look live); elsewhere the pid, as holding() says."""
    import fcntl

    try:
        fd = own_opener(Path(out) / LOCK, os.O_RDONLY)  # never through a link, never a FIFO
    except (OSError, UsageError):
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return describe(_read_json(fd))  # held: a live run
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                return None
            return holding(os.pread(fd, 4096, 0))
        return None  # nobody holds it
    finally:
        os.close(fd)


def holding(body: bytes) -> str | None:
    """A lock file's body → the run it names, described; None where that run is gone from this host."""
    holder = _holder(body)
    if not holder or holder.get("host") == socket.gethostname() and not alive(holder.get("pid")):
        return None
    return describe(holder)


def alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (OSError, TypeError, ValueError, OverflowError) as e:
        return isinstance(e, PermissionError)
    return True
