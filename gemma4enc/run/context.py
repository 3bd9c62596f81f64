"""Where a run's files are encoded: `local` (this process and its decode workers) or `ray`.

Every engine is a module with one function, `encode(todo, run) -> Summary`: it encodes the
files still to do and lands their rows in OUT's manifest, while the caller (`run.encode_files`)
holds OUT's lock and picks the engine. `run` is the context they share, fixed for the whole run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from ..options import Options

if TYPE_CHECKING:
    from ..media.workers import DecodePool
    from ..output.out import Out


@dataclass(frozen=True)
class Run:
    out: Out  # OUT, locked by the caller: shards and rows go to it (a store's as they are written)
    options: Options
    bar: Callable  # bar(total files) -> a pipeline.Progress with advance() and close()
    log: Callable[[str], None]  # one message line for the user
    done: int  # files already done in OUT before this run, for the first log line
    ready: Callable[[], None] = lambda: None  # call once the model is known good: records OUT's settings
    pool: DecodePool | None = (
        None  # decode workers the caller started early (local engine), else the engine's own
    )
