"""One run: OUT's settings resumed, the walk, then under OUT's lock: preflight, what is left to do,
the engine, the summary. `encode` is what the command does; `encode_files` the run over files found."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from pathlib import Path

from ..errors import TooManyFailures, UsageError, first_lines, reason
from ..media.kinds import Item
from ..options import Options
from ..output.compact import compact, maybe_compact
from ..output.files import MANIFEST
from ..output.ledger import Ledger
from ..output.lock import Lock, describe
from ..output.settings import SETTINGS, prepare_out, read_settings, write_settings
from ..output.todo import Unchanged, still_to_do
from ..rows import Status
from .context import Run


def encode(
    roots,
    out: Path,
    flags: dict | None = None,
    given=(),
    *,
    files_from=None,
    null: bool = False,
    include=(),
    exclude=(),
    hidden: bool = False,
    overwrite: bool = False,
    bar=None,
    log=None,
    found=None,
) -> dict:
    """`gemma4enc encode`, for the command and for library callers (verify --repair, search) alike.

    `flags`: settings by Options field name (frames/fps/max_frames for the sampling; the rest take
    their defaults); `given`: the names the user gave. For the output-shaping settings not given,
    OUT/settings.json is read back (Options.resume), and what it changed is logged. The summary
    --json prints, with `skipped_not_media`. `found`: instead of roots, the files as
    (path, root, rel), each kept under the root a walk found it in (verify --repair's files:
    their rows keep `root` and `rel`, so a moved folder is still recognised)."""
    from ..media.remote import is_url
    from .tempsweep import sweep

    log = log or (lambda message: None)
    sweep()  # the temp folders of runs killed with kill -9
    walk = (files_from, list(include or []), list(exclude or []), hidden, null, found)
    if not is_url(str(out)):
        return _encode(roots, Path(out), flags, given, walk, overwrite, bar, log)
    from ..output.mirror import Mirror

    # OUT in a store: the run works on a local mirror of it, under the store's lock
    mirror = Mirror(str(out))
    try:
        with mirror.locked(overwrite) as held:
            if held.lock.previous:
                log(
                    f"took over the lock of an earlier run that is gone ({describe(held.lock.previous)})"
                )
            report = _encode(roots, held.path, flags, given, walk, overwrite, bar, log, held)
            held.relist()
    finally:
        mirror.close()
    return report | {"out": mirror.url, "shard_sizes": list(mirror.shards.values())}


def _encode(roots, out: Path, flags, given, walk: tuple, overwrite: bool, bar, log, mirror=None) -> dict:
    """encode() on a local folder: OUT itself, or a store's mirror. `walk`: files_from, include,
    exclude, hidden, null, as discovery takes them, and `found` (see encode)."""
    from ..media.discover import discover_chunks

    files_from, include, exclude, hidden, null, found = walk
    if out.exists() and not out.is_dir():  # /dev/null, a file: not "File exists" from mkdir
        kind = "a file" if out.is_file() else "not a folder"
        raise UsageError(f"-o {out}: {kind}; OUT is the folder the shards and manifest go in (new, or one encode made)")
    saved = None if overwrite else read_settings(out)  # a re-run may omit the flags
    shown = f"{mirror.url}/{SETTINGS}" if mirror is not None else str(out / SETTINGS)
    options, notes = Options.resume(saved, flags or {}, given, where=shown)
    for note in notes:
        log(note)
    if not roots and not files_from and not found:
        raise UsageError("nothing to encode: give folders or files, or --files-from")
    ledger = Ledger(out) if overwrite else Ledger.load(out)  # read once: discovery skips known files
    unchanged = Unchanged(ledger, options)  # files with nothing to do: counted, not kept
    counts = {}  # skipped as not media, counted as discovery goes on
    chunks = _found(found, unchanged, counts) if found else discover_chunks(
        list(roots or []),
        files_from,
        include,
        exclude,
        hidden,
        null,
        str(out),
        known=unchanged.known,
        counts=counts,
    )
    items = next(chunks)  # the rest is found as the engine reaches it, under OUT's lock
    report = encode_files(
        items,
        out,
        options,
        bar=bar or _Quiet,
        log=log,
        overwrite=overwrite,
        ledger=ledger,
        unchanged=unchanged,
        more=None if counts.get("last") else chunks,
        mirror=mirror,
    )
    return report | {"skipped_not_media": counts["skipped"]}


def _found(found, unchanged: Unchanged, counts: dict):
    """discover_chunks' one chunk for files given with their roots: (path, root, rel) each."""
    from ..media.discover import look

    items = (look(path, unchanged.known, root, rel) for path, root, rel in found)
    counts.update(skipped=0, last=True)
    yield sorted((i for i in items if i is not None), key=lambda i: i.path)


