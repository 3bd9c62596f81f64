"""What is left to do in OUT: the files whose latest row matches their size and mtime (or content,
with --hash) are done; a moved folder's files adopt their rows instead of being encoded again."""

from __future__ import annotations

import os

from ..media import remote
from ..media.discover import look
from ..media.kinds import DONE, Item
from ..media.sources import exists
from ..options import Options
from ..rows import VIDEO_KEYS, Status
from .ledger import Ledger
from .out import Out
from .repair import LOST


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
        if (
            status in (LOST, Status.MOVED)
            or (self.options.retry_failed and status != Status.OK)
            or (self.options.hash and status == Status.OK)
        ):
            return self.ledger.kind_at(r)  # still_to_do decides (and hashes): not opened, kept
        if r >= len(self.rows):  # a row read since (a streamed discovery goes on under the lock)
            self.rows.extend(bytes(r + 1 - len(self.rows)))
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
            marked &= ~ledger.live()[: self.read]
        back: list[Item] = []
        for r in np.flatnonzero(marked).tolist():  # or every mark, where the manifest was replaced
            self.rows[r] = 0
            path, root = self.path_of(r)
            rel = path[len(root) :].lstrip(os.sep) if root else None
            item = look(path, None, root, rel)  # never None without `known`
            if item is not None:
                back.append(item)
        if not back:
            return items
        merged = {i.path: i for i in back} | {
            i.path: i for i in items
        }  # one Item a path, as discover keeps
        return sorted(merged.values(), key=lambda i: i.path)


def still_to_do(
    items: list[Item], out: Out, options: Options, ledger: Ledger | None = None
) -> list[Item]:
    """Files without a row for their current content: new, changed, or failed with --retry-failed.

    Size + mtime_ns decide; with --hash, a file whose size matches is also hashed, and a file
    only touched (same sha256) keeps its tokens and gets a refreshed row instead of a re-encode.
    A row with no sha256 (made without --hash) is encoded again under --hash: a hash is only ever
    written for the bytes the tokens were made from.
    A file with no row under its path but an ok row with its path relative to its root, size and
    mtime is the same file under a moved or remounted root when the old path is gone (or is this
    file), and its row is adopted; with --hash, a matching sha256 adopts it wherever the old one is.
    """
    ledger = ledger if ledger is not None else out.ledger()
    todo, refreshed = [], []
    for item in items:
        row = ledger.get(item.path)
        if row is not None and row.status == Status.MOVED:  # moved away, now back (or another file)
            row = None
        if row is None and (adopted := _adopt(item, ledger, options)):
            refreshed += adopted
        elif (
            row is None
            or row.size != item.size
            or row.status == LOST
            or (options.retry_failed and row.status != Status.OK)
        ):
            todo.append(item)
        elif options.hash and row.status == Status.OK and not item.error:
            from ..media.prepare import sha256

            saved = ledger.digest(item.path)
            if saved is None:
                # a row made without --hash cannot say which bytes its tokens came from (a
                # same-size, same-mtime rewrite looks unchanged): hashing what is there now onto
                # it could vouch for tokens of older content. Encoded again, its row's hash is
                # that of the bytes the tokens are made from.
                todo.append(item)
                continue
            try:
                digest = sha256(item.path, item.root, item.rel)
            except OSError:
                todo.append(item)  # let decode say why it cannot be read
                continue
            if digest != saved:
                todo.append(item)
            elif row.mtime_ns != item.mtime_ns:
                refreshed.append(ledger.row(item.path) | {"mtime_ns": item.mtime_ns})
        elif row.mtime_ns != item.mtime_ns:
            todo.append(item)
    out.append(refreshed, later=True)  # a store sends them with the run's next rows
    return todo


OK_ONLY = ("frame_tokens", "width", "height", "sha256")  # what a row without tokens does not carry


def _adopt(item: Item, ledger: Ledger, options: Options) -> list[dict] | None:
    """The row of `item` under its old root moved to its new path, and a `moved` row superseding the
    old path's (one row per file: verify, export and duplicates see the file once); None if none is
    the same file."""
    if item.error or item.rel is None:
        return None
    found = list(ledger.same_rel(item.rel, item.size))
    if not found:
        return None
    digest = None
    if options.hash:
        from ..media.prepare import sha256

        try:
            digest = sha256(item.path, item.root, item.rel)
        except OSError:
            return None
    for path, entry in found:
        saved = ledger.digest(path)
        if digest:  # the content decides, wherever the other file is; a row without a hash
            same = saved == digest  # cannot vouch for these bytes (see still_to_do)
        else:  # without a digest, same name, size and mtime say "the same file" only if it left its old path
            same = entry.mtime_ns == item.mtime_ns and _moved_away(path, item.path)
        if same:
            old = ledger.row(path)
            moved = {"path": item.path, "root": item.root, "rel": item.rel, "mtime_ns": item.mtime_ns}
            gone = {"status": str(Status.MOVED), "error": None, "shard": None, "index": None, "tokens": 0,
                    "moved_to": item.path}
            adopted = old | moved | ({"sha256": digest} if digest else {})
            if path == item.path or exists(path):  # an alias or a copy still there: a file of its own
                return [adopted]
            superseded = {k: v for k, v in old.items() if k not in VIDEO_KEYS and k not in OK_ONLY} | gone
            return [adopted, superseded]
    return None


def _moved_away(old: str, new: str) -> bool:
    """True when `old` is gone or is `new` under another name (a root reached through a symlink).

    A file still at its old path is another file: two dataset splits extracted from one archive
    share names, sizes and mtimes, and only their content tells them apart (--hash). A URL or a
    tar's member is asked of its store or its tar: a local stat would call it gone.
    """
    if remote.is_url(old) or remote.is_url(new) or ".tar/" in old:
        return not exists(old)
    try:
        return os.path.samefile(old, new)
    except FileNotFoundError:
        return True  # gone (or a broken link to where it was)
    except OSError:
        return False  # there but unreadable: not known to be gone
