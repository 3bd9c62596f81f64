"""OUT as the user names it (a folder, a URL) → its `Out` (out.py) over the backend that holds it
(backend.py): the one place that tells a store from a folder, as zarr's make_store does."""

from __future__ import annotations

import contextlib
from pathlib import Path

from ..errors import SAVED, OutputError, UsageError, no_credentials
from .backend import FolderBackend
from .names import not_an_output
from .out import Out


def open_out(where, write: bool = False, overwrite: bool = False) -> Out:
    """OUT as the user named it → its `Out`: a folder, or a store where `where` is a URL.

    `write`: to encode into. A folder is then checked to be one (not a file) and locked later by
    `locked()`; a store is locked now, read under the lock (cleared first with `overwrite`)."""
    from ..media.remote import is_url

    no_credentials(str(where), "OUT")
    if not is_url(str(where)):
        folder = Path(where)
        if write and folder.exists() and not folder.is_dir():  # /dev/null, a file
            kind = "a file" if folder.is_file() else "not a folder"
            raise UsageError(
                f"-o {folder}: {kind}; OUT is the folder the shards and manifest go in (new, or one encode made)"
            )
        return Out(FolderBackend(folder))
    from .storebackend import StoreBackend

    store = StoreBackend(str(where))
    out = Out(store)
    try:
        store.open(write)
        if write and overwrite:
            out.clear()  # under the lock, before anything reads it
    except BaseException:
        out.close()
        raise
    return out


@contextlib.contextmanager
def reading(where, need: bool = True):
    """OUT opened to read for a command (inspect, verify, export, search): a store that cannot be
    read, or (`need`) OUT without a manifest, is a usage error; closed on exit."""
    try:
        out = open_out(where)
    except OutputError as e:  # keys, endpoint, a store that is down: nothing read, nothing to resume
        raise UsageError(str(e).removesuffix(SAVED)) from None
    try:
        if need and not out.found():
            raise UsageError(not_an_output(out.url))
        yield out
    finally:
        out.close()

