"""The output folder's housekeeping: one run at a time, settings that must match, what is left to do.

Before a run, under the lock: the folder is proved writable, its settings compared, and what a
killed run left behind is cleared (a torn last manifest line, temp files, shards no row names),
so that every shard the manifest names is complete and nothing is counted twice.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
from pathlib import Path

from .discover import DONE, Item, look
from .errors import UsageError
from .options import Options
from .ledger import MANIFEST, SHARD_RE, TEMP_RE, Ledger, append_rows, atomic_write, line_of, temp_name
from .rows import Status
from .preflight import SETTINGS  # noqa: F401 - kept where the CLI can read it without torch

LOCK = "gemma4enc.lock"
LOST = Status.SHARD_LOST  # a row whose shard went missing or unreadable: always encoded again
# a run compacts the manifest when superseded rows pass this many and outnumber the live ones:
# then the rewrite costs no more than the rows appended since the last one
AUTO_COMPACT_ROWS = 100_000


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
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:  # read-only, another user's, gone: a folder this run cannot use
                raise UsageError(f"cannot write to {self.path.parent}: {e.strerror or e}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_json(fd)
                os.close(fd)
                raise UsageError(f"{self.path.parent} is in use by another gemma4enc run ({describe(holder)}); "
                                 "wait for it to finish or stop it") from None
            except OSError as e:
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    os.close(fd)
                    raise
                holder = _read_json(fd)  # no flock here: trust a live pid on this host
                if holder and holder.get("host") == socket.gethostname() and _alive(holder.get("pid")):
                    os.close(fd)
                    raise UsageError(f"{self.path.parent} is in use by another gemma4enc run ({describe(holder)})")
            if os.path.exists(self.path) and os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                break
            os.close(fd)  # the holder unlinked it as we opened it: lock the new file instead
        self.previous = _read_json(fd) or None
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
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
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return {}


def describe(holder: dict) -> str:
    return f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, since {holder.get('started', '?')}"


def running(out: Path) -> str | None:
    """The run holding OUT's lock, described, or None (the lock file of a killed run does not count)."""
    try:
        holder = json.loads((Path(out) / LOCK).read_text() or "{}")
    except (OSError, ValueError):
        return None
    if holder.get("host") == socket.gethostname() and not _alive(holder.get("pid")):
        return None
    return describe(holder)


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (OSError, TypeError, ValueError) as e:
        return isinstance(e, PermissionError)
    return True


def ours(out: Path) -> list[Path]:
    """Everything gemma4enc writes in OUT (and only that: --overwrite removes these)."""
    return [p for p in out.iterdir() if SHARD_RE.match(p.name) or p.name in (MANIFEST, SETTINGS)
            or TEMP_RE.match(p.name)]


def settings_of(options: Options, extra: dict | None = None) -> dict:
    """What settings.json records: the fingerprint, plus what the run resolved (the hub revision)."""
    return json.loads(json.dumps(options.fingerprint() | (extra or {})))


def prepare_out(out: Path, options: Options, overwrite: bool = False, extra: dict | None = None,
                ledger: Ledger | None = None) -> list[str]:
    """Prove OUT writable, check its settings, clear a killed run's leftovers.

    Call with the lock held; `ledger` (OUT's manifest, read before the lock was taken) is brought
    up to date. The settings are written by write_settings once the model has loaded: a run
    that fails before leaves none that would refuse the corrected command.
    Returns notes for the log (what was cleaned up).
    """
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / temp_name("write-test")
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise UsageError(f"cannot write to {out}: {e.strerror or e}") from None
    notes = []
    path = out / SETTINGS
    mine = settings_of(options, extra)
    if overwrite:
        removed = [p for p in ours(out) if p.name != SETTINGS]
        (out / MANIFEST).unlink(missing_ok=True)  # first: without it the shards are orphans, never half-used
        for p in removed:
            p.unlink(missing_ok=True)
        path.unlink(missing_ok=True)
        if removed:
            notes.append(f"--overwrite: removed {len(removed)} earlier output files")
    if path.exists():
        theirs = json.loads(path.read_text())
        # a key an earlier version did not record is not held against the folder
        changed = sorted(k for k in theirs if mine.get(k) != theirs.get(k))
        if changed:
            detail = ", ".join(f"{k}: {theirs.get(k)!r} → {mine.get(k)!r}" for k in changed)
            raise UsageError(f"{out} was made with other settings ({detail}); use another --out, "
                             "or --overwrite to replace its contents")
    return notes + repair(out, ledger)


