"""OUT, the output folder, as one object: made once at the edge by `open_out(where)` (opening.py)
and passed down. What OUT holds, by name, is names.py's.

`Out` is OUT and what may be done with it, written once: its names, its settings, its lock, its
ledger, appends, shard numbering and publishing, fetching a shard to read, repair of what a killed
run left, --overwrite's clearing, removal of a task's shards and compaction. It does all of it over
an `OutBackend` (backend.py: a folder, a store, memory), the dozen operations that really differ.
Only the output package knows that a store exists: everything above holds an `Out`.

Where the backends differ on purpose: a folder's lock (an flock) is taken by `locked()`, after
discovery; a store's lock is taken when it is opened to write (`open_out(url, write=True)`), before
discovery, because its settings and manifest must be read under the lock to be the ones the run
appends to, and its `locked()` then only hands that lock on.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Iterator

from ..errors import UsageError
from .backend import OutBackend, ShardPlace
from .files import append_rows, read_own
from .ledger import Ledger
from .names import (
    LOCAL_NAME, MANIFEST, PART_RE, PARTS, SEARCH_INDEX, SETTINGS, SHARD_RE, TEMP_RE, not_an_output, temp_name,
    unnamed_shards,
)

# a run compacts the manifest when superseded rows pass this many and outnumber the live ones:
# then the rewrite costs no more than the rows appended since the last one
AUTO_COMPACT_ROWS = 100_000
# a store's manifest parts are merged into its base once there are this many: a re-run reads every
# part (a request each), the base in one
AUTO_PARTS = 1000


class Out:
    """OUT: its rules, over `backend` (a folder, a store, memory)."""

    records = True  # a shard sink whose rows are the run's (output/shards.py)

    def __init__(self, backend: OutBackend):
        self.backend = backend
        self.url = backend.url

    @property
    def folder(self) -> Path:
        """Where OUT's settings and manifest are read here (a store's working copy): output/'s only."""
        return self.backend.local

    # names

    def path(self, name: str) -> Path:
        return self.folder / name

    def named(self, name: str) -> str:
        """A file of OUT as the user would find it, for messages."""
        return self.backend.named(name)

    def rows_hint(self) -> str:
        """Where a person reads the rows, for a message."""
        return self.backend.rows_hint()

    def for_actors(self) -> ShardPlace:
        """Where another process (a Ray actor) puts its task's shards."""
        return self.backend.handle()

    def absolute(self) -> str:
        """OUT as a consumer elsewhere reaches it (an export's note)."""
        return self.backend.absolute()

    @property
    def in_place(self) -> bool:
        """Whether the manifest read here is OUT's own file (its inode and size tell a change), not
        a copy made at every open (a store's: its bytes must)."""
        return self.backend.in_place

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"Out({type(self.backend).__name__}({self.url!r}))"

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
                f"{self.named(SETTINGS)} is not the settings gemma4enc writes (a JSON object whose "
                "sampling is an object); fix it, or remove it and encode again to record this run's"
            )
        return saved

    def ledger(self, pin: bool = False, read: bool = True) -> Ledger:
        """OUT's manifest read into columns (`pin`: a reader's snapshot, see Ledger.load); `read`
        False: not yet read (an --overwrite run's, or one repair reads first)."""
        return Ledger.load(self.folder, pin=pin) if read else Ledger(self.folder)

    def shard_path(self, name: str) -> Path:
        """Where shard `name` is read from here (a store's: fetched on first use)."""
        return self.backend.fetch(name)

    @contextlib.contextmanager
    def shard(self, name: str) -> Iterator[Path]:
        """shard_path for one read; a copy fetched from a store is dropped after (verify and the
        exports read every shard once: the disk holds one at a time)."""
        try:
            yield self.shard_path(name)
        finally:
            self.drop(name)

    def drop(self, name: str) -> None:
        """A fetched copy of a shard let go (a folder's own shards are never touched)."""
        self.backend.drop(name)

    def shard_names(self) -> set[str]:
        return {n for n in self.backend.listing() if SHARD_RE.match(n)}

    def shard_sizes(self) -> list[int]:
        """The shards' sizes as listed now (a run's summary; Ray actors put theirs themselves)."""
        return [size for n, size in sorted(self.backend.listing().items()) if SHARD_RE.match(n)]

    def temp_files(self) -> list[str]:
        return sorted(n for n in self.backend.listing() if TEMP_RE.match(n))

    def holder(self) -> str | None:
        """The run holding OUT's lock, described, or None."""
        return self.backend.holder()

    def fetch_files(self, names) -> None:
        """Files beside the manifest that OUT keeps (search's cache) brought here, those it has."""
        listed = self.backend.listing()
        for name in names:
            if name in listed:
                self.backend.fetch(name)

    def send_files(self, names, last: str) -> None:
        """Those files made OUT's, `last` after the others (a reader sees all old or all new); one
        not here is removed from OUT."""
        listed = self.backend.listing()
        for name in names:
            if (self.folder / name).exists():
                self.backend.put(self.folder / name, keep=True)
            elif name in listed:  # a folder's copy is OUT's: one not here is not there
                self.backend.delete([name])
        self.backend.put(self.folder / last, keep=True)

    def close(self) -> None:
        self.backend.close()

    def __enter__(self) -> Out:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # writing, with the lock held

    @contextlib.contextmanager
    def locked(self, need: bool = False):
        """A context holding OUT's lock, yielding it (see above for when a store's is taken).
        `need`: OUT must be an output already (compact): said before the lock, which would leave a
        lock file behind."""
        if need and not self.found():
            raise UsageError(not_an_output(self.url))
        with self.backend.lock() as lock:
            yield lock

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
        if overwrite and (removed := self.clear()):
            notes.append(f"--overwrite: removed {removed} earlier output files")
        path = out / SETTINGS
        if path.exists():
            check(json.loads(read_own(path)), settings_of(options, extra), self.url)
        return notes + self.repair(ledger)

    def clear(self) -> int:
        """Everything gemma4enc wrote in OUT (and only that), the manifest first: without it the
        shards are orphans, never half-used. Returns how many files went besides the manifest."""
        listed = self.backend.listing()
        ours = [n for n in listed if SHARD_RE.match(n) or n in (SETTINGS, *SEARCH_INDEX) or TEMP_RE.match(n)]
        parts = [n for n in self.backend.listing(PARTS) if PART_RE.match(n)]
        self.backend.delete([MANIFEST])
        self.backend.delete(parts + ours)
        return len(parts) + len(ours)

    def record_settings(self, options, extra: dict | None = None) -> None:
        """Record the settings (once: a later run only checks them), beside a manifest.

        An empty manifest is created with them: a run over an empty drop folder leaves an OUT that
        verify, inspect and open() read as a folder of no files, not as something else."""
        from .settings import settings_of

        if not (self.folder / MANIFEST).exists():  # here a store's parts are read into it too
            self.backend.write(MANIFEST, b"")
        if SETTINGS not in self.backend.listing() or (self.folder / SETTINGS).is_symlink():  # a link is not ours
            self.backend.write(SETTINGS, json.dumps(settings_of(options, extra), indent=2).encode())

    def repair(self, ledger: Ledger | None = None) -> list[str]:
        """Undo what a kill can leave: a torn last manifest line and temp files (the backend's),
        rows whose shard went missing or unreadable (superseded by `shard_lost` rows, so their files
        are encoded again), shards no latest row names."""
        from .repair import mark_lost

        ledger = (ledger if ledger is not None else self.ledger(read=False)).refresh()  # stops before a torn last line
        notes = self.backend.settle(ledger)
        named = ledger.shards()
        notes += mark_lost(self, named - self.backend.readable(named), ledger)
        self.sync()
        orphans = unnamed_shards(self.backend.listing(), ledger.shards())  # shards only older rows name are dead too
        self.backend.delete(orphans)
        if orphans:
            notes.append(f"removed {len(orphans)} shard(s) of an interrupted run")
        return notes

    def append(self, rows: list, tag: str = "", later: bool = False) -> None:
        """Rows into the manifest, whole lines, fsynced. `tag` names a store's part (a Ray task's);
        `later`: a store sends them with the next append or `sync()`."""
        append_rows(self.folder, rows)
        if not later:
            self.sync(tag)

    def sync(self, tag: str = "") -> None:
        """Rows appended with `later` made OUT's (a store's: as a new part)."""
        self.backend.push(tag)

    def next_shard(self) -> int:
        """A run's shards are numbered on from OUT's highest."""
        numbers = [int(m.group(1)) for n in self.shard_names() if (m := SHARD_RE.match(n)) and m.group(1).isdigit()]
        return 1 + max(numbers, default=-1)

    def first_shard(self) -> int:
        """A shard writer's first number (as a ShardSink): OUT's next."""
        return self.next_shard()

    def shard_name(self, k: int) -> str:
        return LOCAL_NAME.format(k)

    def publish(self, path: Path) -> None:
        """A shard just written in `folder` made OUT's (a store uploads it); its rows come after."""
        self.backend.put(path)

    def remove_shards(self, prefixes: tuple[str, ...]) -> None:
        """The shards whose names start with one of `prefixes` removed (a lost Ray task's)."""
        self.backend.delete(n for n in self.backend.listing() if n.startswith(prefixes) and SHARD_RE.match(n))

    def finish(self, ledger: Ledger) -> str | None:
        """The end of a run, under the lock: rows appended with `later` made OUT's, then the
        manifest compacted where it is mostly superseded rows, or a store's parts are AUTO_PARTS.
        Returns a note for the log, or None."""
        self.sync()
        dead = ledger.superseded + ledger.unreadable
        parts = self.backend.parts
        if dead < max(AUTO_COMPACT_ROWS, len(ledger)) and parts < AUTO_PARTS:
            return None
        report = self._compacted(ledger)
        merged = f"; merged {parts} manifest parts into {self.named(MANIFEST)}" if parts else ""
        return f"compacted {MANIFEST}: {report['rows_before']} rows → {report['rows_after']}{merged}"

    def compact(self, ledger: Ledger | None = None, prune: bool = False) -> dict:
        """`compact`'s command, under the lock: what a killed run left repaired, then the manifest
        rewritten with each file's latest row (with `prune`, of files that still exist), made
        OUT's, the shards no row names any more removed. The report says what it did (`notes`:
        the repair's)."""
        ledger = ledger if ledger is not None else self.ledger(read=False)
        notes = self.repair(ledger)
        return self._compacted(ledger, prune) | {"notes": notes}

    def _compacted(self, ledger: Ledger, prune: bool = False) -> dict:
        from .compact import compact

        report = compact(self, ledger, prune)  # `ledger` read anew from the rewritten manifest
        self.backend.replace_manifest()
        self.backend.delete(unnamed_shards(self.backend.listing(), ledger.shards()))
        return report
