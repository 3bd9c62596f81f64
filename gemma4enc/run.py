"""One run: lock and preflight the output folder, what is left to do, the engine, the summary."""

from __future__ import annotations

from pathlib import Path

from .discover import Item
from .engines import Run
from .errors import UsageError, first_lines
from .ledger import MANIFEST, Ledger
from .options import Options
from .outdir import SETTINGS, Lock, describe, maybe_compact, prepare_out, still_to_do


def encode_files(items: list[Item], out: Path, options: Options, bar, log=None, overwrite: bool = False,
                 ledger: Ledger | None = None) -> dict:
    """The whole run, under OUT's lock, on the chosen engine; returns the summary that --json prints.

    `ledger`: OUT's manifest as discovery read it (read on here, not again from the start).
    """
    out = Path(out)
    log = log or (lambda message: None)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot write to {out}: {e.strerror or e}") from None
    with Lock(out) as lock:
        if lock.previous:
            log(f"took over the lock of an earlier run that is gone ({describe(lock.previous)})")
        ledger = ledger or Ledger(out)
        fresh = overwrite or not (out / SETTINGS).exists()  # no earlier run has proved --model here
        for note in prepare_out(out, options, overwrite, ledger):
            log(note)
        todo = still_to_do(items, out, options, ledger)
        run = Run(out, options, bar, log, done=len(items) - len(todo))
        summary = _engine(options.engine)(todo, run) if todo else _nothing_to_do(run, check_model=fresh)
        ledger.refresh()  # only the rows this run appended
        failures = [f"{Path(i.path).name}: {r.status}" for i in todo if (r := ledger.get(i.path)) and r.status != "ok"]
        note = maybe_compact(out, ledger)
        if note:
            log(note)
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


def _engine(name: str):
    """--engine → its encode(todo, run); Ray is imported only when asked for."""
    if name == "ray":
        from .engines.ray import encode
    else:
        from .engines.local import encode
    return encode


def _nothing_to_do(run: Run, check_model: bool):
    """Every file has its row: no model, no decode workers, no Ray (and no torch import).

    A folder this run made has no run behind it that found --model: that is still checked (a
    wrong one exits 2), without loading it. A re-run's settings already name the model that worked."""
    from types import SimpleNamespace

    options = run.options
    if check_model:
        from .model import find_checkpoint

        find_checkpoint(options.model)
    summary = SimpleNamespace(files=0, ok=0, failed=0, by_status={}, frames=0, tokens=0, patches=0, seconds=0.0)
    if options.engine == "ray":
        run.log(f"{run.done} files, all done already; Ray not started")
        summary.where = {"ray_address": options.ray_address or "local"}
    else:
        run.log(f"{run.done} files, all done already; model not loaded")
        names = ", ".join(options.devices.split(",")) if options.devices else options.device
        summary.where = {"device": names, "dtype": options.dtype, "batching": options.batching, "max_batch_patches": 0}
    return summary
