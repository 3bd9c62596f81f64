"""OUT at a URL, stood for by a local temp folder: OUT's settings and its whole manifest (the base,
then every part since, as one file), where a run, the reader and every command work as on a local
OUT. What a run adds goes back to the store: each shard uploaded whole, then the rows naming it as
a new manifest part. Shards are fetched only when something reads them (`shard_file`).

OUT at a URL holds
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
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import threading
import uuid
from pathlib import Path

from .files import MANIFEST, SHARD_RE, append_rows
from .ledger import Ledger
from .lock import LOCK
from .repair import mark_lost
from .settings import SEARCH_INDEX, SETTINGS
from .store import Store, StoreLock

PARTS = "manifest.parts"
COMPACTED = "~compacted.jsonl"
_PART = re.compile(r"^manifest\.parts/(\d{12})[-~][^/]*\.jsonl$")

MIRRORS: dict[Path, "Mirror"] = {}  # temp folder → its mirror, for shard_file


class Mirror:
    """A temp folder standing for OUT at `url`; `pull()` fills it, `push()` sends new rows back."""

    def __init__(self, url: str):
        self.store = Store(url)
        self.url = self.store.url
        # the pid in the name: a later run removes it if this process is killed (run/tempsweep.py)
        self.path = Path(tempfile.mkdtemp(prefix=f"gemma4enc-out-{os.getpid()}-"))
        self.lock: StoreLock | None = None
        # in this run's part names: whose they were, for a reader of the store
        self.run = uuid.uuid4().hex[:8]
        self.parts: list[str] = []  # the parts the manifest is read from
        self.shards: dict[str, int] = {}  # the store's shards: name → size
        self.found = False  # whether the store holds a manifest at all (an output)
        self.next_part = 0
        self.pushed = 0  # bytes of the local manifest the store holds
        self._guard = threading.Lock()  # the shard writer's thread and the run's own both push
        MIRRORS[self.path] = self

    # reading the store

    def pull(self, holder: bool = False) -> Mirror:
        """OUT's settings and manifest into the temp folder; its shards listed, not fetched. With
        `holder`, the lock too, so `inspect` says which run holds it."""
        for attempt in range(3):
            try:
                self._pull()
                lock = self.store.read(LOCK) if holder else None
                if lock is not None:
                    (self.path / LOCK).write_bytes(lock)
                return self
            except FileNotFoundError:  # a compaction removed a part between listing and reading
                if attempt == 2:
                    raise

    def _pull(self) -> None:
        listed = self.store.names()
        parts = sorted(n for n in self.store.names(PARTS) if _PART.match(n))
        resets = [n for n in parts if n.endswith(COMPACTED)]
        chain = parts[parts.index(resets[-1]) :] if resets else parts
        base = self.store.read(MANIFEST) if MANIFEST in listed and not resets else None
        blobs = ([base] if base is not None else []) + self.store.read_many(chain)
        self.found = bool(blobs)
        manifest = self.path / MANIFEST
        manifest.unlink(missing_ok=True)
        if self.found:
            with open(manifest, "wb") as f:
                for blob in blobs:
                    f.write(blob if not blob or blob.endswith(b"\n") else blob + b"\n")
        settings = self.store.read(SETTINGS) if SETTINGS in listed else None
        (self.path / SETTINGS).unlink(missing_ok=True)
        if settings is not None:
            (self.path / SETTINGS).write_bytes(settings)
        self.parts = chain
        self.next_part = 1 + max((int(_PART.match(n).group(1)) for n in parts), default=-1)
        self.shards = {n: int(i.get("size") or 0) for n, i in listed.items() if SHARD_RE.match(n)}
        self.pushed = manifest.stat().st_size if self.found else 0

    def relist(self) -> None:
        """The store's shards listed again (Ray actors upload theirs themselves)."""
        listed = self.store.names()
        self.shards = {n: int(i.get("size") or 0) for n, i in listed.items() if SHARD_RE.match(n)}

    def shard(self, name: str) -> Path:
        """A shard's local copy, fetched on first use."""
        path = self.path / name
        if not path.exists():
            self.store.download(name, path)
        return path

    # writing to the store, with the lock held

    @contextlib.contextmanager
    def locked(self, overwrite: bool = False):
        """OUT's lock taken, then the store read (cleared first with `overwrite`); released on exit."""
        self.lock = StoreLock(self.store).acquire()
        try:
            if overwrite:
                self.clear()
            self.pull()
            yield self
        finally:
            self.lock.release()

    def next_shard(self) -> int:
        """Local shards of a run are numbered on from the store's highest."""
        numbers = [
            int(m.group(1)) for n in self.shards if (m := SHARD_RE.match(n)) and m.group(1).isdigit()
        ]
        return 1 + max(numbers, default=-1)

    def publish(self, local: Path) -> None:
        """A shard just written into the temp folder, uploaded whole, then dropped here (disk stays
        bounded by the shards in flight). Its rows are pushed only after this returns."""
        if self.lock is not None:
            self.lock.check()
        self.store.upload(local, local.name)
        self.shards[local.name] = local.stat().st_size
        local.unlink(missing_ok=True)

    def append(self, rows: list, tag: str = "") -> None:
        """Rows into the manifest: here, then to the store as a part (`tag` ends its name)."""
        append_rows(self.path, rows)
        self.push(tag)

    def push(self, tag: str = "") -> None:
        """What was appended to the local manifest since the last push (whole lines), as a new part."""
        with self._guard:
            manifest = self.path / MANIFEST
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
            self.found = True

    def push_settings(self) -> None:
        """settings.json (written here by the run once its model loaded) to the store, once; with an
        empty base manifest where there is none, so the store reads as an output of no files."""
        if self.store.read(SETTINGS) is None:
            self.store.write(SETTINGS, (self.path / SETTINGS).read_bytes())
        if not self.found:
            self.store.write(MANIFEST, b"")
            self.found = True

    def repair(self, out: Path, ledger: Ledger) -> list[str]:
        """What a killed run leaves in the store: rows whose shard never arrived are marked lost
        (their files are encoded again), shards no latest row names are removed."""
        ledger.refresh()
        notes = mark_lost(self.path, {n for n in ledger.shards() if n not in self.shards}, ledger)
        self.push()
        named = ledger.shards()
        orphans = sorted(n for n in self.shards if n not in named)
        self.store.delete(orphans)
        for name in orphans:
            del self.shards[name]
        if orphans:
            notes.append(f"removed {len(orphans)} shard(s) of an interrupted run from {self.url}")
        return notes

    def clear(self) -> int:
        """--overwrite: everything gemma4enc wrote under the prefix, the manifest first (without it
        the shards are orphans, never half-used). Returns how many objects went."""
        listed = self.store.names()
        parts = [n for n in self.store.names(PARTS) if _PART.match(n)]
        ours = [n for n in listed if SHARD_RE.match(n) or n in (SETTINGS, *SEARCH_INDEX)]
        self.store.delete([MANIFEST] if MANIFEST in listed else [])
        self.store.delete(parts + ours)
        return len(parts) + len(ours)

    def commit_compaction(self) -> None:
        """The local manifest (compacted) as the store's base, in steps that each leave the same
        manifest readable: shards a pruning rewrote uploaded, the whole manifest as a `~compacted`
        part, the older parts removed, the base replaced, that part removed, dead shards removed."""
        for p in sorted(self.path.iterdir()):
            if SHARD_RE.match(p.name) and p.name not in self.shards:
                self.publish(p)
        whole = (self.path / MANIFEST).read_bytes()
        reset = f"{PARTS}/{max(self.next_part - 1, 0):012d}{COMPACTED}"
        self.store.write(reset, whole)
        self.store.delete([n for n in self.parts if n != reset])
        self.store.write(MANIFEST, whole)
        self.store.delete([reset])
        self.parts, self.pushed, self.found = [], len(whole), True
        named = Ledger(self.path).refresh().shards()
        dead = sorted(n for n in self.shards if n not in named)
        self.store.delete(dead)
        for name in dead:
            del self.shards[name]

    def close(self) -> None:
        MIRRORS.pop(self.path, None)
        shutil.rmtree(self.path, ignore_errors=True)


