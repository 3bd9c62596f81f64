"""OUT at a URL (`-o s3://bucket/prefix`, gs://, any fsspec protocol): the object operations a run
needs, each retried, and OUT's lock as a conditional create.

An object store has no rename, no append and no flock. What stands in for them here:
- an object is written whole by one request (a shard from its local file, a manifest part from
  its bytes): it appears complete or not at all, and writing it again writes the same thing, so
  a request retried after a dropped reply never doubles anything;
- the lock is an object created only where none exists (`If-None-Match: *` on S3): of two runs
  only one creates it. Its holder rewrites it every minute; one not rewritten for STALE_S, or
  left on this host by a process that is gone, is taken over, as a killed run's flock is.

A store that answers errors (503 SlowDown, a connection dropped mid-upload) costs retries here,
and only here: the protocol's client is made not to retry (remote.ONE_TRY), so a request gives up
after TRIES attempts within RETRY_S. One that still fails is an OutputError (exit 4), with the
run's finished work saved as far as it was uploaded, and the store is taken for down: each later
request (the lock's release) is tried once. What no retry mends is said at once, naming what to
fix: no credentials, keys the store refuses, and a store never reached since this Store was made
(a wrong endpoint).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path

from ..errors import SAVED, OutputError, UsageError, reason
from .lock import LOCK, alive, describe
from .names import temp_name

TRIES = 8  # attempts per request (backoff 0.25 s doubling to 8 s: 24 s of waits in all)
RETRY_S = 45.0  # and no retry starts past this many seconds from a request's first attempt
STALE_S = 600.0  # a lock its holder has not rewritten for this long is a dead run's
RENEW_S = 60.0


class Store:
    """The objects under one URL prefix, by name (`shard-000001.safetensors`, `manifest.parts/…`)."""

    def __init__(self, url: str):
        from ..media.remote import filesystem

        self.url = url.rstrip("/")
        self.fs, root = filesystem(self.url, one_try=True)
        self.root = root.rstrip("/")
        self.reached = False  # whether the store has answered yet (a wrong endpoint never does)
        self.down = False  # a request gave up: later ones are tried once

    def key(self, name: str) -> str:
        return f"{self.root}/{name}"

    def _retried(self, what: str, call, *args, **kwargs):
        """call(*args), again after a transient error; a store's final no is an OutputError."""
        from ..media.remote import first_line, refusal, unreached, unreached_line

        delay, deadline = 0.25, time.monotonic() + RETRY_S
        for attempt in range(TRIES):
            try:
                answer = call(*args, **kwargs)
                self.reached = True
                return answer
            except (FileNotFoundError, FileExistsError, IsADirectoryError):
                self.reached = True
                raise  # answers, not failures: the caller decides
            except Exception as e:  # noqa: BLE001 - 503s, resets, timeouts: each protocol names them its own way
                if (line := refusal(e, self.url)) is not None:  # keys: no retry mends them
                    raise OutputError(f"cannot {what} in {self.url}: {line}{SAVED}") from None
                never = not self.reached and unreached(e)  # a wrong endpoint, not a store gone down
                if never or self.down or attempt == TRIES - 1 or time.monotonic() + delay > deadline:
                    self.down = not never
                    why = unreached_line(e, self.url) if unreached(e) else first_line(e)
                    raise OutputError(f"cannot {what} in {self.url}: {why}{SAVED}") from None
                time.sleep(delay)
                delay = min(delay * 2, 8.0)

    def read(self, name: str) -> bytes | None:
        """An object's bytes, or None where it does not exist."""
        try:
            return self._retried(f"read {name}", self.fs.cat_file, self.key(name))
        except FileNotFoundError:
            return None

    def read_many(self, names: list[str]) -> list[bytes]:
        """Many objects' bytes, in order (the protocol fetches them concurrently where it can)."""
        if not names:
            return []
        got = self._retried(
            f"read {len(names)} manifest parts", self.fs.cat, [self.key(n) for n in names]
        )
        return [got[self.key(n)] for n in names]

    def _written(self, what: str, call, *args, **kwargs):
        """A write; a missing bucket is a store's final no, said in one line."""
        try:
            return self._retried(what, call, *args, **kwargs)
        except (FileNotFoundError, IsADirectoryError) as e:
            why = "no such bucket or container" if isinstance(e, FileNotFoundError) else reason(e)
            raise OutputError(f"cannot {what} in {self.url}: {why}{SAVED}") from None

    def write(self, name: str, data: bytes) -> None:
        self._written(f"write {name}", self.fs.pipe_file, self.key(name), data)

    def create(self, name: str, data: bytes) -> bool:
        """Write `name` only where it does not exist yet: False where it does."""
        try:
            self._written(f"create {name}", self.fs.pipe_file, self.key(name), data, mode="create")
        except FileExistsError:
            return False
        return True

    def upload(self, local: Path, name: str) -> None:
        """A local file put whole under `name` (large ones in parts that appear only once all are in)."""
        self._written(f"upload {name}", self.fs.put_file, str(local), self.key(name))

    def download(self, name: str, local: Path) -> None:
        """An object into `local`, through a temp name: a dropped download leaves no half file."""
        tmp = local.with_name(temp_name(local.name))  # unguessable: no link planted for it is followed
        try:
            self._retried(f"download {name}", self.fs.get_file, self.key(name), str(tmp))
            os.replace(tmp, local)
        finally:
            tmp.unlink(missing_ok=True)

    def names(self, folder: str = "") -> dict[str, dict]:
        """name → listing info of the objects directly under the prefix (or its `folder`)."""
        top = self.key(folder) if folder else self.root
        try:
            found = self._retried(f"list {folder or 'OUT'}", self.fs.ls, top, detail=True, refresh=True)
        except FileNotFoundError:
            return {}
        cut = len(self.root) + 1
        return {
            info["name"].rstrip("/")[cut:]: info for info in found if info.get("type") != "directory"
        }

    def delete(self, names) -> None:
        for name in names:  # one by one: a store without batch deletes still takes them
            try:
                self._retried(f"remove {name}", self.fs.rm_file, self.key(name))
            except FileNotFoundError:
                pass

    def find_all(self, what: str) -> list[str]:
        """Every object under the prefix, by its name below it (folders included), or [] where
        there is none; `what` names the listing in an error."""
        try:
            found = self._retried(what, self.fs.find, self.root)
        except FileNotFoundError:
            return []
        cut = len(self.root) + 1
        return [name[cut:] for name in found]

    def exists(self) -> bool:
        """Whether anything is under the prefix."""
        try:
            return bool(self._retried("list OUT", self.fs.ls, self.root, refresh=True))
        except FileNotFoundError:
            return False


