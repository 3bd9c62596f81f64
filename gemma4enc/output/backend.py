"""Where OUT's files live, as the dozen operations on which a folder and a store really differ
(`OutBackend`); everything OUT means is written once above it, in out.py's `Out`.

Every backend keeps OUT's settings and manifest as files in `local`, where the ledger, the readers
and compaction read them as a folder's: a folder is its own `local`; a store (storebackend.py) and
memory (memorybackend.py) stand behind a temp working copy, fetched when opened and sent back by
`push`, `put` and `replace_manifest`. What differs:

  operation             folder (this module)                store
  lock()                flock on OUT/gemma4enc.lock          StoreLock, taken when opened to write
  holder()              who holds the flock                 who the lock object names
  listing(sub)          the folder's files, by name → size  the objects under the prefix
  write / delete        atomic write, unlink                whole objects (and the copy's file)
  fetch(name) / drop    the file in place / nothing         downloaded on first use / removed
  put(path)             nothing: written in place           uploaded, the local file dropped
  push(tag)             nothing: appends are fsynced        rows appended since, as a new part
  settle(ledger)        a torn tail cut, temp files gone    nothing (parts are whole)
  replace_manifest()    nothing: rewritten in place         the ~compacted steps (docs/remote.md)
  handle()              FolderPlace (picklable)             StorePlace (picklable)

`in_place` says whether `local` is OUT itself (its inode and size tell a change) or a copy (its
bytes must); `parts` how many manifest pieces past the base a store has (its compaction rule).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator, Protocol

from ..errors import UsageError, reason
from .files import atomic_write, own_opener, temp_folder
from .lock import Lock, running
from .names import MANIFEST, TEMP_RE

if TYPE_CHECKING:
    from .ledger import Ledger


class ShardPlace(Protocol):
    """Where a Ray task's shards go, as the actor is told it (picklable: `backend.handle()`): a
    folder to write them in for the task, and how a written shard is made OUT's. The actor never
    takes OUT's lock nor reads its manifest: its rows go back to the driver."""

    def staging(self) -> contextlib.AbstractContextManager[Path]: ...

    def put(self, path: Path) -> None: ...


class OutBackend(ABC):
    """What a kind of OUT must do itself (see the module's table); `Out` does the rest."""

    url: str  # OUT as the user named it, for messages
    local: Path  # where OUT's settings and manifest are read and written here
    in_place = False  # `local` is OUT itself, not a copy

    @abstractmethod
    def lock(self) -> contextlib.AbstractContextManager:
        """A context holding OUT's lock, yielding it (`previous`: a dead holder taken over from)."""

    @abstractmethod
    def holder(self) -> str | None:
        """The run holding OUT's lock, described, or None."""

    @abstractmethod
    def listing(self, sub: str = "") -> dict[str, int]:
        """OUT's files directly under it (or under its folder `sub`): name (from OUT) → size, now."""

    @abstractmethod
    def write(self, name: str, data: bytes) -> None:
        """A file of OUT written whole: it is there complete or not at all."""

    @abstractmethod
    def delete(self, names: Iterable[str]) -> None:
        """OUT's files by name gone (a missing one is no error; a link is removed, never followed)."""

    @abstractmethod
    def fetch(self, name: str) -> Path:
        """A local view of OUT's file `name` (FileNotFoundError where a store has none)."""

    @abstractmethod
    def drop(self, name: str) -> None:
        """A fetched copy let go (a folder's own files are never touched)."""

    @abstractmethod
    def put(self, path: Path, keep: bool = False) -> None:
        """A file just written in `local` made OUT's (`keep`: its local copy stays, search's cache)."""

    @abstractmethod
    def push(self, tag: str = "") -> None:
        """The manifest's lines appended in `local` since the last push made OUT's (whole lines)."""

    @abstractmethod
    def settle(self, ledger: Ledger) -> list[str]:
        """What a kill mid-write leaves in the manifest and temp files made right; notes for the log."""

    @abstractmethod
    def replace_manifest(self) -> None:
        """The manifest just rewritten in `local` (compacted) made OUT's, with no moment where OUT
        reads as anything else."""

    @abstractmethod
    def handle(self) -> ShardPlace:
        """Where another process (a Ray actor) puts its task's shards."""

    # the same for every backend unless it says otherwise

    @property
    def parts(self) -> int:
        """Manifest pieces past the base (a store's parts: its compaction rule)."""
        return 0

    def readable(self, names: set[str]) -> set[str]:
        """Those of `names` (shards) OUT holds whole (a store: listed; it writes objects whole)."""
        return names & set(self.listing())

    def named(self, name: str) -> str:
        """A file of OUT as the user would find it, for messages."""
        return f"{self.url}/{name}"

    def rows_hint(self) -> str:
        """Where a person reads the rows, for a message."""
        return f"see gemma4enc inspect {self.url}"

    def absolute(self) -> str:
        """OUT as a consumer elsewhere reaches it (an export's note)."""
        return self.url

    def close(self) -> None:
        pass


