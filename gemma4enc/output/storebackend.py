"""OUT at a URL (`-o s3://bucket/prefix`) as an OutBackend (backend.py), through a local working copy: OUT's settings and its whole
manifest (the base, then every part since, as one file) in a temp folder, where a run, the readers
and every command work as on a folder. What a run adds goes back to the store: each shard uploaded
whole, then the rows naming it as a new manifest part. Shards are fetched only when read.

OUT at a URL holds (names.py)
  settings.json
  manifest.jsonl                          the base: what `compact` merged (absent before)
  manifest.parts/NNNNNNNNNNNN-RUN.jsonl   rows written since: one part per shard written (per task
                                          on Ray), numbered on from the last, so in write order
  manifest.parts/NNNNNNNNNNNN~compacted.jsonl
                                          only while `compact` replaces the base: the whole manifest
  shard-*.safetensors                     as locally
  gemma4enc.lock                          while a run holds it (store.StoreLock)
The manifest is the base, then the parts in name order; where a `~compacted` part is there, the
last one is the whole manifest and what comes before it is not read. Every step of a compaction
leaves a store that reads as the same manifest, so a kill at any point loses and doubles nothing.
One run writes at a time (the lock), so numbering on from the last part needs no clock.

Why a working copy and not a filesystem layer over the store: a folder gives flock, fsync, rename
and append, which a store lacks; a store gives conditional create and whole-object writes. The
manifest is appended to here and sent as parts; everything else reads the copy as a folder.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator

from ..errors import UsageError
from .backend import OutBackend, task_folder
from .files import SMALL_MAX, temp_folder
from .lock import holding
from .names import COMPACTED, LOCK, MANIFEST, PART_RE, PARTS, SETTINGS, manifest_chain
from .store import Store, StoreLock

if TYPE_CHECKING:
    from .ledger import Ledger


class StoreBackend(OutBackend):
    """OUT at `url`, stood for by a temp folder; `open()` fills it, `push()` sends new rows back."""

    def __init__(self, url: str):
        self.store = Store(url)
        self.url = self.store.url
        # the pid in the name: a later run removes it if this process is killed (run/tempsweep.py)
        self.local = Path(temp_folder("gemma4enc-out"))
        self.held: StoreLock | None = None
        # in this run's part names: whose they were, for a reader of the store
        self.run = uuid.uuid4().hex[:8]
        self.chain: list[str] = []  # the parts the manifest is read from
        self.next_part = 0
        self.pushed = 0  # bytes of the local manifest the store holds
        self._guard = threading.Lock()  # the shard writer's thread and the run's own both push

    @property
    def parts(self) -> int:
        return len(self.chain)

    def open(self, write: bool = False) -> StoreBackend:
        """Read the store; to write, under its lock, taken first."""
        if write:
            self.held = StoreLock(self.store).acquire()
        return self.pull()

    def pull(self) -> StoreBackend:
        """OUT's settings and manifest into the temp folder; its shards listed, not fetched."""
        for attempt in range(3):
            try:
                self._pull()
                return self
            except FileNotFoundError:  # a compaction removed a part between listing and reading
                if attempt == 2:
                    raise
        raise AssertionError("unreachable: the third try returns or raises")

    def _pull(self) -> None:
        listed = self.store.names()
        parts = sorted(n for n in self.store.names(PARTS) if PART_RE.match(n))
        chain, with_base = manifest_chain(parts)
        base = self.store.read(MANIFEST) if MANIFEST in listed and with_base else None
        blobs = ([base] if base is not None else []) + self.store.read_many(chain)
        manifest = self.local / MANIFEST
        manifest.unlink(missing_ok=True)
        if blobs:
            with open(manifest, "wb") as f:
                for blob in blobs:
                    f.write(blob if not blob or blob.endswith(b"\n") else blob + b"\n")
        if SETTINGS in listed and int(listed[SETTINGS].get("size") or 0) > SMALL_MAX:  # as read_own's
            raise UsageError(f"{self.url}/{SETTINGS}: larger than {SMALL_MAX >> 20} MiB, not a file gemma4enc writes")
        settings = self.store.read(SETTINGS) if SETTINGS in listed else None
        (self.local / SETTINGS).unlink(missing_ok=True)
        if settings is not None:
            (self.local / SETTINGS).write_bytes(settings)
        self.chain = chain
        self.next_part = 1 + max((_part_number(n) for n in parts), default=-1)
        self.pushed = manifest.stat().st_size if blobs else 0

    # the backend's operations

    @contextlib.contextmanager
    def lock(self) -> Iterator[StoreLock | None]:
        """The lock taken when OUT was opened to write, handed on (see out.py)."""
        yield self.held

    def holder(self) -> str | None:
        body = self.store.read(LOCK)
        return None if body is None else holding(body)

    def listing(self, sub: str = "") -> dict[str, int]:
        return {n: int(i.get("size") or 0) for n, i in self.store.names(sub).items()}

    def write(self, name: str, data: bytes) -> None:
        """Written here, then to the store."""
        (self.local / name).write_bytes(data)
        self.store.write(name, data)

    def delete(self, names: Iterable[str]) -> None:
        """From the store, and the working copy's file of each (the manifest's: nothing of it pushed)."""
        names = list(names)
        self.store.delete(names)
        for name in names:
            if "/" not in name:
                (self.local / name).unlink(missing_ok=True)
        self.chain = [n for n in self.chain if n not in names]
        if MANIFEST in names:
            self.pushed = 0

    def fetch(self, name: str) -> Path:
        """A file's local copy, fetched on first use."""
        path = self.local / name
        if not path.exists():
            self.store.download(name, path)
        return path

    def drop(self, name: str) -> None:
        (self.local / name).unlink(missing_ok=True)

    def put(self, path: Path, keep: bool = False) -> None:
        """A file just written into the temp folder, uploaded whole; a shard is then dropped here
        (disk stays bounded by the shards in flight). Its rows are pushed only after this returns."""
        if self.held is not None:
            self.held.check()
        self.store.upload(path, path.name)
        if not keep:
            path.unlink(missing_ok=True)

    def push(self, tag: str = "") -> None:
        """What was appended to the local manifest since the last push (whole lines), as a new part."""
        with self._guard:
            manifest = self.local / MANIFEST
            if not manifest.exists():
                return
            with open(manifest, "rb") as f:
                f.seek(self.pushed)
                tail = f.read()
            tail = tail[: tail.rfind(b"\n") + 1]
            if not tail:
                return
            if self.held is not None:
                self.held.check()
            name = f"{PARTS}/{self.next_part:012d}-{self.run}{'-' + tag if tag else ''}.jsonl"
            self.store.write(name, tail)
            self.next_part += 1
            self.pushed += len(tail)
            self.chain.append(name)

    def settle(self, ledger: Ledger) -> list[str]:
        return []  # parts are written whole; the working copy was assembled line by line

    def replace_manifest(self) -> None:
        """The local manifest (compacted) as the store's base, in steps that each leave the same
        manifest readable: the whole manifest as a `~compacted` part, the older parts removed, the
        base replaced, that part removed."""
        whole = (self.local / MANIFEST).read_bytes()
        reset = f"{PARTS}/{max(self.next_part - 1, 0):012d}{COMPACTED}"
        self.store.write(reset, whole)
        self.store.delete([n for n in self.chain if n != reset])
        self.store.write(MANIFEST, whole)
        self.store.delete([reset])
        self.chain, self.pushed = [], len(whole)

    def handle(self) -> StorePlace:
        return StorePlace(self.url)  # an actor uploads its shards itself

    def close(self) -> None:
        try:
            if self.held is not None:
                self.held.release()
                self.held = None
        finally:
            shutil.rmtree(self.local, ignore_errors=True)


def _part_number(name: str) -> int:
    """A manifest part's number (its name matched PART_RE when it was listed)."""
    found = PART_RE.match(name)
    assert found is not None
    return int(found.group(1))


@dataclass
class StorePlace:
    """OUT a store: a task's shards are written in the task's own temp folder, then uploaded (and
    removed here, uploaded or not: a failed task is tried again whole)."""

    url: str
    _store: Store | None = field(default=None, repr=False, compare=False)

    def staging(self) -> contextlib.AbstractContextManager[Path]:
        return task_folder()  # uploaded or not, a task's shards go with it: a failed task is tried again whole

    def put(self, path: Path) -> None:
        if self._store is None:
            self._store = Store(self.url)
            self._store.reached = True  # the driver reached it: a failure here is the store's, retried
        try:
            self._store.upload(path, path.name)
        finally:
            path.unlink(missing_ok=True)

    def __getstate__(self) -> dict:
        return {"url": self.url, "_store": None}  # a Store holds its filesystem: made anew where used