def shard_file(out: Path, name: str) -> Path:
    """Where a reader finds shard `name` of OUT: in the folder, or fetched from the store where
    OUT is a URL's mirror."""
    mirror = MIRRORS.get(Path(out))
    return mirror.shard(name) if mirror is not None else Path(out) / name


def shard_names(out: Path) -> set[str]:
    """The shards OUT holds: in the folder, or listed in the store."""
    mirror = MIRRORS.get(Path(out))
    if mirror is not None:
        return set(mirror.shards)
    return {p.name for p in Path(out).iterdir() if SHARD_RE.match(p.name)}


def drop_fetched(out: Path, name: str) -> None:
    """A shard's copy fetched from a store, removed (a local OUT's shards are never touched)."""
    if Path(out) in MIRRORS:
        (Path(out) / name).unlink(missing_ok=True)


@contextlib.contextmanager
def fetched(out: Path, name: str):
    """shard_file for one read; a copy fetched from a store is dropped after (verify and the
    exports read every shard once: the disk holds one at a time)."""
    path = shard_file(out, name)
    try:
        yield path
    finally:
        drop_fetched(out, name)


@contextlib.contextmanager
def local_out(out, need: bool = False):
    """A local folder for OUT: itself, or for a URL a mirror read from the store (not locked: a
    reader's snapshot), removed on exit. `need`: a store with no manifest is a usage error."""
    from ..errors import OutputError, UsageError
    from ..media.remote import is_url
    from .files import not_an_output
    from .store import SAVED

    if not is_url(str(out)):
        yield Path(out)
        return
    mirror = Mirror(str(out))
    try:
        try:
            mirror.pull(holder=True)
        except OutputError as e:  # keys, endpoint, a store that is down: nothing read, nothing to resume
            raise UsageError(str(e).removesuffix(SAVED)) from None
        if need and not mirror.found:
            raise UsageError(not_an_output(mirror.url))
        yield mirror.path
    finally:
        mirror.close()


@contextlib.contextmanager
def locked_out(out):
    """(local folder, its mirror or None) for OUT under its lock: a folder's flock, or a store's."""
    from ..media.remote import is_url
    from .lock import Lock

    if not is_url(str(out)):
        with Lock(Path(out)):
            yield Path(out), None
        return
    mirror = Mirror(str(out))
    try:
        with mirror.locked() as held:
            yield held.path, held
    finally:
        mirror.close()
