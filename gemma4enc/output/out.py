"""OUT, the output folder, as one object: made once at the edge by `open_out(where)` (opening.py)
and passed down. What OUT holds, by name, is names.py's.

`Out` is that folder and what may be done with it: its names, its settings, its lock, its ledger,
appends, shard numbering and publishing, fetching a shard to read, repair of what a killed run left,
removal of a task's shards and compaction. Two backends stand behind it:
  LocalOut  the folder itself (this module);
  StoreOut  OUT at a URL, through a local working copy of its settings and manifest (storeout.py).
Only the output package knows that a store exists: everything above holds an `Out`.

Where the two differ on purpose: a folder's lock (an flock) is taken by `locked()`, after discovery;
a store's lock is taken when it is opened to write (`open_out(url, write=True)`), before discovery,
because its settings and manifest must be read under the lock to be the ones the run appends to,
and its `locked()` then only hands that lock on.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Protocol

from ..errors import UsageError, reason
from .files import append_rows, atomic_write, own_opener, read_own
from .ledger import Ledger
from .lock import Lock, running
from .names import LOCAL_NAME, MANIFEST, SEARCH_INDEX, SETTINGS, SHARD_RE, TEMP_RE, not_an_output, temp_name

# a run compacts the manifest when superseded rows pass this many and outnumber the live ones:
# then the rewrite costs no more than the rows appended since the last one
AUTO_COMPACT_ROWS = 100_000

class ShardPlace(Protocol):
    """Where a Ray task's shards go, as the actor is told it (picklable: `Out.for_actors()`): a
    folder to write them in for the task, and how a written shard is made OUT's. The actor never
    takes OUT's lock nor reads its manifest: its rows go back to the driver."""

    def staging(self) -> contextlib.AbstractContextManager[Path]: ...

    def put(self, path: Path) -> None: ...


@dataclass(frozen=True)
class FolderPlace:
    """OUT a folder: a task's shards are written in it, where OUT reads them."""

    folder: str

    @contextlib.contextmanager
    def staging(self) -> Iterator[Path]:
        yield Path(self.folder)

    def put(self, path: Path) -> None:
        pass  # written in place (temp name, fsync, rename)


