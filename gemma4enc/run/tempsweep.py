"""The temp folders a gemma4enc process makes carry its pid (gemma4enc-out-PID-…: a store OUT's
mirror; g4e-ray-PID-…: a private Ray's sessions and sockets; gemma4enc-task-PID-…: a Ray actor's
task; gemma4enc-search-PID-…: a search's query run). A process killed with kill -9 cannot remove
its own, so each run removes those of processes that are gone: only ours by name, owner and the
mark gemma4enc puts inside (output/files.temp_folder; a user's `gemma4enc-task-2024-notes` has none), only
where the pid is no process at all (a live or reused pid keeps its folder), and only once the
folder has not changed for a minute (a folder being made is never taken)."""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
import time

from ..output.files import TEMP_MARK

_OURS = re.compile(r"(?:gemma4enc-out|g4e-ray|gemma4enc-task|gemma4enc-search)-(\d+)-[^/]+")
SETTLED_S = 60.0


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # another user's process (EPERM): alive
        return False
    return False


def sweep(folder: str | None = None) -> list[str]:
    """Remove the temp folders of gemma4enc processes that are gone; the paths removed."""
    folder = folder or tempfile.gettempdir()
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    now = time.time()
    for entry in entries:
        found = _OURS.fullmatch(entry.name)
        if not found or int(found.group(1)) == os.getpid():
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if not entry.is_dir(follow_symlinks=False) or st.st_uid != os.getuid():
                continue
            mark = os.lstat(os.path.join(entry.path, TEMP_MARK))  # made by gemma4enc, not named alike
            if not stat.S_ISREG(mark.st_mode):
                continue
        except OSError:
            continue
        if now - st.st_mtime < SETTLED_S or not _gone(int(found.group(1))):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        if not os.path.lexists(entry.path):
            removed.append(entry.path)
    return removed