def write_settings(out: Path, options: Options, extra: dict | None = None) -> None:
    """Record the settings (once: a later run only checks them), beside a manifest.

    An empty manifest is created with them: a run over an empty drop folder leaves an OUT that
    verify, inspect and open() read as a folder of no files, not as something else.
    """
    with open(out / MANIFEST, "ab"):  # appends nothing: creates it where missing, keeps it where not
        pass
    path = out / SETTINGS
    if not path.exists():
        mine = settings_of(options, extra)
        atomic_write(path, lambda tmp: tmp.write_text(json.dumps(mine, indent=2)))


def repair(out: Path, ledger: Ledger | None = None) -> list[str]:
    """Undo what a kill can leave: a torn last manifest line, temp files, shards no row names."""
    notes = []
    ledger = (ledger or Ledger(out)).refresh()  # stops before a torn last line: ledger.end is where it starts
    manifest = out / MANIFEST
    if manifest.exists() and manifest.stat().st_size > ledger.end:
        with open(manifest, "rb+") as f:  # the next append must start on a line of its own
            f.truncate(ledger.end)
            os.fsync(f.fileno())
        notes.append("dropped a torn last line of the manifest (its file will be encoded again)")
    temps = [p for p in out.iterdir() if TEMP_RE.match(p.name)]
    for p in temps:
        p.unlink(missing_ok=True)
    notes += mark_lost(out, broken_shards(out, ledger), ledger)
    named = ledger.shards()  # shards only older rows name are dead too
    orphans = [p for p in out.iterdir() if SHARD_RE.match(p.name) and p.name not in named]
    for p in orphans:
        p.unlink(missing_ok=True)
    if temps or orphans:
        notes.append(f"removed {len(temps)} temp file(s) and {len(orphans)} shard(s) of an interrupted run")
    return notes


def broken_shards(out: Path, ledger: Ledger) -> set[str]:
    """Shards that ok rows name but that are gone or whose header cannot be read (cheap: headers only)."""
    from safetensors import safe_open

    broken = set()
    for name in ledger.shards():  # only ok rows name a shard
        try:
            with safe_open(str(out / name), framework="numpy"):  # not "pt": a no-op run never imports torch
                pass
        except Exception:  # noqa: BLE001 - missing, truncated, garbage: all mean its tokens are lost
            broken.add(name)
    return broken


def mark_lost(out: Path, shards: set[str], ledger: Ledger) -> list[str]:
    """Rows into these shards are superseded by LOST rows, before any new shard could take a name."""
    if not shards:
        return []
    offsets = [e.offset for _, e in ledger.entries() if e.status == Status.OK and e.shard in shards]
    rows = [r | {"status": LOST, "error": f"its shard {r['shard']} was missing or unreadable; the next run "
                 "encodes it again", "shard": None, "index": None, "tokens": 0, "frames": 0}
            for r in ledger.rows_at(offsets)]
    append_rows(out, rows)
    ledger.refresh()
    if not rows:
        return []
    return [f"{len(shards)} shard(s) missing or unreadable ({', '.join(sorted(shards)[:3])}): "
            f"their {len(rows)} file(s) are encoded again"]


