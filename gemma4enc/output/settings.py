"""OUT/settings.json: the settings that shape the output, recorded once and checked by every later run;
and the first step of a run under the lock: OUT proved writable, its settings compared, a killed
run's leftovers cleared (repair.py)."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import UsageError
from ..options import Options
from .files import MANIFEST, SHARD_RE, TEMP_RE, atomic_write, temp_name
from .ledger import Ledger
from .repair import repair as _local_repair

SETTINGS = "settings.json"  # OUT's record of the settings that shape the output
SEARCH_INDEX = (  # search's cache (output/vecstore.py names them too)
    "search-index.json", "search-index.vectors", "search-index.rows.npy", "search-index.paths",
    "search-index.faiss", "search-index.lock",
)


def read_settings(out: Path) -> dict | None:
    """What OUT/settings.json records, or None where there is none (or it cannot be read)."""
    try:
        return json.loads((Path(out) / SETTINGS).read_text())
    except (OSError, ValueError):
        return None


def ours(out: Path) -> list[Path]:
    """Everything gemma4enc writes in OUT (and only that: --overwrite removes these)."""
    return [
        p
        for p in out.iterdir()
        if SHARD_RE.match(p.name)
        or p.name in (MANIFEST, SETTINGS, *SEARCH_INDEX)
        or TEMP_RE.match(p.name)
    ]


def settings_of(options: Options, extra: dict | None = None) -> dict:
    """What settings.json records: the fingerprint, plus what the run resolved (the hub revision)."""
    return json.loads(json.dumps(options.fingerprint() | (extra or {})))


def prepare_out(
    out: Path,
    options: Options,
    overwrite: bool = False,
    extra: dict | None = None,
    ledger: Ledger | None = None,
    repair=None,
) -> list[str]:
    """Prove OUT writable, check its settings, clear a killed run's leftovers.

    Call with the lock held; `ledger` (OUT's manifest, read before the lock was taken) is brought
    up to date; `repair(out, ledger)` clears a killed run's leftovers (a store's own, where OUT is
    a URL's mirror: output/mirror.py). The settings are written by write_settings once the model has loaded: a run
    that fails before leaves none that would refuse the corrected command.
    Returns notes for the log (what was cleaned up).
    """
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / temp_name("write-test")
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise UsageError(f"cannot write to {out}: {e.strerror or e}") from None
    notes = []
    path = out / SETTINGS
    mine = settings_of(options, extra)
    if overwrite:
        removed = [p for p in ours(out) if p.name != SETTINGS]
        (out / MANIFEST).unlink(
            missing_ok=True
        )  # first: without it the shards are orphans, never half-used
        for p in removed:
            p.unlink(missing_ok=True)
        path.unlink(missing_ok=True)
        if removed:
            notes.append(f"--overwrite: removed {len(removed)} earlier output files")
    if path.exists():
        theirs = json.loads(path.read_text())
        # a key an earlier version did not record is not held against the folder
        changed = sorted(k for k in theirs if mine.get(k) != theirs.get(k))
        if changed:
            detail = ", ".join(f"{k}: {theirs.get(k)!r} → {mine.get(k)!r}" for k in changed)
            raise UsageError(
                f"{out} was made with other settings ({detail}); use another --out, "
                "or --overwrite to replace its contents"
            )
    return notes + (repair or _local_repair)(out, ledger)


def write_settings(out: Path, options: Options, extra: dict | None = None) -> None:
    """Record the settings (once: a later run only checks them), beside a manifest.

    An empty manifest is created with them: a run over an empty drop folder leaves an OUT that
    verify, inspect and open() read as a folder of no files, not as something else.
    """
    with open(out / MANIFEST, "ab"):  # appends nothing: creates it where missing, keeps it where not
        pass
    path = out / SETTINGS
    if not path.exists():
        mine = settings_of(options, extra)
        atomic_write(path, lambda tmp: tmp.write_text(json.dumps(mine, indent=2)))
