"""One run: OUT's settings resumed, the walk, then under OUT's lock: preflight, what is left to do,
the engine, the summary. `encode` is what the command does; `encode_files` the run over files found."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import TooManyFailures, UsageError, first_lines
from ..media.kinds import Item
from ..options import Options
from ..output.ledger import Ledger
from ..output.lock import describe
from ..output.names import SETTINGS
from ..output.opening import open_out
from ..output.out import Out
from ..output.todo import Unchanged, still_to_do
from ..rows import Status
from .context import Run
from .summary import NOTHING_TIMED, Summary


@dataclass(frozen=True)
class Walk:
    """How discovery walks the roots: the encode command's own options for it."""

    files_from: str | None = None
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    hidden: bool = False
    null: bool = False


def encode(
    roots,
    out,
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

    `out`: OUT as the user named it (a folder or a URL). `flags`: settings by Options field name
    (frames/fps/max_frames for the sampling; the rest take their defaults); `given`: the names the
    user gave. For the output-shaping settings not given, OUT/settings.json is read back
    (Options.resume), and what it changed is logged. The summary --json prints, with
    `skipped_not_media`. `found`: instead of roots, the files as (path, root, rel), each kept
    under the root a walk found it in (verify --repair's files: their rows keep `root` and `rel`,
    so a moved folder is still recognised)."""
    from .tempsweep import sweep

    log = log or (lambda message: None)
    sweep()  # the temp folders of runs killed with kill -9
    walk = Walk(files_from, tuple(include or ()), tuple(exclude or ()), hidden, null)
    with open_out(out, write=True, overwrite=overwrite) as out:  # a store is locked here (out.py)
        saved = None if overwrite else out.settings()  # a re-run may omit the flags
        options, notes = Options.resume(saved, flags or {}, given, where=out.named(SETTINGS))
        for note in notes:
            log(note)
        if not roots and not walk.files_from and not found:
            raise UsageError("nothing to encode: give folders or files, or --files-from")
        ledger = out.ledger(read=not overwrite)  # read once: discovery skips known files
        unchanged = Unchanged(ledger, options)  # files with nothing to do: counted, not kept
        counts = {}  # skipped as not media, counted as discovery goes on
        chunks = _found(found, unchanged, counts) if found else _discovered(roots, walk, out, unchanged, counts)
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
        )
        return report | {"skipped_not_media": counts["skipped"], "shard_sizes": out.shard_sizes()}


def _discovered(roots, walk: Walk, out: Out, unchanged: Unchanged, counts: dict):
    """discover_chunks over the roots, OUT itself left out of the walk."""
    from ..media.discover import discover_chunks

    return discover_chunks(
        list(roots or []),
        walk.files_from,
        list(walk.include),
        list(walk.exclude),
        walk.hidden,
        walk.null,
        out.walked_past(),
        known=unchanged.known,
        counts=counts,
    )


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
    out: Out,
    options: Options,
    bar,
    log=None,
    overwrite: bool = False,
    ledger: Ledger | None = None,
    unchanged: Unchanged | None = None,
    more=None,
) -> dict:
    """The whole run, under OUT's lock, on the chosen engine; returns the summary that --json prints.

    `out`: OUT (output/out.py; a path is taken for a folder). `ledger`: OUT's manifest as discovery
    read it (read on here, not again from the start). `unchanged`: the files discovery left out of
    `items` as done (counted, looked at again if their rows changed meanwhile). `more`: discovery's
    further chunks (discover_chunks), decided as the engine reaches them (run/stream.py); the Ray
    driver takes them in rounds (run/ray.ROUND_FILES).
    """
    from .preflight import preflight

    log = log or (lambda message: None)
    rerun = not overwrite and out.path(SETTINGS).exists()
    options, extra, deferred, pool = _checked(items, options, rerun)
    created = out.is_new()
    try:
        with out.locked() as lock:
            if lock is not None and lock.previous:
                log(f"took over the lock of an earlier run that is gone ({describe(lock.previous)})")
            ledger = ledger if ledger is not None else out.ledger(read=False)  # an empty one is falsy (len)
            for note in out.prepare(options, overwrite, extra, ledger):
                log(note)
            todo, stream, found = _to_do(items, out, options, ledger, unchanged, more)
            appended_from = ledger.path.stat().st_size if stream is not None and ledger.path.exists() else 0
            if todo and deferred:  # now the model will load: find it, check the devices
                options, extra = preflight(options)
            if stream is not None:
                bar = _watched(bar, stream)
            run = Run(out, options, bar, log, done=found - len(todo), pool=pool,
                      ready=lambda: out.record_settings(options, extra))  # once the model has loaded
            try:
                summary = _engine(options.engine)(todo, run) if todo else _nothing_to_do(run, checked=not deferred)
            except TooManyFailures as e:
                raise TooManyFailures(f"{e}; finished files are saved ({out.rows_hint()})") from None
            found, done, failures = _outcome(todo, stream, found, ledger, appended_from, unchanged)
            note = out.finish(ledger)  # rows not yet sent (files found unchanged, moved), compaction if due
            if note:
                log(note)
    except UsageError:
        if created:
            out.remove_if_empty()  # the folder this run made for nothing
        raise
    finally:
        if pool is not None:
            pool.close()  # workers no map() took (the run ended before decoding); the engine stops its own
    if failures:
        log(f"{len(failures)} file(s) failed: {first_lines(failures)} ({out.rows_hint()})")
    return _summary(out, found, done, summary, options)


def _checked(items: list[Item], options: Options, rerun: bool):
    """(options, extra, deferred, pool) once the model and devices are checked (OUT untouched).

    A re-run into a folder a loaded model made checks them only if there is work (`deferred`);
    decode workers may start first, while torch imports (early_pool)."""
    from .preflight import can_wait, named, preflight

    deferred = rerun and can_wait(options)
    pool = early_pool(items, options, rerun)
    try:
        options, extra = (named(options), {"revision": None}) if deferred else preflight(options)
    except BaseException:
        if pool is not None:
            pool.close()
        raise
    if options.dtype == "auto":  # decided once: recorded and used alike (a Ray run's driver decides)
        from ..model.load import resolve_dtype

        options = replace(options, dtype=resolve_dtype(options))
    return options, extra, deferred, pool


def _to_do(items, out: Out, options: Options, ledger: Ledger, unchanged, more):
    """(the files to encode, the Stream of later chunks or None, the files discovery found)."""
    if unchanged is not None:
        items = unchanged.again(items)
    todo = still_to_do(items, out, options, ledger)
    stream = None
    if more is not None:
        from .stream import Stream

        stream = Stream(items, todo, more, lambda chunk: still_to_do(chunk, out, options, ledger))
        todo = stream.primed()
        items = ()
    # the files discovery found, done ones counted only
    found = (stream.found if stream else len(items)) + len(unchanged or ())
    return todo, stream, found


def _outcome(todo, stream, found: int, ledger: Ledger, appended_from: int, unchanged):
    """(files found, done before, failures as "name: status") once the engine is through."""
    if stream is not None:  # no list of the files to look them up by: the rows this run appended
        from .stream import failures_since

        found = stream.found + len(unchanged or ())
        names, count = failures_since(ledger.path, appended_from) if todo else ([], 0)
        ledger.refresh()  # only the rows this run appended
        return found, found - stream.todo, names + [""] * (count - len(names))
    ledger.refresh()
    failures = [
        f"{Path(i.path).name}: {r.status}" for i in todo if (r := ledger.get(i.path)) and r.status != Status.OK
    ]
    return found, found - len(todo), failures


def _summary(out: Out, found: int, done: int, summary, options: Options) -> dict:
    return {
        "out": out.url,
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

    workers = None if options.workers is None else min(options.workers, len(items))  # no idle process per file
    return DecodePool(options, workers, options.decode_timeout).start(head=items)


def _engine(name: str):
    """--engine → its encode(todo, run); Ray is imported only when asked for."""
    if name == "ray":
        from .ray import encode
    else:
        from .local import encode
    return encode


def _nothing_to_do(run: Run, checked: bool) -> Summary:
    """Every file has its row: no model, no decode workers, no Ray (and no torch import).

    `checked`: preflight found the model (a folder this run made): its settings are recorded as
    a loaded model's would be. A re-run's settings already name the model that worked."""
    options = run.options
    if checked:
        run.ready()
    if options.engine == "ray":
        run.log(f"{run.done} files, all done already; Ray not started")
        return Summary(where={"ray_address": options.ray_address or "local"})
    run.log(f"{run.done} files, all done already; model not loaded")
    names = ", ".join(options.devices.split(",")) if options.devices else options.device
    where = {"device": names, "dtype": options.dtype, "batching": options.batching, "max_batch_patches": 0}
    return Summary(where=where | NOTHING_TIMED)