class StoreLock:
    """OUT's lock in a store: the object gemma4enc.lock, created only where absent, rewritten by a
    thread every RENEW_S while held. `lost` turns true if another run took it over meanwhile (it
    found it stale): the run then stops before writing another row."""

    def __init__(self, store: Store):
        self.store = store
        self.me = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "token": uuid.uuid4().hex,
        }
        self.previous: dict | None = None
        self.lost = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _body(self) -> bytes:
        return json.dumps(self.me | {"renewed": time.time()}).encode()

    def acquire(self) -> StoreLock:
        """Take the lock, or say who holds it (UsageError: nothing has started, nothing written)."""
        try:
            return self._acquire()
        except OutputError as e:  # a bucket that is not there, keys that may not write: exit 2
            raise UsageError(str(e).removesuffix(SAVED)) from None

    def _acquire(self) -> StoreLock:
        for _ in range(3):
            if self.store.create(LOCK, self._body()):
                self._check_exclusive()
                break
            holder = self._holder()
            if holder.get("token") == self.me["token"]:
                break  # ours: the create went through and only its answer was lost
            if not _stale(holder):
                raise UsageError(
                    f"{self.store.url} is in use by another gemma4enc run ({describe(holder)}); "
                    f"wait for it to finish or stop it (a lock not renewed for {STALE_S / 60:.0f} "
                    "minutes is taken over)"
                )
            self.previous = holder
            self.store.delete([LOCK])
        else:
            raise UsageError(f"{self.store.url}: could not take OUT's lock (other runs keep taking it)")
        self._thread = threading.Thread(target=self._renew, name="gemma4enc-lock", daemon=True)
        self._thread.start()
        return self

    def _check_exclusive(self) -> None:
        """A second conditional create of the lock must be refused: a store that ignores the
        condition would let two runs write OUT at once, so it is refused here instead."""
        if self.store.create(LOCK, self._body()):
            self.store.delete([LOCK])
            raise UsageError(
                f"{self.store.url}: this store does not honour conditional writes (If-None-Match), "
                "so OUT cannot be locked there; use a store that does (S3, MinIO, R2, GCS) or a local -o"
            )

    def _holder(self) -> dict:
        try:
            return json.loads(self.store.read(LOCK) or b"{}")
        except ValueError:
            return {}

    def _renew(self) -> None:
        while not self._stop.wait(RENEW_S):
            try:
                if self._holder().get("token") != self.me["token"]:
                    self.lost = True
                    return
                self.store.write(LOCK, self._body())
            except OutputError:
                pass  # the store is down for now: the next minute tries again

    def check(self) -> None:
        if self.lost:
            raise OutputError(
                f"{self.store.url}: another run took over OUT's lock (this run was thought dead); "
                "stopping before writing more"
            )

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            try:
                if not self.lost and self._holder().get("token") == self.me["token"]:
                    self.store.delete([LOCK])
            except OutputError:
                pass  # the store is down: the lock goes stale and the next run takes it over


def _stale(holder: dict) -> bool:
    """A lock left by a process of this host that is gone, or not renewed for STALE_S."""
    if holder.get("host") == socket.gethostname() and not alive(holder.get("pid")):
        return True
    try:
        return time.time() - float(holder.get("renewed", 0)) > STALE_S
    except (TypeError, ValueError):
        return True
