"""What is left to do, found chunk by chunk while the engine works: a first run over ten million new
files holds a chunk's Items and the decoders' read-ahead, not an Item for every file.

Discovery (media/discover.discover_chunks) hands over sorted chunks; each is decided against the
manifest (output/todo.still_to_do) only when the engine reaches it. The engine sees one iterable
whose len() is what is known so far; the progress bar's total grows as chunks are decided.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterator

from ..media.kinds import Item
from ..rows import Status


class Stream:
    def __init__(
        self,
        first: list[Item],
        todo: list[Item],
        more: Iterator[list[Item]],
        decide: Callable[[list[Item]], list[Item]],
    ):
        self.found = len(first)  # files discovery handed over (done ones it kept out are not here)
        self.todo = len(todo)  # of those, the ones to do
        self._pending, self._more, self._decide = todo, more, decide
        self._progress = None

    def primed(self) -> Stream | list:
        """Chunks decided until one has work (then self) or discovery ends with none (then [])."""
        while not self._pending and self._next():
            pass
        return self if self._pending else []

    def _next(self) -> bool:
        chunk = next(self._more, None)
        if chunk is None:
            return False
        decided = self._decide(chunk)
        self.found += len(chunk)
        self.todo += len(decided)
        self._pending.extend(decided)
        if decided and self._progress is not None and hasattr(self._progress, "grow"):
            self._progress.grow(len(decided))
        return True

    def watch(self, progress):
        """The engine's progress bar, told of the files each later chunk adds."""
        self._progress = progress
        return progress

    def __len__(self) -> int:
        return self.todo

    def __bool__(self) -> bool:
        return self.todo > 0

    def __iter__(self) -> Iterator[Item]:
        while True:
            pending, self._pending = self._pending, []
            yield from pending
            if not self._next() and not self._pending:
                return


def failures_since(manifest: Path, offset: int, limit: int = 20) -> tuple[list[str], int]:
    """(the first `limit` failed file names, how many failed) among the rows `manifest` gained past
    `offset`: a streamed run keeps no list of its files to look them up by."""
    names, count = [], 0
    with open(manifest, "rb") as f:
        f.seek(offset)
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if row.get("status") not in (Status.OK, None):
                count += 1
                if len(names) < limit:
                    names.append(f"{Path(row['path']).name}: {row['status']}")
    return names, count