class Unchanged:
    """The files discovery found with nothing to do, kept as one byte per ledger row, not an Item each.

    `known` is discovery's Known: a file whose latest row is for its size and mtime, and that
    still_to_do would leave alone (not lost, not failed under --retry-failed, not to be hashed),
    is marked on that row and dropped, so a re-run over ten million files keeps only the few to do.
    Discovery runs before the lock; under it, once the ledger has read what was appended since (the
    repair's lost rows, another run's), `again` gives back as Items the marked files whose row is
    no longer the latest, to be decided anew.
    """

    def __init__(self, ledger: Ledger, options: Options):
        self.ledger, self.options = ledger, options
        self.rows = bytearray(ledger.rows_read)  # 1: found unchanged (row numbers of this read)
        self.ino, self.read = ledger.ino, ledger.rows_read
        self.path_of = ledger.path_reader()  # still readable if a compaction replaces the manifest

    def known(self, path: str, size: int, mtime_ns: int):
        r = self.ledger.match(path, size, mtime_ns)
        if r < 0:
            return None
        status = self.ledger.status_at(r)
        if status == LOST or (self.options.retry_failed and status != Status.OK) or (
                self.options.hash and status == Status.OK):
            return self.ledger.kind_at(r)  # still_to_do decides (and hashes): not opened, kept
        self.rows[r] = 1
        return DONE

    def __len__(self) -> int:
        return self.rows.count(1)

    def again(self, items: list[Item]) -> list[Item]:
        """`items` with the marked files whose row was superseded since discovery, in path order."""
        ledger = self.ledger
        if ledger.ino == self.ino and ledger.rows_read == self.read:
            return items  # nothing read since: every mark stands (a no-op run's case)
        import numpy as np

        marked = np.frombuffer(self.rows, dtype=np.uint8).astype(bool)
        if ledger.ino == self.ino:  # rows appended: the marks whose row is no longer its path's latest
            marked &= ~ledger.live()[:self.read]
        back = []
        for r in np.flatnonzero(marked).tolist():  # or every mark, where the manifest was replaced
            self.rows[r] = 0
            path, root = self.path_of(r)
            rel = path[len(root):].lstrip(os.sep) if root else None
            back.append(look(path, None, root, rel))
        if not back:
            return items
        merged = {i.path: i for i in back} | {i.path: i for i in items}  # one Item a path, as discover keeps
        return sorted(merged.values(), key=lambda i: i.path)


def still_to_do(items: list[Item], out: Path, options: Options, ledger: Ledger | None = None) -> list[Item]:
    """Files without a row for their current content: new, changed, or failed with --retry-failed.

    Size + mtime_ns decide; with --hash, a file whose size matches is also hashed, and a file
    only touched (same sha256) keeps its tokens and gets a refreshed row instead of a re-encode.
    A file with no row under its path but an ok row with its path relative to its root, size and
    mtime is the same file under a moved or remounted root when the old path is gone (or is this
    file), and its row is adopted; with --hash, a matching sha256 adopts it wherever the old one is.
    """
    ledger = ledger or Ledger.load(out)
    todo, refreshed = [], []
    for item in items:
        row = ledger.get(item.path)
        if row is None and (adopted := _adopt(item, ledger, options)):
            refreshed.append(adopted)
        elif row is None or row.size != item.size or row.status == LOST or (
                options.retry_failed and row.status != Status.OK):
            todo.append(item)
        elif options.hash and row.status == Status.OK and not item.error:
            from .workers import sha256

            try:
                digest = sha256(item.path)
            except OSError:
                todo.append(item)  # let decode say why it cannot be read
                continue
            if ledger.digest(item.path) is None and row.mtime_ns == item.mtime_ns:
                refreshed.append(ledger.row(item.path) | {"sha256": digest})  # --hash turned on: hash what is there, keep it
            elif digest != ledger.digest(item.path):
                todo.append(item)
            elif row.mtime_ns != item.mtime_ns:
                refreshed.append(ledger.row(item.path) | {"mtime_ns": item.mtime_ns})
        elif row.mtime_ns != item.mtime_ns:
            todo.append(item)
    append_rows(out, refreshed)
    return todo


def maybe_compact(out: Path, ledger: Ledger) -> str | None:
    """Compact once the manifest is mostly superseded rows (call under the lock, at the end of a run)."""
    dead = ledger.superseded + ledger.unreadable
    if dead < max(AUTO_COMPACT_ROWS, len(ledger)):
        return None
    report = compact(out, ledger)
    return f"compacted {MANIFEST}: {report['rows_before']} rows → {report['rows_after']}"


