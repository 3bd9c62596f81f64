"""OUT/settings.json's contents: the settings that shape the output, recorded once (Out.record_settings)
and checked by every later run (Out.prepare). Pure functions: reading and writing the file is Out's."""

from __future__ import annotations

import json

from ..errors import UsageError
from ..options import Options


def settings_of(options: Options, extra: dict | None = None) -> dict:
    """What settings.json records: the fingerprint, plus what the run resolved (the hub revision)."""
    return json.loads(json.dumps(options.fingerprint() | (extra or {})))


def check(theirs: dict, mine: dict, where) -> None:
    """A run's settings against those OUT records: an output-shaping change is a usage error.
    A key an earlier version did not record is not held against the folder."""
    changed = sorted(k for k in theirs if mine.get(k) != theirs.get(k))
    if changed:
        detail = ", ".join(f"{k}: {theirs.get(k)!r} → {mine.get(k)!r}" for k in changed)
        raise UsageError(
            f"{where} was made with other settings ({detail}); use another --out, "
            "or --overwrite to replace its contents"
        )
