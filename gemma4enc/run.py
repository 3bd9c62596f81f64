"""One run: lock and preflight the output folder, what is left to do, the engine, the summary."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from pathlib import Path

from .discover import Item
from .engines import Run
from .errors import TooManyFailures, UsageError, first_lines
from .model import resolve_dtype
from .options import Options
from .outdir import Lock, describe, prepare_out, still_to_do, write_settings
from .shards import MANIFEST, read_manifest, reason


def encode_files(items: list[Item], out: Path, options: Options, bar, log=None, overwrite: bool = False) -> dict:
    """The whole run, under OUT's lock, on the chosen engine; returns the summary that --json prints."""
    from .preflight import preflight

    out = Path(out)
    log = log or (lambda message: None)
    options, extra = preflight(options)  # before OUT is touched
    options = replace(options, dtype=resolve_dtype(options))  # auto decided once: recorded and used alike
    created = not out.exists()
    try:
        with _locked(out) as lock:
            if lock.previous:
                log(f"took over the lock of an earlier run that is gone ({describe(lock.previous)})")
            for note in prepare_out(out, options, overwrite, extra):
                log(note)
            todo = still_to_do(items, out, options)
            ready = lambda: write_settings(out, options, extra)  # noqa: E731 - once the model has loaded
            try:
                summary = _engine(options.engine)(todo, Run(out, options, bar, log, done=len(items) - len(todo),
                                                            ready=ready))
            except TooManyFailures as e:
                raise TooManyFailures(f"{e}; finished files are saved (see {out / MANIFEST})") from None
    except UsageError:
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()  # the folder this run made for nothing
        raise
    rows = read_manifest(out)
    failures = [f"{Path(r['path']).name}: {r['status']}" for i in todo if (r := rows.get(i.path)) and r["status"] != "ok"]
    if failures:
        log(f"{len(failures)} file(s) failed: {first_lines(failures)} (see {out / MANIFEST})")
    return {
        "out": str(out), "files": len(items), "done_before": len(items) - len(todo), "encoded": summary.ok,
        "failed": summary.failed, "by_status": summary.by_status, "frames": summary.frames,
        "tokens": summary.tokens, "patches": summary.patches, "seconds": round(summary.seconds, 3),
        "items_per_s": round(summary.files / summary.seconds, 3) if summary.seconds else None,
        "patches_per_s": round(summary.patches / summary.seconds, 1) if summary.seconds else None,
        "engine": options.engine, **summary.where,
    }


@contextlib.contextmanager
def _locked(out: Path):
    """OUT made and locked; a folder we cannot write to (read-only, immutable, full) is a usage error."""
    lock = Lock(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        lock.acquire()
    except OSError as e:
        raise UsageError(f"cannot write to {out}: {reason(e)}") from None
    try:
        yield lock
    finally:
        lock.release()


def _engine(name: str):
    """--engine → its encode(todo, run); Ray is imported only when asked for."""
    if name == "ray":
        from .engines.ray import encode
    else:
        from .engines.local import encode
    return encode
