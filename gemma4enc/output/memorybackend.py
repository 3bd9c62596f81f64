"""OUT held in memory, as an OutBackend (backend.py): a dict of name → bytes and a threading.Lock,
behind a temp working copy as a store's is. For the fast contract and unit tests (and a library
caller who wants an OUT that no disk keeps): every rule of `Out` runs on it as on a folder or a
store, without a filesystem to fill or a store to start.

The manifest is one object that `push` appends to; the lock is a name in the dict naming its
holder, taken and given back under a process-wide threading.Lock, so two `Out`s on one dict
exclude each other.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator

from ..errors import UsageError
from .backend import OutBackend, task_folder
from .files import temp_folder
from .lock import holding
from .names import LOCK, MANIFEST, SETTINGS

if TYPE_CHECKING:
    from .ledger import Ledger

_GUARD = threading.Lock()  # one lock test-and-set at a time, for every dict


class MemoryBackend(OutBackend):
    """OUT as `objects` (name → bytes; a sub-folder's names hold a '/'), named `url` in messages."""

    def __init__(self, objects: dict[str, bytes] | None = None, url: str = "memory://out"):
        self.objects = {} if objects is None else objects
        self.url = url
        self.local = Path(temp_folder("gemma4enc-out"))
        self.pushed = 0  # bytes of the local manifest the dict holds

    def open(self) -> MemoryBackend:
        """OUT's settings and manifest copied into `local`."""
        for name in (MANIFEST, SETTINGS):
            (self.local / name).unlink(missing_ok=True)
            if name in self.objects:
                (self.local / name).write_bytes(self.objects[name])
        manifest = self.objects.get(MANIFEST, b"")
        self.pushed = len(manifest)
        if manifest and not manifest.endswith(b"\n"):  # a line cut short: the next starts its own
            with open(self.local / MANIFEST, "ab") as f:  # (and the next push ends it in the dict too)
                f.write(b"\n")
        return self

    @contextlib.contextmanager
    def lock(self) -> Iterator[MemoryLock]:
        """The lock as a name in the dict, holding who took it (pid, host, start), as a store's
        object does; one whose holder is gone from this host is taken over and said."""
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        with _GUARD:
            body = self.objects.get(LOCK)
            if body is not None and (held := holding(body)) is not None:
                raise UsageError(f"{self.url} is in use by another gemma4enc run ({held}); "
                                 "wait for it to finish or stop it")
            taken = MemoryLock(previous=_named(body) if body is not None else None)
            self.objects[LOCK] = json.dumps(me).encode()
        try:
            yield taken
        finally:
            with _GUARD:
                self.objects.pop(LOCK, None)

    def holder(self) -> str | None:
        body = self.objects.get(LOCK)
        return None if body is None else holding(body)

    def listing(self, sub: str = "") -> dict[str, int]:
        cut = f"{sub}/" if sub else ""
        return {
            n: len(data) for n, data in list(self.objects.items())
            if n.startswith(cut) and "/" not in n[len(cut):]
        }

    def write(self, name: str, data: bytes) -> None:
        (self.local / name).write_bytes(data)
        self.objects[name] = bytes(data)

    def delete(self, names: Iterable[str]) -> None:
        for name in list(names):
            self.objects.pop(name, None)
            if "/" not in name:
                (self.local / name).unlink(missing_ok=True)
            if name == MANIFEST:
                self.pushed = 0

    def fetch(self, name: str) -> Path:
        path = self.local / name
        if not path.exists():
            if name not in self.objects:
                raise FileNotFoundError(f"{self.url}/{name}")
            path.write_bytes(self.objects[name])
        return path

    def drop(self, name: str) -> None:
        (self.local / name).unlink(missing_ok=True)

    def put(self, path: Path, keep: bool = False) -> None:
        self.objects[path.name] = path.read_bytes()
        if not keep:
            path.unlink(missing_ok=True)

    def push(self, tag: str = "") -> None:
        manifest = self.local / MANIFEST
        if not manifest.exists():
            return
        with _GUARD, open(manifest, "rb") as f:
            f.seek(self.pushed)
            tail = f.read()
            tail = tail[: tail.rfind(b"\n") + 1]
            self.objects[MANIFEST] = self.objects.get(MANIFEST, b"") + tail
            self.pushed += len(tail)

    def settle(self, ledger: Ledger) -> list[str]:
        return []  # pushed lines are whole

    def replace_manifest(self) -> None:
        whole = (self.local / MANIFEST).read_bytes()
        self.objects[MANIFEST] = whole
        self.pushed = len(whole)

    def handle(self) -> MemoryPlace:
        return MemoryPlace(self)

    def close(self) -> None:
        shutil.rmtree(self.local, ignore_errors=True)


def _named(body: bytes) -> dict:
    """The holder a lock names, as a dict ({} where it is not one: a hostile or torn body)."""
    try:
        holder = json.loads(body)
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


@dataclass
class MemoryLock:
    """The lock a MemoryBackend hands out: `previous`, a dead holder taken over from."""

    previous: dict | None


@dataclass
class MemoryPlace:
    """A task's shards into the same dict: in this process only (a Ray actor elsewhere cannot
    reach it; memory is for tests and in-process callers)."""

    backend: MemoryBackend

    def staging(self) -> contextlib.AbstractContextManager[Path]:
        return task_folder()

    def put(self, path: Path) -> None:
        self.backend.put(path)