class Out:
    """OUT: what every backend does alike, on `folder` (OUT itself, or a store's working copy)."""

    folder: Path  # where OUT's files are read and written here
    url: str  # OUT as the user named it, for messages
    remote = False  # its manifest is a new copy at every open (a store's): bytes, not inodes, decide
    records = True  # a shard sink whose rows are the run's (output/shards.py)

    # names

    def path(self, name: str) -> Path:
        return self.folder / name

    def named(self, name: str) -> str:
        """A file of OUT as the user would find it, for messages."""
        return str(self.folder / name)

    def rows_hint(self) -> str:
        """Where a person reads the rows, for a message."""
        return f"see {self.url}/{MANIFEST}"

    def for_actors(self) -> ShardPlace:
        """Where another process (a Ray actor) puts its task's shards."""
        return FolderPlace(str(self.folder))

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def walked_past(self) -> str:
        """The local folder a walk over the inputs must leave out: OUT's own files (a store's copy)."""
        return str(self.folder)

    def is_new(self) -> bool:
        """Whether OUT's folder is not made yet: a run that makes it and fails before writing
        anything takes it back (remove_if_empty)."""
        return not self.folder.exists()

    def remove_if_empty(self) -> None:
        if self.folder.is_dir() and not any(self.folder.iterdir()):
            self.folder.rmdir()

    # reading

    def found(self) -> bool:
        """Whether OUT holds a manifest (is an output at all)."""
        return (self.folder / MANIFEST).exists()

    def settings(self) -> dict | None:
        """What settings.json records, or None where there is none (or it cannot be read)."""
        try:
            saved = json.loads(read_own(self.folder / SETTINGS))
        except (OSError, ValueError):
            return None
        if not isinstance(saved, dict) or not isinstance(saved.get("sampling", {}), dict):
            raise UsageError(  # a handed-over OUT's: one line, never an AttributeError (exit 70)
                f"{self.folder / SETTINGS} is not the settings gemma4enc writes (a JSON object whose "
                "sampling is an object); fix it, or remove it and encode again to record this run's"
            )
        return saved

    def ledger(self, pin: bool = False, read: bool = True) -> Ledger:
        """OUT's manifest read into columns (`pin`: a reader's snapshot, see Ledger.load); `read`
        False: not yet read (an --overwrite run's, or one repair reads first)."""
        return Ledger.load(self.folder, pin=pin) if read else Ledger(self.folder)

    def shard_path(self, name: str) -> Path:
        """Where shard `name` is read from here."""
        return self.folder / name

    @contextlib.contextmanager
    def shard(self, name: str):
        """shard_path for one read; a copy fetched from a store is dropped after (verify and the
        exports read every shard once: the disk holds one at a time)."""
        path = self.shard_path(name)
        try:
            yield path
        finally:
            self.drop(name)

    def drop(self, name: str) -> None:
        """A fetched copy of a shard let go (a folder's own shards are never touched)."""

    def shard_names(self) -> set[str]:
        return {p.name for p in self.folder.iterdir() if SHARD_RE.match(p.name)}

    def shard_sizes(self) -> list[int]:
        """The shards' sizes as listed now (a run's summary; one that went meanwhile is left out)."""
        sizes = []
        for name in sorted(self.shard_names()):
            try:
                sizes.append((self.folder / name).stat().st_size)
            except FileNotFoundError:  # another run's compaction, once this one let go of the lock
                pass
        return sizes

    def temp_files(self) -> list[str]:
        return sorted(p.name for p in self.folder.iterdir() if TEMP_RE.match(p.name))

    def holder(self) -> str | None:
        """The run holding OUT's lock, described, or None."""
        return running(self.folder)

    def fetch_files(self, names) -> None:
        """Files beside the manifest that a store keeps (search's cache) brought here; a folder has them."""

    def send_files(self, names, last: str) -> None:
        """Those files back to a store, `last` after the others (a reader sees all old or all new)."""

    def close(self) -> None:
        pass

    def __enter__(self) -> Out:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # writing, with the lock held

    def locked(self, need: bool = False):
        """A context holding OUT's lock, yielding it; see LocalOut and StoreOut."""
        raise NotImplementedError

    def prepare(self, options, overwrite: bool = False, extra: dict | None = None,
                ledger: Ledger | None = None) -> list[str]:
        """Prove OUT writable, check its settings, clear a killed run's leftovers.

        Call with the lock held; `ledger` (OUT's manifest, read before the lock was taken) is
        brought up to date. The settings are written by record_settings once the model has
        loaded: a run that fails before leaves none that would refuse the corrected command.
        Returns notes for the log (what was cleaned up)."""
        from .settings import check, settings_of

        out = self.folder
        try:
            out.mkdir(parents=True, exist_ok=True)
            probe = out / temp_name("write-test")
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise UsageError(f"cannot write to {out}: {e.strerror or e}") from None
        notes = []
        path = out / SETTINGS
        if overwrite:
            removed = [p for p in self._ours() if p.name != SETTINGS]
            (out / MANIFEST).unlink(missing_ok=True)  # first: without it the shards are orphans, never half-used
            for p in removed:
                p.unlink(missing_ok=True)
            path.unlink(missing_ok=True)
            if removed:
                notes.append(f"--overwrite: removed {len(removed)} earlier output files")
        if path.exists():
            check(json.loads(read_own(path)), settings_of(options, extra), out)
        return notes + self.repair(ledger)

    def _ours(self) -> list[Path]:
        """Everything gemma4enc writes in the folder (and only that: --overwrite removes these)."""
        return [
            p for p in self.folder.iterdir()
            if SHARD_RE.match(p.name) or p.name in (MANIFEST, SETTINGS, *SEARCH_INDEX) or TEMP_RE.match(p.name)
        ]

    def record_settings(self, options, extra: dict | None = None) -> None:
        """Record the settings (once: a later run only checks them), beside a manifest.

        An empty manifest is created with them: a run over an empty drop folder leaves an OUT that
        verify, inspect and open() read as a folder of no files, not as something else."""
        from .settings import settings_of

        with open(self.folder / MANIFEST, "ab", opener=own_opener):  # appends nothing: creates it where missing
            pass
        path = self.folder / SETTINGS
        if not path.exists():
            mine = settings_of(options, extra)
            atomic_write(path, lambda tmp: tmp.write_text(json.dumps(mine, indent=2)))

    def repair(self, ledger: Ledger | None = None) -> list[str]:
        raise NotImplementedError

    def append(self, rows: list, tag: str = "", later: bool = False) -> None:
        """Rows into the manifest, whole lines, fsynced. `tag` names a store's part (a Ray task's);
        `later`: a store sends them with the next append or `sync()`."""
        append_rows(self.folder, rows)

    def sync(self) -> None:
        """Rows appended with `later` sent on (a store's)."""

    def next_shard(self) -> int:
        """A run's shards are numbered on from OUT's highest."""
        numbers = [int(m.group(1)) for n in self.shard_names() if (m := SHARD_RE.match(n)) and m.group(1).isdigit()]
        return 1 + max(numbers, default=-1)

    def shard_name(self, k: int) -> str:
        return LOCAL_NAME.format(k)

    def publish(self, path: Path) -> None:
        """A shard just written in `folder` made OUT's (a store uploads it); its rows come after."""

    def remove_shards(self, prefixes: tuple[str, ...]) -> None:
        """The shards whose names start with one of `prefixes` removed (a lost Ray task's)."""
        raise NotImplementedError

    def maybe_compact(self, ledger: Ledger) -> str | None:
        """Compact once the manifest is mostly superseded rows (call under the lock, at the end of a run)."""
        from .compact import compact

        dead = ledger.superseded + ledger.unreadable
        if dead < max(AUTO_COMPACT_ROWS, len(ledger)):
            return None
        report = compact(self, ledger)
        return f"compacted {MANIFEST}: {report['rows_before']} rows → {report['rows_after']}"

    def compact(self, ledger: Ledger | None = None, prune: bool = False) -> dict:
        """The manifest rewritten with each file's latest row (compact.py); under the lock."""
        from .compact import compact

        return compact(self, ledger, prune)


class LocalOut(Out):
    """OUT as a folder on this machine's filesystem: flock, fsync, rename and append."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.url = str(self.folder)
        self._lock: Lock | None = None

    @contextlib.contextmanager
    def locked(self, need: bool = False):
        """OUT made and locked; a folder we cannot write to (read-only, immutable, full) is a usage
        error. Yields the lock (`previous`: a dead holder taken over from). `need`: OUT must be an
        output already (compact): said before the lock, which would leave a lock file behind."""
        if need and not self.found():
            raise UsageError(not_an_output(self.url))
        lock = Lock(self.folder)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            lock.acquire()
        except OSError as e:
            raise UsageError(f"cannot write to {self.folder}: {reason(e)}") from None
        self._lock = lock
        try:
            yield lock
        finally:
            self._lock = None
            lock.release()

    def repair(self, ledger: Ledger | None = None) -> list[str]:
        from .repair import repair

        return repair(self, ledger)

    def remove_shards(self, prefixes: tuple[str, ...]) -> None:
        for p in self.folder.iterdir():
            if p.name.startswith(prefixes) and SHARD_RE.match(p.name):
                p.unlink(missing_ok=True)