class _Quiet:
    """A progress bar that shows nothing (a library caller's default)."""

    def __init__(self, total: int):
        pass

    def advance(self, files: int, patches: int) -> None:
        pass

    def close(self) -> None:
        pass


def encode_files(
    items: list[Item],
    out: Path,
    options: Options,
    bar,
    log=None,
    overwrite: bool = False,
    ledger: Ledger | None = None,
    unchanged: Unchanged | None = None,
    more=None,
    mirror=None,
) -> dict:
    """The whole run, under OUT's lock, on the chosen engine; returns the summary that --json prints.

    `ledger`: OUT's manifest as discovery read it (read on here, not again from the start).
    `unchanged`: the files discovery left out of `items` as done (counted, looked at again if
    their rows changed meanwhile).
    `more`: discovery's further chunks (discover_chunks), decided as the engine reaches them
    (run/stream.py); the Ray driver takes them in rounds (run/ray.ROUND_FILES).
    `mirror`: where OUT is a URL, its mirror (output/mirror.py), `out` its local folder, both
    locked by the caller: shards and rows go on to the store as they are written.
    """
    from .preflight import can_wait, named, preflight

    out = Path(out)
    log = log or (lambda message: None)
    where = mirror.url if mirror is not None else out  # OUT as the user named it, for messages
    # where a person reads the rows: a store's manifest is in parts (its manifest.jsonl may be empty)
    see = f"see {where}/{MANIFEST}" if mirror is None else f"see gemma4enc inspect {where}"
    rerun = not overwrite and (out / SETTINGS).exists()
    # a re-run into a folder a loaded model made checks the model and devices only if there is work
    deferred = rerun and can_wait(options)
    pool = early_pool(items, options, rerun)
    try:
        options, extra = (
            (named(options), {"revision": None}) if deferred else preflight(options)
        )  # OUT untouched
    except BaseException:
        if pool is not None:
            pool.close()
        raise
    if options.dtype == "auto":  # decided once: recorded and used alike (a Ray run's driver decides)
        from ..model.load import resolve_dtype

        options = replace(options, dtype=resolve_dtype(options))
    created = not out.exists()
    try:
        with _locked(out) as lock:
            if lock.previous:
                log(f"took over the lock of an earlier run that is gone ({describe(lock.previous)})")
            ledger = ledger or Ledger(out)
            for note in prepare_out(
                out, options, overwrite, extra, ledger, repair=mirror.repair if mirror else None
            ):
                log(note)
            if unchanged is not None:
                items = unchanged.again(items)
            todo = still_to_do(items, out, options, ledger)
            stream = None
            if more is not None:
                from .stream import Stream

                stream = Stream(
                    items, todo, more, lambda chunk: still_to_do(chunk, out, options, ledger)
                )
                todo = stream.primed()
                items = ()
            appended_from = (
                ledger.path.stat().st_size if stream is not None and ledger.path.exists() else 0
            )
            # the files discovery found, done ones counted only
            found = (stream.found if stream else len(items)) + len(unchanged or ())
            if todo and deferred:
                options, extra = preflight(
                    options
                )  # now the model will load: find it, check the devices
            ready = lambda: _record_settings(out, options, extra, mirror)  # noqa: E731 - once the model has loaded
            if stream is not None:
                bar = _watched(bar, stream)
            run = Run(
                out, options, bar, log, done=found - len(todo), ready=ready, pool=pool, mirror=mirror
            )
            try:
                summary = (
                    _engine(options.engine)(todo, run)
                    if todo
                    else _nothing_to_do(run, checked=not deferred)
                )
            except TooManyFailures as e:
                raise TooManyFailures(
                    f"{e}; finished files are saved ({see})"
                ) from None
            if stream is not None:  # no list of the files to look them up by: the rows this run appended
                from .stream import failures_since

                found, done = (
                    stream.found + len(unchanged or ()),
                    stream.found + len(unchanged or ()) - stream.todo,
                )
                names, count = failures_since(out, appended_from) if todo else ([], 0)
                failures = names + [""] * (count - len(names))
            if mirror is not None:
                mirror.push()  # rows appended here and not yet sent (files found unchanged, moved)
            ledger.refresh()  # only the rows this run appended
            if stream is None:
                done = found - len(todo)
                failures = [
                    f"{Path(i.path).name}: {r.status}"
                    for i in todo
                    if (r := ledger.get(i.path)) and r.status != Status.OK
                ]
            note = compact_parts(mirror, ledger) if mirror else maybe_compact(out, ledger)
            if note:
                log(note)
    except UsageError:
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()  # the folder this run made for nothing
        raise
    finally:
        if pool is not None:
            pool.close()  # workers no map() took (the run ended before decoding); the engine stops its own
    if failures:
        log(f"{len(failures)} file(s) failed: {first_lines(failures)} ({see})")
    return {
        "out": str(out),
        "files": found,
        "done_before": done,
        "encoded": summary.ok,
        "failed": summary.failed,
        "by_status": summary.by_status,
        "frames": summary.frames,
        "tokens": summary.tokens,
        "patches": summary.patches,
        "seconds": round(summary.seconds, 3),
        "items_per_s": round(summary.files / summary.seconds, 3) if summary.seconds else None,
        "patches_per_s": round(summary.patches / summary.seconds, 1) if summary.seconds else None,
        "engine": options.engine,
        **summary.where,
    }


