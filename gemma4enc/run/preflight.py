"""Before OUT is touched: the checkpoint is found, the devices exist, the settings are made exact.

A run that fails here leaves nothing behind, so the corrected command is not refused as "made
with other settings". What is recorded names the model one way however it was written (DIR/,
./DIR, a symlink, the absolute path) and the dtype the tower really runs in, not "auto".
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..options import Options


def named(options: Options) -> Options:
    """The model named one way however it was written (a local folder: its resolved path); no check."""
    local = Path(options.model).expanduser().is_dir()
    return replace(options, model=str(Path(options.model).expanduser().resolve())) if local else options


def can_wait(options: Options) -> bool:
    """Whether a re-run may put the check off until it has work: a local model with a stated dtype is
    recorded as it is, without torch or transformers (a hub id needs its commit, auto its device)."""
    return Path(options.model).expanduser().is_dir() and options.dtype != "auto"


def preflight(options: Options) -> tuple[Options, dict]:
    """(options with the model path and dtype resolved, what else settings.json records).

    Raises UsageError for a model that is not there or a device this machine lacks. A run calls it
    once: before OUT is touched, or, on a re-run that `can_wait`, once there is work."""
    local = Path(options.model).expanduser().is_dir()
    model = str(Path(options.model).expanduser().resolve()) if local else options.model
    from ..model.checkpoint import find_checkpoint
    from ..model.load import devices, dtype_name, parse_device

    ckpt = find_checkpoint(options.model, options.revision)
    dtype = options.dtype
    if options.engine == "local":  # a Ray actor's device is only known where it runs
        found = [parse_device(d) for d in devices(options)]
        dtype = dtype_name(options.dtype, found[0])
    # a hub id's towers (Ray actors too) open the commit resolved here, whatever its branch does next
    revision = None if local else ckpt.revision
    return replace(options, model=model, dtype=dtype, revision=revision), {"revision": revision}