def compact(out: Path, ledger: Ledger | None = None, prune: bool = False) -> dict:
    """Rewrite the manifest with each file's latest row only; with prune, only files that still exist.

    Call under the lock. Pruned files' tokens go too: each shard holding one is copied without
    it under a new name first, then the manifest is replaced (temp, fsync, rename), then the old
    shards are removed. A kill at any point leaves a valid folder (at worst unnamed shards, which
    the next run clears).
    """
    out = Path(out)
    ledger = (ledger or Ledger(out)).refresh()
    if not ledger.path.exists():
        raise UsageError(f"{out}: no {MANIFEST}; is this a gemma4enc output folder?")
    gone = {ledger.get(p).offset: p for p in ledger if not os.path.exists(p)} if prune else {}
    moved, replaced = _rewrite_shards(out, ledger, gone) if gone else ({}, [])  # before the manifest: see above
    live = ledger.live_offsets()

    def write(tmp: Path) -> None:
        with open(ledger.path, "rb") as src, open(tmp, "wb") as dst:
            offset, at = 0, 0
            for line in src:
                if offset >= ledger.end:
                    break  # a torn tail; under the lock nothing else is appended
                if at < len(live) and offset == live[at]:
                    at += 1
                    if offset in moved:
                        dst.write(line_of(json.loads(line) | moved[offset]))
                    elif offset not in gone:
                        dst.write(line)
                offset += len(line)

    before = ledger.lines
    atomic_write(ledger.path, write)
    tokens = sum(ledger.get(p).tokens for p in gone.values())
    ledger.refresh()  # the manifest is a new file now: read anew
    named = ledger.shards()
    for p in out.iterdir():  # the shards pruned files left, and those only superseded rows named
        if SHARD_RE.match(p.name) and p.name not in named:
            p.unlink(missing_ok=True)
    return {"out": str(out), "rows_before": before, "rows_after": len(ledger), "pruned": len(gone),
            "pruned_tokens": tokens, "shards_rewritten": len(replaced)}


def _rewrite_shards(out: Path, ledger: Ledger, gone: dict[int, str]) -> tuple[dict[int, dict], list[str]]:
    """Copy every shard that holds a pruned file without it; (offset → new shard/index, old shard names)."""
    from .shards import LOCAL_NAME, next_shard_number, rewrite_shard

    by_shard: dict[str, list[tuple[int, int]]] = {}
    for _, e in ledger.entries():
        if e.shard and e.index >= 0:
            by_shard.setdefault(e.shard, []).append((e.index, e.offset))
    hit = sorted({ledger.get(p).shard for p in gone.values()} & set(by_shard))
    moved, number = {}, next_shard_number(out)
    for name in hit:
        kept = sorted((i, off) for i, off in by_shard[name] if off not in gone)
        if kept:
            new = LOCAL_NAME.format(number)
            number += 1
            rewrite_shard(out / name, [i for i, _ in kept], out / new)
            moved.update({off: {"shard": new, "index": j} for j, (_, off) in enumerate(kept)})
    return moved, hit


def _adopt(item: Item, ledger: Ledger, options: Options) -> dict | None:
    """The row of `item` under its old root, moved to its new path; None if none is the same file."""
    if item.error or item.rel is None:
        return None
    found = list(ledger.same_rel(item.rel, item.size))
    if not found:
        return None
    digest = None
    if options.hash:
        from .workers import sha256

        try:
            digest = sha256(item.path)
        except OSError:
            return None
    for path, entry in found:
        saved = ledger.digest(path)
        if digest and saved:
            same = saved == digest  # the content decides, wherever the other file is
        else:  # without a digest, same name, size and mtime say "the same file" only if it left its old path
            same = entry.mtime_ns == item.mtime_ns and _moved_away(path, item.path)
        if same:
            moved = {"path": item.path, "root": item.root, "rel": item.rel, "mtime_ns": item.mtime_ns}
            return ledger.row(path) | moved | ({"sha256": digest} if digest else {})
    return None


def _moved_away(old: str, new: str) -> bool:
    """True when `old` is gone or is `new` under another name (a root reached through a symlink).

    A file still at its old path is another file: two dataset splits extracted from one archive
    share names, sizes and mtimes, and only their content tells them apart (--hash).
    """
    try:
        return os.path.samefile(old, new)
    except FileNotFoundError:
        return True  # gone (or a broken link to where it was)
    except OSError:
        return False  # there but unreadable: not known to be gone