# a run on a store merges its manifest parts into the base once there are this many: a re-run
# reads every part (a request each), the base in one
AUTO_PARTS = 1000


def compact_parts(mirror, ledger: Ledger) -> str | None:
    """A store's manifest parts merged into its base once there are AUTO_PARTS (call under its
    lock, at the end of a run; `compact` does it whatever their number)."""
    parts = len(mirror.parts)
    if parts < AUTO_PARTS:
        return None
    report = compact(mirror.path, ledger)
    mirror.commit_compaction()
    return f"merged {parts} manifest parts into {mirror.url}/{MANIFEST} ({report['rows_after']} rows)"


def _record_settings(out: Path, options: Options, extra, mirror) -> None:
    write_settings(out, options, extra)
    if mirror is not None:
        mirror.push_settings()


def _watched(bar, stream):
    """The bar factory, each bar handed to `stream` so that later chunks grow its total."""
    return lambda total: stream.watch(bar(total))


def early_pool(items: list[Item], options: Options, rerun: bool):
    """Decode workers started before preflight imports torch (seconds), for a run that surely has work:
    a new or --overwrite output folder (no settings yet, so no rows to match) and files to encode,
    on the local engine. They begin at once on the first of `items` (the files such a run does
    first), so the first batch is decoded by the time the model has loaded (docs/benchmarks.md).
    Preflight changes only the model path and dtype, which decoding does not read. A re-run
    (settings there) may have nothing to do: its workers start in the engine, once todo is known."""
    if rerun or not items or options.engine != "local" or options.workers == 0:
        return None
    from ..media.workers import DecodePool

    return DecodePool(options, options.workers, options.decode_timeout).start(head=items)


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
        from .ray import encode
    else:
        from .local import encode
    return encode


def _nothing_to_do(run: Run, checked: bool):
    """Every file has its row: no model, no decode workers, no Ray (and no torch import).

    `checked`: preflight found the model (a folder this run made): its settings are recorded as
    a loaded model's would be. A re-run's settings already name the model that worked."""
    from types import SimpleNamespace

    options = run.options
    if checked:
        run.ready()
    summary = SimpleNamespace(
        files=0, ok=0, failed=0, by_status={}, frames=0, tokens=0, patches=0, seconds=0.0
    )
    if options.engine == "ray":
        run.log(f"{run.done} files, all done already; Ray not started")
        summary.where = {"ray_address": options.ray_address or "local"}
    else:
        run.log(f"{run.done} files, all done already; model not loaded")
        names = ", ".join(options.devices.split(",")) if options.devices else options.device
        summary.where = {
            "device": names,
            "dtype": options.dtype,
            "batching": options.batching,
            "max_batch_patches": 0,
            "tower_waited_share": None,
            "decode_files_per_s_per_worker": None,
        }  # as pipeline.NOTHING_TIMED
    return summary