class FolderBackend(OutBackend):
    """OUT as a folder on this machine's filesystem: flock, fsync, rename and append."""

    in_place = True

    def __init__(self, folder: Path):
        self.local = Path(folder)
        self.url = str(self.local)

    @contextlib.contextmanager
    def lock(self) -> Iterator[Lock]:
        """OUT made and locked; a folder we cannot write to (read-only, immutable, full) is a usage error."""
        lock = Lock(self.local)
        try:
            self.local.mkdir(parents=True, exist_ok=True)
            lock.acquire()
        except OSError as e:
            raise UsageError(f"cannot write to {self.local}: {reason(e)}") from None
        try:
            yield lock
        finally:
            lock.release()

    def holder(self) -> str | None:
        return running(self.local)

    def listing(self, sub: str = "") -> dict[str, int]:
        found: dict[str, int] = {}
        if sub:  # a folder keeps no sub-folder of ours (parts are a store's): one there, or a link
            return found  # named like it, is never walked, so nothing outside OUT is ever listed
        try:
            entries = list(os.scandir(self.local))
        except (FileNotFoundError, NotADirectoryError):
            return found
        for e in entries:
            try:
                st = e.stat(follow_symlinks=False)  # a link is OUT's name, never where it points
            except FileNotFoundError:  # another run's compaction, once this one let go of the lock
                continue
            if not e.is_dir(follow_symlinks=False):
                found[e.name] = st.st_size
        return found

    def write(self, name: str, data: bytes) -> None:
        atomic_write(self.local / name, lambda tmp: tmp.write_bytes(data))

    def delete(self, names: Iterable[str]) -> None:
        for name in names:
            if "/" not in name and name not in ("", ".", ".."):  # OUT's own files only, none below
                (self.local / name).unlink(missing_ok=True)

    def fetch(self, name: str) -> Path:
        return self.local / name

    def drop(self, name: str) -> None:
        pass  # OUT's own file

    def put(self, path: Path, keep: bool = False) -> None:
        pass  # written in place (temp name, fsync, rename)

    def push(self, tag: str = "") -> None:
        pass  # append_rows fsynced the lines where OUT reads them

    def settle(self, ledger: Ledger) -> list[str]:
        """A torn last line cut (the next append must start a line of its own), temp files removed."""
        notes = []
        manifest = ledger.path
        if manifest.exists() and manifest.stat().st_size > ledger.end:
            with open(manifest, "rb+", opener=own_opener) as f:
                f.truncate(ledger.end)
                os.fsync(f.fileno())
            notes.append("dropped a torn last line of the manifest (its file will be encoded again)")
        temps = [n for n in self.listing() if TEMP_RE.match(n)]
        self.delete(temps)
        if temps:
            notes.append(f"removed {len(temps)} temp file(s) of an interrupted run")
        return notes

    def replace_manifest(self) -> None:
        pass  # compaction rewrote the folder's manifest itself (temp, fsync, rename)

    def handle(self) -> FolderPlace:
        return FolderPlace(str(self.local))

    def readable(self, names: set[str]) -> set[str]:
        """Shards whose header can be read (cheap: headers only); a kill can truncate a file here."""
        from safetensors import safe_open

        whole = set()
        for name in names:
            try:
                with safe_open(str(self.local / name), framework="numpy"):  # not "pt": a no-op run never imports torch
                    whole.add(name)
            except Exception:  # noqa: BLE001 - missing, truncated, garbage: all mean its tokens are lost
                pass
        return whole

    def named(self, name: str) -> str:
        return str(self.local / name)

    def rows_hint(self) -> str:
        return f"see {self.url}/{MANIFEST}"

    def absolute(self) -> str:
        return str(self.local.resolve())


@contextlib.contextmanager
def task_folder() -> Iterator[Path]:
    """A task's own temp folder for its shards, gone with the task: an actor lives as long as Ray
    keeps it and is killed, not closed, so a folder of the actor's would outlive every run; the pid
    in its name lets a later run sweep the folder of an actor killed mid-task (run/tempsweep.py)."""
    local = temp_folder("gemma4enc-task")
    try:
        yield Path(local)
    finally:
        shutil.rmtree(local, ignore_errors=True)


@dataclass(frozen=True)
class FolderPlace:
    """OUT a folder: a task's shards are written in it, where OUT reads them."""

    folder: str

    @contextlib.contextmanager
    def staging(self) -> Iterator[Path]:
        yield Path(self.folder)

    def put(self, path: Path) -> None:
        pass  # written in place (temp name, fsync, rename)
