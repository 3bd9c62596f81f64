"""OUT at a URL (`-o s3://bucket/prefix`), through a local working copy: OUT's settings and its whole
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
from typing import Iterator

from ..errors import UsageError
from .files import SMALL_MAX, append_rows, temp_folder
from .ledger import Ledger
from .lock import holding
from .names import (
    COMPACTED, LOCK, MANIFEST, PART_RE, PARTS, SEARCH_INDEX, SETTINGS, SHARD_RE, manifest_chain, not_an_output,
    unnamed_shards,
)
from .out import Out, ShardPlace
from .repair import mark_lost
from .store import Store, StoreLock

# a run on a store merges its manifest parts into the base once there are this many: a re-run
# reads every part (a request each), the base in one
AUTO_PARTS = 1000


class StoreOut(Out):
    """OUT at `url`, stood for by a temp folder; `pull()` fills it, `sync()` sends new rows back."""

    remote = True

    def __init__(self, url: str):
        self.store = Store(url)
        self.url = self.store.url
        # the pid in the name: a later run removes it if this process is killed (run/tempsweep.py)
        self.folder = Path(temp_folder("gemma4enc-out"))
        self.lock: StoreLock | None = None
        # in this run's part names: whose they were, for a reader of the store
        self.run = uuid.uuid4().hex[:8]
        self.parts: list[str] = []  # the parts the manifest is read from
        self.shards: dict[str, int] = {}  # the store's shards: name → size
        self.stored = False  # whether the store holds a manifest at all (an output)
        self.next_part = 0
        self.pushed = 0  # bytes of the local manifest the store holds
        self._guard = threading.Lock()  # the shard writer's thread and the run's own both push

    def open(self, write: bool = False, overwrite: bool = False) -> StoreOut:
        """Read the store; to write, under its lock, taken first (cleared first with `overwrite`)."""
        if write:
            self.lock = StoreLock(self.store).acquire()
            if overwrite:
                self.clear()
        return self.pull()

    # names

    def named(self, name: str) -> str:
        return f"{self.url}/{name}"

    def rows_hint(self) -> str:
        return f"see gemma4enc inspect {self.url}"  # its manifest is in parts

    def for_actors(self) -> ShardPlace:
        return StorePlace(self.url)  # an actor uploads its shards itself

    # reading the store

    def pull(self) -> StoreOut:
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
        self.stored = bool(blobs)
        manifest = self.folder / MANIFEST
        manifest.unlink(missing_ok=True)
        if self.stored:
            with open(manifest, "wb") as f:
                for blob in blobs:
                    f.write(blob if not blob or blob.endswith(b"\n") else blob + b"\n")
        if SETTINGS in listed and int(listed[SETTINGS].get("size") or 0) > SMALL_MAX:  # as read_own's
            raise UsageError(f"{self.url}/{SETTINGS}: larger than {SMALL_MAX >> 20} MiB, not a file gemma4enc writes")
        settings = self.store.read(SETTINGS) if SETTINGS in listed else None
        (self.folder / SETTINGS).unlink(missing_ok=True)
        if settings is not None:
            (self.folder / SETTINGS).write_bytes(settings)
        self.parts = chain
        self.next_part = 1 + max((_part_number(n) for n in parts), default=-1)
        self.shards = {n: int(i.get("size") or 0) for n, i in listed.items() if SHARD_RE.match(n)}
        self.pushed = manifest.stat().st_size if self.stored else 0

    def found(self) -> bool:
        return self.stored

    def relist(self) -> None:
        """The store's shards listed again (Ray actors upload theirs themselves)."""
        listed = self.store.names()
        self.shards = {n: int(i.get("size") or 0) for n, i in listed.items() if SHARD_RE.match(n)}

    def shard_path(self, name: str) -> Path:
        """A shard's local copy, fetched on first use."""
        path = self.folder / name
        if not path.exists():
            self.store.download(name, path)
        return path

    def drop(self, name: str) -> None:
        (self.folder / name).unlink(missing_ok=True)

    def shard_names(self) -> set[str]:
        return set(self.shards)

    def shard_sizes(self) -> list[int]:
        self.relist()
        return list(self.shards.values())

    def holder(self) -> str | None:
        body = self.store.read(LOCK)
        return None if body is None else holding(body)

    def fetch_files(self, names) -> None:
        listed = self.store.names()
        for name in names:
            if name in listed:
                self.store.download(name, self.folder / name)

    def send_files(self, names, last: str) -> None:
        for name in names:
            if (self.folder / name).exists():
                self.store.upload(self.folder / name, name)
            else:
                self.store.delete([name])
        self.store.upload(self.folder / last, last)

    # writing to the store, with the lock held (taken by open(write=True))

    @contextlib.contextmanager
    def locked(self, need: bool = False):
        """The lock taken when OUT was opened to write, handed on (see out.py); `need`: OUT must be
        an output already."""
        if need and not self.found():
            raise UsageError(not_an_output(self.url))
        yield self.lock

    def publish(self, path: Path) -> None:
        """A shard just written into the temp folder, uploaded whole, then dropped here (disk stays
        bounded by the shards in flight). Its rows are pushed only after this returns."""
        if self.lock is not None:
            self.lock.check()
        self.store.upload(path, path.name)
        self.shards[path.name] = path.stat().st_size
        path.unlink(missing_ok=True)

    def append(self, rows: list, tag: str = "", later: bool = False) -> None:
        """Rows into the manifest: here, then (unless `later`) to the store as a part (`tag` ends its name)."""
        append_rows(self.folder, rows)
        if not later:
            self.sync(tag)

    def sync(self, tag: str = "") -> None:
        """What was appended to the local manifest since the last push (whole lines), as a new part."""
        with self._guard:
            manifest = self.folder / MANIFEST
            if not manifest.exists():
                return
            with open(manifest, "rb") as f:
                f.seek(self.pushed)
                tail = f.read()
            tail = tail[: tail.rfind(b"\n") + 1]
            if not tail:
                return
            if self.lock is not None:
                self.lock.check()
            name = f"{PARTS}/{self.next_part:012d}-{self.run}{'-' + tag if tag else ''}.jsonl"
            self.store.write(name, tail)
            self.next_part += 1
            self.pushed += len(tail)
            self.parts.append(name)
            self.stored = True

    def record_settings(self, options, extra: dict | None = None) -> None:
        """settings.json written here, then to the store, once; with an empty base manifest where
        there is none, so the store reads as an output of no files."""
        super().record_settings(options, extra)
        if self.store.read(SETTINGS) is None:
            self.store.write(SETTINGS, (self.folder / SETTINGS).read_bytes())
        if not self.stored:
            self.store.write(MANIFEST, b"")
            self.stored = True

    def repair(self, ledger: Ledger | None = None) -> list[str]:
        """What a killed run leaves in the store: rows whose shard never arrived are marked lost
        (their files are encoded again), shards no latest row names are removed."""
        ledger = (ledger or Ledger(self.folder)).refresh()
        notes = mark_lost(self, {n for n in ledger.shards() if n not in self.shards}, ledger)
        self.sync()
        named = ledger.shards()
        orphans = sorted(n for n in self.shards if n not in named)
        self.store.delete(orphans)
        for name in orphans:
            del self.shards[name]
        if orphans:
            notes.append(f"removed {len(orphans)} shard(s) of an interrupted run from {self.url}")
        return notes

    def remove_shards(self, prefixes: tuple[str, ...]) -> None:
        self.store.delete(n for n in self.store.names() if n.startswith(prefixes) and SHARD_RE.match(n))

    def clear(self) -> int:
        """--overwrite: everything gemma4enc wrote under the prefix, the manifest first (without it
        the shards are orphans, never half-used). Returns how many objects went."""
        listed = self.store.names()
        parts = [n for n in self.store.names(PARTS) if PART_RE.match(n)]
        ours = [n for n in listed if SHARD_RE.match(n) or n in (SETTINGS, *SEARCH_INDEX)]
        self.store.delete([MANIFEST] if MANIFEST in listed else [])
        self.store.delete(parts + ours)
        return len(parts) + len(ours)

    def maybe_compact(self, ledger: Ledger) -> str | None:
        """The manifest parts merged into the base once there are AUTO_PARTS (call under the lock, at
        the end of a run; `compact` does it whatever their number)."""
        parts = len(self.parts)
        if parts < AUTO_PARTS:
            return None
        report = self.compact(ledger)
        return f"merged {parts} manifest parts into {self.url}/{MANIFEST} ({report['rows_after']} rows)"

    def compact(self, ledger: Ledger | None = None, prune: bool = False) -> dict:
        """The working copy compacted as a folder's is, then made the store's base."""
        report = super().compact(ledger, prune)
        self._commit_compaction()
        return report

    def _commit_compaction(self) -> None:
        """The local manifest (compacted) as the store's base, in steps that each leave the same
        manifest readable: shards a pruning rewrote uploaded, the whole manifest as a `~compacted`
        part, the older parts removed, the base replaced, that part removed, dead shards removed."""
        for p in sorted(self.folder.iterdir()):
            if SHARD_RE.match(p.name) and p.name not in self.shards:
                self.publish(p)
        whole = (self.folder / MANIFEST).read_bytes()
        reset = f"{PARTS}/{max(self.next_part - 1, 0):012d}{COMPACTED}"
        self.store.write(reset, whole)
        self.store.delete([n for n in self.parts if n != reset])
        self.store.write(MANIFEST, whole)
        self.store.delete([reset])
        self.parts, self.pushed, self.stored = [], len(whole), True
        named = Ledger(self.folder).refresh().shards()
        dead = unnamed_shards(self.shards, named)
        self.store.delete(dead)
        for name in dead:
            del self.shards[name]

    def close(self) -> None:
        try:
            if self.lock is not None:
                self.lock.release()
                self.lock = None
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)


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

    @contextlib.contextmanager
    def staging(self) -> Iterator[Path]:
        # the task's own folder, gone with it: an actor lives as long as Ray keeps it and is killed,
        # not closed, so a folder of the actor's would outlive every run; the pid in its name lets a
        # later run sweep the folder of an actor killed mid-task (run/tempsweep.py)
        local = temp_folder("gemma4enc-task")
        try:
            yield Path(local)
        finally:
            shutil.rmtree(local, ignore_errors=True)

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
